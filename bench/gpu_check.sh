#!/usr/bin/env bash
# GPU checks of the model / rotary work (issue 4). Run on a CUDA machine from anywhere:
#
#     bash bench/gpu_check.sh                 # logs and a summary under bench/gpu_results/
#     PYTHON=/path/to/python OUT_DIR=/tmp/gc bash bench/gpu_check.sh
#
# 1. installs triton if it is missing (the optional `gpu` extra; CUDA torch wheels usually ship it)
# 2. runs the rotary backend tests on CUDA (triton, flash_attn / apex when installed) and a model
#    check: triton backend vs reference on the GPU, fwd + bwd, bf16
# 3. bench/rotary.py on the GPU, bf16 and fp32, S 512 and 1536: time and achieved memory bandwidth
# 4. bench/step.py on the GPU in bf16 at the benchmark size (S 512 and S 1536), ours vs HF
# 5. bench/step.py for the base model (hidden 768, 12 layers, 12 heads, FFN 3072, vocab 50000) at
#    S 512 in bf16: MFU of ours (and of HF for comparison)
# Every step runs even if an earlier one failed; the script exits non-zero if any failed.
# Not run on the machine it was written on (no GPU there).

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-bench/gpu_results}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
SUMMARY="$OUT/summary.txt"
FAILED=0

log() { echo "== $*" | tee -a "$SUMMARY"; }

run_step() {  # name, command...
  local name=$1; shift
  log "$name: $*"
  if timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1; then
    log "$name: ok"
  else
    log "$name: FAILED (rc $?) -- see $OUT/$name.log"
    tail -20 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    FAILED=1
  fi
  grep -h '^{"bench"' "$OUT/$name.log" >> "$SUMMARY" 2>/dev/null || true
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 2
fi
mkdir -p "$OUT"
: > "$SUMMARY"
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| cuda", torch.version.cuda)' | tee -a "$SUMMARY"

if ! "$PY" -c 'import triton' 2>/dev/null; then
  log "triton missing: installing the gpu extra"
  "$PY" -m pip install -q -e '.[gpu]' || "$PY" -m pip install -q triton || log "WARNING: triton install failed"
fi
"$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tee -a "$SUMMARY"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

run_step rotary_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_rotary.py

run_step model_gpu "$PY" - <<'EOF'
import dataclasses, torch
from roformer_dist.config import ModelConfig
from roformer_dist.model import RoFormerForMaskedLM
from roformer_dist.rotary import resolve_backend
cfg = ModelConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  rotary_backend="reference")
print("auto on cuda ->", resolve_backend("auto", "cuda"))
ids = torch.randint(5, 1000, (4, 512), device="cuda")
labels = torch.where(torch.rand(4, 512, device="cuda") < 0.15, ids, -100)
mask = torch.ones(4, 512, dtype=torch.long, device="cuda"); mask[1, 300:] = 0
res = {}
for backend in ("reference", "triton"):
    torch.manual_seed(0)
    m = RoFormerForMaskedLM(dataclasses.replace(cfg, rotary_backend=backend)).cuda().to(torch.bfloat16)
    out = m(ids, mask, labels=labels)
    out.loss.backward()
    res[backend] = (out.loss.item(), m.layers[0].attention.qkv.weight.grad.float())
    print(backend, "loss", out.loss.item())
for mk in (None, mask):  # fp32 parity of the SDPA path, no mask (flash) and padding mask
    torch.manual_seed(0)
    m = RoFormerForMaskedLM(dataclasses.replace(cfg, rotary_backend="triton")).cuda().eval()
    r = RoFormerForMaskedLM(cfg).cuda().eval(); r.load_state_dict(m.state_dict())
    with torch.no_grad():
        d = (m(ids, mk).logits - r(ids, mk).logits).abs().max().item()
    print("fp32 triton vs reference max diff", d); assert d < 1e-4, d
assert abs(res["reference"][0] - res["triton"][0]) < 2e-2, res
g0, g1 = res["reference"][1], res["triton"][1]
rel = ((g0 - g1).norm() / g0.norm()).item()
print("bf16 grad rel diff", rel); assert rel < 2e-2
print("model_gpu ok")
EOF

BACKENDS=reference,compiled,triton
"$PY" -c 'import flash_attn' 2>/dev/null && BACKENDS="$BACKENDS,flash_attn"
run_step rotary_bench_bf16 "$PY" bench/rotary.py --device cuda --dtypes bf16,fp32 --seqs 512,1536 \
  --backends "$BACKENDS" --repeats 20

run_step step_bf16_s512 "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --repeats 20 --warmup 3
run_step step_bf16_s1536 "$PY" bench/step.py --device cuda --dtype bf16 --seq 1536 --repeats 20 --warmup 3
run_step step_bf16_s512_dropout "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --dropout 0.1 \
  --repeats 20 --warmup 3
run_step mfu_base_s512 "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --batch 32 --hidden 768 \
  --layers 12 --heads 12 --ffn 3072 --vocab 50000 --repeats 20 --warmup 3
run_step mfu_base_s512_ours_b64 "$PY" bench/step.py --device cuda --dtype bf16 --seq 512 --batch 64 \
  --hidden 768 --layers 12 --heads 12 --ffn 3072 --vocab 50000 --repeats 20 --warmup 3 --ours-only

log "done; failed=$FAILED"
cat "$SUMMARY"
exit $FAILED
