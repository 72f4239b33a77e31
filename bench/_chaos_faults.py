"""bench/chaos.py's faults: the seeded schedule that draws them (signals at a wall time, a slowed rank, fault
points, damage between launches, stale locks, a full disk, a kill during a JIT build, a second fault during
recovery) and
the faults made between two launches (a damaged checkpoint, a stale lock record, a full tmpfs)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Optional

from _chaos_launch import LOG_EVERY, SLOW_LOG_STEPS, TOTAL_STEPS, Fault, Launch, complete_checkpoints, metrics

from roformer_dist.runtime.faults import ACTIONS

SIGNAL_KINDS = ("kill-rank", "kill-launcher", "kill-group", "term-group", "int-group", "usr2-group", "stop-rank",
                "slow-rank")
"""stop-rank: SIGSTOP of one rank once the launch trains (a hang: the watchdog must end the launch). slow-rank: one
rank stopped and continued in turn from then until the launch ends (a straggler: named, not taken for a hang)."""
SLOW_STEPS_LEFT = (SLOW_LOG_STEPS + 1) * LOG_EVERY
"""The steps a run must have left for the tiny campaign's forced slow-rank (its warning due before the end)."""
POINT_OCCURRENCES = {  # point -> the largest N drawn for POINT@N (how often one launch passes it, roughly)
    "save.begin": 3, "save.before_file": 8, "save.after_file": 8, "save.before_complete": 3,
    "save.before_latest": 3, "save.after_latest": 3, "loader.state": 3, "stage.switch": 2, "eval": 4,
    "step.end": 8,
}
RANK0_ONLY = {"save.before_complete", "save.before_latest", "save.after_latest"}
JIT_BUILD_SHARE = 0.03
"""The chance that a fault drawn before a launch is a kill during a JIT build (each costs a build of the op)."""


# ----------------------------------------------------------------------------------------- the schedule

class Schedule:
    """The seeded draw of faults; ``disk``: whether full-disk faults can be made."""

    def __init__(self, seed: int, disk: bool, startup_s: float, step_s: float, first: tuple[str, ...] = ()):
        self.rng = random.Random(seed)
        self.disk, self.startup_s, self.step_s = disk, startup_s, step_s
        self.runtime_kinds = ["signal"] * 6 + ["point"] * 6  # the weights of the draw
        self.kinds = self.runtime_kinds + ["damage", "flip", "stale-lock"] + (["disk-full"] if disk else [])
        self.first = [k for k in first if k != "disk-full" or disk]
        """Kinds made before any other, the first of them that can be made (``flip`` and ``damage``: two
        checkpoints exist; ``signal:stop-rank``: any time, a few steps into the launch; ``signal:slow-rank``:
        enough steps left, from the launch's first step on; the signals and ``point`` also while a launch after
        a fault made before it runs; ``disk-full`` where a tmpfs could be mounted; ``recovery``: after the first
        fault that leaves the run unfinished, :meth:`second_fault`): the tiny campaign's one fault of each kind. While some are left, a fault during a launch after one made before it is one of
        them or none."""

    def _forced(self, run_dir: Path, runtime_only: bool) -> str:
        """The first of ``first`` that can be made now (popped), or ''."""
        checkpoints, left = len(complete_checkpoints(run_dir)), TOTAL_STEPS - len(metrics(run_dir))
        for i, spec in enumerate(self.first):
            ready = {"flip": checkpoints >= 2 and not runtime_only, "damage": checkpoints >= 2 and not runtime_only,
                     "signal:slow-rank": left >= SLOW_STEPS_LEFT, "stale-lock": not runtime_only,
                     "disk-full": self.disk and not runtime_only, "jit-build": not runtime_only}
            if ready.get(spec, spec.startswith("signal:") or spec == "point"):
                return self.first.pop(i)
        return ""

    def draw(self, run_dir: Path, index: int, runtime_only: bool = False) -> Optional[Fault]:
        """The next fault; ``runtime_only``: one that lands while the launch runs (a signal or a point), None
        while kinds of ``first`` are left and none of them can land now."""
        rng = self.rng
        forced = self._forced(run_dir, runtime_only) if self.first else ""
        if self.first and not forced:  # none of them can land now
            if runtime_only:
                return None
            forced = "point"  # a stop 6 steps into the launch: checkpoints for the kinds that need them
        if forced == "jit-build" or not forced and not runtime_only and rng.random() < JIT_BUILD_SHARE:
            return Fault("jit-build", f"#{index} kill-group during the JIT build of DeepSpeed's op")
        kind = rng.choice(self.runtime_kinds if runtime_only else self.kinds)
        forced_signal = None
        if forced:
            kind, _, forced_signal = forced.partition(":")
        if kind in ("damage", "flip") and len(complete_checkpoints(run_dir)) < 2:
            kind = "signal"  # damaging the only checkpoint would leave nothing to resume: by design, an error
        if kind == "signal":
            sig = forced_signal or rng.choice(SIGNAL_KINDS)
            steps_left = TOTAL_STEPS - len(metrics(run_dir))
            at = rng.uniform(0.3, self.startup_s + max(1, steps_left) * self.step_s)
            if forced_signal == "slow-rank":
                at = rng.uniform(0.3, self.startup_s)  # (slowed from the launch's first step)
            elif forced_signal:  # a few steps in: two checkpoints for a flip after it
                at = self.startup_s + rng.uniform(4, 8) * self.step_s
            return Fault(f"time:{sig}", f"#{index} {sig} at {at:.2f} s", at_s=at, signal_kind=sig)
        if kind == "point":
            point = rng.choice(sorted(POINT_OCCURRENCES))
            n = rng.randint(1, POINT_OCCURRENCES[point])
            action = rng.choice(sorted(ACTIONS))
            rank = 0 if point in RANK0_ONLY else rng.choice([0, 1, None])
            spec = f"{point}@{n}:{action}" + (f"@{rank}" if rank is not None else "")
            if forced:  # a stop 6 steps into the launch (3 checkpoints), steps left for a fault after it
                point, spec = "step.end", "step.end@6:usr2-group@0"
            return Fault(f"point:{point}", f"#{index} {spec}", env={"ROFORMER_FAULT_AT": spec})
        return Fault(kind, f"#{index} {kind}")

    def observe(self, result: Launch, run_dir: Path) -> None:
        """Follow the machine's pace: start-up and step times of the launch that just ended (the wall-time
        faults are drawn over the time a launch is expected to take)."""
        times = [r["time"] for r in metrics(run_dir) if r["time"] >= result.started]
        if len(times) >= 3:
            self.startup_s = 0.5 * self.startup_s + 0.5 * (times[0] - result.started)
            self.step_s = 0.5 * self.step_s + 0.5 * (times[-1] - times[0]) / (len(times) - 1)

    def second_fault(self, share: float) -> bool:
        """Whether the launch after a fault gets one while it recovers: with chance ``share``; while kinds of
        ``first`` are left, at once if "recovery" is among them (taken), else not."""
        if self.first:
            if "recovery" in self.first:
                self.first.remove("recovery")
                return True
            return False
        return self.rng.random() < share

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


def flip(run_dir: Path, rng: random.Random) -> tuple[str, int]:
    """One bit of a random byte of a random file of the newest checkpoint, its size kept (what a size check
    cannot see); returns the description and the checkpoint's step."""
    newest = complete_checkpoints(run_dir)[-1]
    files = sorted(json.loads((newest / "COMPLETE").read_text())["files"])
    victim = newest / rng.choice(files)
    data = bytearray(victim.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(data))
    return f"flipped a bit of byte {at} of {victim.relative_to(run_dir)}", int(newest.name.split("_")[1])


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
