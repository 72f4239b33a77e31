"""The Python checks of ``bench/gpu_check.sh`` (one JSON line per figure, like every bench).

    python bench/gpu_check.py [backends] [--device cuda]   # rotary backends equal at the model level
    python bench/gpu_check.py train-report RUN_DIR         # figures of a finished roformer-train run
    python bench/gpu_check.py --tiny                       # backends on CPU, hidden 16, 12 tokens (any machine)

``backends``: the whole model (2 layers, rotary on q, k and v) with every rotary backend available on
the device (reference, compiled, triton, flash_attn, apex) against the reference backend, for softmax
and linear attention, in fp32 (logits, loss and gradients: equal to rounding) and bf16 (loss and a
relative gradient difference: the two roundings differ). Exits 1 if a backend is off. Without a GPU
(``--device cpu``, the default there) it runs the same checks, small, with Triton under its
interpreter (this process sets TRITON_INTERPRET=1 for itself): the dry run the tests do; ``--tiny`` is
that dry run at the smallest sizes, on CPU even where there is a GPU. The compiled backend starts each
model run from a fresh ``torch._dynamo`` cache: the dtypes, attentions and train / eval passes of one
check would otherwise pass torch.compile's recompile limit, after which it silently runs eagerly.

``train-report``: reads ``metrics.jsonl``, ``config.yaml`` and TensorBoard of a run (e.g. the bf16 ZeRO-2
NCCL run of gpu_check.sh), checks that every step has a finite loss and none was skipped, and prints
tokens/s and the trainer's MFU (``perf/mfu``) beside the peak it divides by (``metrics.peak_flops`` at the
run's matmul precision: the one function of the trainer and the benches). With ``trainer.profile`` set, it
checks the window's trace is there and, on a GPU, holds CUDA kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

FP32_TOL = 1e-4   # logits / loss, fp32: different kernels, same math
BF16_LOSS_TOL = 2e-2
BF16_GRAD_REL_TOL = 2e-2


def available_backends(device: str, wanted: str = "") -> list[str]:
    """The non-reference backends that can run on ``device`` (optionally only those in ``wanted``)."""
    from roformer_dist.nn import rotary as R

    names = ["compiled"]
    if R.triton_available() and (device.startswith("cuda") or R.triton_interpreted()):
        names.append("triton")
    if device.startswith("cuda") and R.flash_attn_available():
        names.append("flash_attn")
    if device.startswith("cuda") and R.apex_available():
        names.append("apex")
    return [n for n in names if not wanted or n in wanted.split(",")]


def _model_run(cfg, backend: str, device: str, dtype, ids, mask, labels):
    from roformer_dist.nn.model import RoFormerForMaskedLM

    if backend == "compiled":  # compile this run's kernels (see the module docstring: the recompile limit)
        torch._dynamo.reset()
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(dataclasses.replace(cfg, rotary_backend=backend)).to(device, dtype)
    out = model(ids, mask, labels=labels)
    out.loss.backward()
    grad = model.layers[0].attention.qkv.weight.grad.float()
    model.eval()
    with torch.no_grad():
        logits = model(ids, mask).logits.float()
    return out.loss.item(), grad, logits


def check_backends(a) -> int:
    from roformer_dist.config import ModelConfig

    small = a.device == "cpu"
    hidden, seq, batch = (16, 12, 2) if a.tiny else (32, 24, 2) if small else (256, 512, 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (batch, seq), generator=g).to(a.device)
    labels = torch.where(torch.rand(batch, seq, generator=g).to(a.device) < 0.15, ids, -100)
    mask = torch.ones_like(ids)
    mask[1, seq * 2 // 3:] = 0
    failed = 0
    for attention in ("softmax", "linear"):
        cfg = ModelConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=2 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          rotary_value=True, attention=attention, rotary_backend="reference")
        for dname in a.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
            ref_loss, ref_grad, ref_logits = _model_run(cfg, "reference", a.device, dtype, ids, mask, labels)
            for backend in available_backends(a.device, a.backends):
                loss, grad, logits = _model_run(cfg, backend, a.device, dtype, ids, mask, labels)
                loss_diff = abs(loss - ref_loss)
                grad_rel = ((grad - ref_grad).norm() / ref_grad.norm()).item()
                logit_diff = (logits - ref_logits).abs().max().item()
                if dtype == torch.float32:
                    ok = max(loss_diff, logit_diff) <= FP32_TOL and grad_rel <= FP32_TOL
                    figure, tol = max(loss_diff, logit_diff), FP32_TOL
                else:
                    ok = loss_diff <= BF16_LOSS_TOL and grad_rel <= BF16_GRAD_REL_TOL
                    figure, tol = loss_diff, BF16_LOSS_TOL
                failed += not ok
                C.emit("gpu_backend_equality", figure, tol, "abs diff", tol / max(figure, 1e-12), backend=backend,
                       attention=attention, dtype=dname, device=a.device, loss_diff=loss_diff,
                       logit_max_diff=logit_diff, qkv_grad_rel_diff=grad_rel, ok=ok)
    return 1 if failed else 0


def profile_report(run: Path, start_step: int) -> dict:
    """The trace of the run's ``trainer.profile`` window: its file and how many of its events are CUDA
    kernels (none: the profiler saw no GPU activity)."""
    traces = sorted((run / "profile").glob("trace_steps_*.pt.trace.json"))
    if not traces:
        return {"profile_trace": None, "profile_kernels": 0, "profile_ok": start_step == 0}
    events = json.loads(traces[-1].read_text()).get("traceEvents", [])
    kernels = sum(e.get("cat") == "kernel" for e in events)
    return {"profile_trace": str(traces[-1]), "profile_kernels": kernels,
            "profile_ok": kernels > 0 or not torch.cuda.is_available()}


def train_report(a) -> int:
    import yaml

    from roformer_dist.runtime.events import read_scalars
    from roformer_dist.train.metrics import matmul_precision, peak_flops

    run = Path(a.run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    losses = [r["loss"] for r in records]
    finite = all(x is not None and x == x and abs(x) != float("inf") for x in losses)
    skipped = sum(bool(r.get("skipped")) for r in records)
    scalars = read_scalars(run / "tb")
    tok_s = [v for _, v in scalars.get("perf/tokens_per_s", [])][1:]  # the first step includes warm-up
    tok = statistics.median(tok_s) if tok_s else 0.0
    # perf/mfu is the trainer's (metrics.peak_flops at the run's precision); the peak is printed beside it
    mfu_s = [v for _, v in scalars.get("perf/mfu", [])][1:]
    precision = matmul_precision(cfg["deepspeed"]["precision"])
    peak = peak_flops(precision)
    profile = profile_report(run, cfg["trainer"]["profile"]["start_step"])
    ok = finite and skipped == 0 and len(records) > 0 and profile["profile_ok"]
    C.emit(a.name, tok, tok, "tokens/s", 1.0, steps=len(records), first_loss=losses[0] if losses else None,
           last_loss=losses[-1] if losses else None, skipped=skipped, finite=finite,
           mfu=round(statistics.median(mfu_s), 4) if mfu_s else None, precision=precision,
           peak_tflops=peak / 1e12 if peak else None,
           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **profile, ok=ok)
    return 0 if ok else 1


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "backends")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backends", help="rotary backends vs reference at the model level")
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--dtypes", default="fp32,bf16")
    b.add_argument("--backends", default="", help="comma list to check (default: every one available)")
    C.tiny_defaults(b, argv, device="cpu")
    t = sub.add_parser("train-report", help="figures of a finished roformer-train run")
    t.add_argument("run_dir")
    t.add_argument("--name", default="gpu_train", help="the JSON line's bench name")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.command == "backends":
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            print("gpu_check.py backends: no CUDA device", file=sys.stderr)
            return 2
        if a.device == "cpu":  # before triton defines the kernel; this process only
            os.environ.setdefault("TRITON_INTERPRET", "1")
        return check_backends(a)
    return train_report(a)


if __name__ == "__main__":
    sys.exit(main())
