"""Shared helpers of bench/*.py: timing medians, peak-RSS measurement, the table and the JSON line."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

# `python bench/x.py` from a checkout works without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_median(fn: Callable[[], object], repeats: int, warmup: int = 1, device: str = "cpu") -> float:
    """Median wall time in seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                     device: str = "cpu") -> dict[str, float]:
    """Median seconds per function, runs interleaved (a, b, a, b, ...) so drift hits both alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status()["VmRSS"]


def peak_rss() -> int:
    return _proc_status()["VmHWM"]


def cuda_peak_delta(fn: Callable[[], object]) -> int:
    """Bytes of CUDA memory ``fn()`` needs at its peak beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float)
                                            else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def emit(bench: str, ours: float, baseline: float, unit: str, ratio: float, **extra: object) -> None:
    """The one JSON line every bench ends with (ratio > 1 = ours better)."""
    print(json.dumps({"bench": bench, "ours": round(ours, 6), "baseline": round(baseline, 6), "unit": unit,
                      "ratio": round(ratio, 3), **extra}))
    sys.stdout.flush()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
