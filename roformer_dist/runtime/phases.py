"""Where a training step goes: the step's phases marked for the profiler, and their table from a trace.

The runner wraps each part of a step in :func:`phase` (a ``torch.profiler.record_function`` named
``phase: <name>``; without an active profiler it costs a few microseconds):

``data``       waiting for the loader's next micro-batch
``forward``    the engine's forward, the batch's copy to the device included
``backward``   the engine's backward; ZeRO-2 reduces gradient buckets from inside it
``optimizer``  the engine's step: the optimizer, and ZeRO's reductions and gathers around it

What no phase covers is *other*: the loop's logging, the host's sums, Python between the phases.

:func:`step_table` reads a Chrome trace (``export_chrome_trace``) of whole optimizer steps (the profile
window's ``optimizer_step_<k>`` markers) and gives per step, averaged over the window:

- each phase's wall time on the host and its share of the step;
- on a GPU, the device time of the kernels, copies and fills each phase *launched* (a kernel belongs to
  the phase that was running on the host when its launch call was made, whichever thread made it), of
  which NCCL kernels (communication: ZeRO's buckets, the data-parallel all-reduce);
- the GPU's busy time (the union of everything that ran on it) and idle time (the step's wall time less
  that), the number of launches and the host time spent in the launch calls.

The profiler slows the host (a few microseconds an operator): read shares and device times, not the
absolute wall times of a launch-bound step.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

__all__ = ["PHASES", "phase", "step_table", "format_step_table", "read_trace", "union_length"]

PHASES = ("data", "forward", "backward", "optimizer")
"""The marked phases of a step, in the order they run."""
_PREFIX = "phase: "
_STEP = re.compile(r"^optimizer_step_(\d+)$")
_DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_LAUNCH = re.compile(r"^(cuda|cu|hip)(LaunchKernel|LaunchKernelExC|LaunchCooperativeKernel|GraphLaunch)")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark ``name`` (one of :data:`PHASES`) for the profiler while the block runs."""
    with torch.profiler.record_function(_PREFIX + name):
        yield


def read_trace(path: Path) -> list[dict]:
    """The complete events (``ph: X``) of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals: overlaps counted once, gaps not at all."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _phase_at(starts: list[tuple[float, float, str]], t: float) -> str:
    for a, b, name in starts:
        if a <= t <= b:
            return name
    return "other"


def step_table(events: list[dict]) -> Optional[dict]:
    """The table of the module docstring from a trace's complete events; None when the trace holds no
    ``optimizer_step_<k>`` marker. Times in milliseconds per step."""
    steps = [e for e in events if _STEP.match(str(e.get("name", ""))) and e.get("cat") == "user_annotation"]
    if not steps:
        return None
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    n = len(steps)
    step_us = sum(e["dur"] for e in steps) / n
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"][len(_PREFIX):]) for e in events
                   if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(_PREFIX)
                   and lo <= e["ts"] <= hi)
    wall = {name: 0.0 for name in PHASES}
    for a, b, name in marks:
        wall[name] = wall.get(name, 0.0) + (b - a)
    wall["other"] = max(0.0, step_us * n - sum(wall.values()))
    launches = {}
    launch_us = 0.0
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e["ts"] <= hi:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e["ts"]
            if _LAUNCH.match(str(e.get("name", ""))):
                launch_us += e["dur"]
    device = [e for e in events if e.get("cat") in _DEVICE_CATEGORIES]
    device_us = {name: 0.0 for name in wall}
    comm_us = {name: 0.0 for name in wall}
    spans = []
    kernels = 0
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        if corr not in launches:
            continue   # launched outside the window
        name = _phase_at(marks, launches[corr])
        device_us[name] += e["dur"]
        if "nccl" in str(e.get("name", "")).lower():
            comm_us[name] += e["dur"]
        spans.append((e["ts"], e["ts"] + e["dur"]))
        kernels += e.get("cat") == "kernel"
    on_gpu = bool(device)
    ms = 1e-3 / n
    rows = [{"phase": name, "wall_ms": wall[name] * ms, "share": wall[name] / (step_us * n) if step_us else 0.0,
             **({"gpu_ms": device_us[name] * ms, "nccl_ms": comm_us[name] * ms} if on_gpu else {})}
            for name in (*PHASES, "other")]
    table = {"steps": [int(_STEP.match(e["name"]).group(1)) for e in sorted(steps, key=lambda e: e["ts"])],
             "step_ms": step_us * 1e-3, "phases": rows}
    if on_gpu:
        busy = union_length(spans)
        table["gpu"] = {"busy_ms": busy * ms, "idle_ms": max(0.0, step_us * n - busy) * ms,
                        "busy_share": busy / (step_us * n) if step_us else 0.0,
                        "kernels_per_step": kernels / n, "launch_host_ms": launch_us * ms}
    return table


def format_step_table(table: dict) -> str:
    """The table as text (a header line, a row per phase, the GPU's line)."""
    steps = table["steps"]
    gpu = "gpu" in table
    head = f"{'phase':<10} {'wall ms':>9} {'share':>7}" + (f" {'GPU ms':>9} {'of it NCCL':>10}" if gpu else "")
    lines = [f"where a step goes: steps {steps[0]}-{steps[-1]} ({len(steps)} steps), {table['step_ms']:.1f} ms a "
             "step on the host (under the profiler)", head]
    for r in table["phases"]:
        line = f"{r['phase']:<10} {r['wall_ms']:>9.2f} {r['share']:>7.1%}"
        if gpu:
            line += f" {r['gpu_ms']:>9.2f} {r['nccl_ms']:>10.2f}"
        lines.append(line)
    if gpu:
        g = table["gpu"]
        lines.append(f"GPU busy {g['busy_ms']:.2f} ms a step ({g['busy_share']:.1%}), idle {g['idle_ms']:.2f} ms; "
                     f"{g['kernels_per_step']:.0f} kernels a step, {g['launch_host_ms']:.2f} ms of host time in "
                     "launch calls")
    else:
        lines.append("no GPU in the trace: host wall times only")
    return "\n".join(lines) + "\n"
