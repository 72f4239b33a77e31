"""Fault injection for tests and the fault campaign (``bench/chaos.py``): a hook object passed to the
trainer and the checkpoint layer.

The default, :data:`NO_FAULTS`, does nothing. Subprocess tests ask for faults through environment
variables, read once where a rank process starts (``run_rank``) by :meth:`Faults.from_environ`:

- ``ROFORMER_INJECT_NAN_AT=3,4``: the loss of these (1-based) steps becomes NaN on every rank.
- ``ROFORMER_INJECT_SPIKE_AT=30,31``: the loss of these steps is multiplied by 50 on every rank (a finite spike).
- ``ROFORMER_SLOW_RANK=1:0.2``: global rank 1 sleeps 0.2 s in the first forward of every step (a straggler).
- ``ROFORMER_CRASH_IN_SAVE_AT=6``: the last rank dies (``os._exit``) in the middle of saving that step,
  after DeepSpeed wrote its files and before the trainer state and COMPLETE.
- ``ROFORMER_STEP_DELAY_S=0.3``: sleep after every step (lets a test signal a run mid-way).
  ``ROFORMER_STEP_DELAY_ATTEMPTS=1``: only in a SLURM job's first attempt(s) (``SLURM_RESTART_COUNT`` below
  it), so that a requeued attempt finishes at full speed.
- ``ROFORMER_WRITE_DELAY_S=2``: an asynchronous save's background writer sleeps this long before writing
  (lets a test signal a run while a save is in flight).
- ``ROFORMER_FAULT_AT=POINT@N:ACTION[@RANK]``: the N-th time (1-based, counted in each process) the code
  passes the named point (:data:`POINTS`), the process of global rank RANK (every rank when omitted)
  does ACTION (:data:`ACTIONS`): it dies, kills its launcher or its process group, or signals the group.
  It first writes ``fault injected: ...`` to its stderr, so that whoever injected it can tell the fault
  happened. Several faults are separated by ``,``.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional

POINTS = {
    "save.begin": "every rank, a save's directory made, before any file of it",
    "save.before_file": "before each file a rank writes (synchronous saves: before DeepSpeed's files as one)",
    "save.after_file": "after each file a rank writes",
    "save.before_complete": "rank 0, every rank's files durable, before COMPLETE",
    "save.before_latest": "rank 0, COMPLETE written, before the rename of latest",
    "save.after_latest": "rank 0, latest renamed, before pruning",
    "loader.state": "the loader's position captured for a save",
    "stage.switch": "inside a curriculum stage switch: the loader switched, the engine not yet",
    "eval": "at the start of each held-out set's evaluation",
    "resume.loaded": "a checkpoint's weights and optimizer loaded, the loader and counters not yet",
    "step.end": "after each optimizer step, before it is recorded",
}
"""Where the code calls :meth:`Faults.point`, and what has happened there."""

ACTIONS = {
    "kill": "SIGKILL this process",
    "exit": "os._exit(1) from this process (a crash without a signal)",
    "kill-launcher": "SIGKILL the parent process (roformer-train's launcher), then go on",
    "kill-group": "SIGKILL the whole process group (launcher, ranks, DataLoader workers)",
    "term-group": "SIGTERM to the process group, then go on",
    "int-group": "SIGINT to the process group (Ctrl-C), then go on",
    "usr2-group": "SIGUSR2 to the process group (SLURM's warning before the time limit), then go on",
}

_COUNTING = threading.Lock()  # the step loop and a checkpoint writer thread both pass points
_SPEC = re.compile(r"^(?P<point>[a-z._]+)@(?P<n>\d+):(?P<action>[a-z0-9-]+)(?:@(?P<rank>\d+))?$")


def _step_delay(env: Mapping[str, str]) -> float:
    """``ROFORMER_STEP_DELAY_S``, or 0 from the attempt ``ROFORMER_STEP_DELAY_ATTEMPTS`` names on."""
    attempts = env.get("ROFORMER_STEP_DELAY_ATTEMPTS", "")
    if attempts and int(env.get("SLURM_RESTART_COUNT", "0") or 0) >= int(attempts):
        return 0.0
    return float(env.get("ROFORMER_STEP_DELAY_S", "0") or 0)


def _steps(text: str) -> frozenset[int]:
    return frozenset(int(s) for s in text.split(",") if s.strip())


@dataclass(frozen=True)
class PointFault:
    point: str
    occurrence: int
    action: str
    rank: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> "PointFault":
        m = _SPEC.match(text.strip())
        if not m or m["point"] not in POINTS or m["action"] not in ACTIONS or int(m["n"]) < 1:
            raise ValueError(f"ROFORMER_FAULT_AT: {text!r} is not POINT@N:ACTION[@RANK] with a point of "
                             f"{sorted(POINTS)}, N >= 1 and an action of {sorted(ACTIONS)}")
        return cls(m["point"], int(m["n"]), m["action"], int(m["rank"]) if m["rank"] is not None else None)

    def __str__(self) -> str:
        return f"{self.point}@{self.occurrence}:{self.action}" + (f"@{self.rank}" if self.rank is not None else "")


def do_action(action: str) -> None:
    """Carry out one of :data:`ACTIONS` in this process."""
    group = os.getpgrp()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(1)
    elif action == "kill-launcher":
        os.kill(os.getppid(), signal.SIGKILL)
    elif action == "kill-group":
        os.killpg(group, signal.SIGKILL)
    else:
        os.killpg(group, {"term-group": signal.SIGTERM, "int-group": signal.SIGINT,
                          "usr2-group": signal.SIGUSR2}[action])


SPIKE_FACTOR = 50.0
"""The factor of an injected loss spike."""


@dataclass(frozen=True)
class Faults:
    nan_at_steps: frozenset[int] = frozenset()
    """1-based steps whose loss becomes NaN on every rank."""
    slow_rank: tuple[int, float] = (-1, 0.0)
    """(global rank, seconds): that rank sleeps in each step's first forward."""
    spike_at_steps: frozenset[int] = frozenset()
    """1-based steps whose loss is multiplied by :data:`SPIKE_FACTOR` on every rank."""
    crash_in_save_at: frozenset[int] = frozenset()
    """Steps whose save the last rank does not survive."""
    step_delay_s: float = 0.0
    """Sleep after every step."""
    write_delay_s: float = 0.0
    """Sleep before an asynchronous save's background writing."""
    at_points: tuple[PointFault, ...] = ()
    """Faults at named points of the code (``ROFORMER_FAULT_AT``)."""
    rank: int = 0
    """This process's global rank (which of ``at_points`` apply)."""
    _passed: Counter = field(default_factory=Counter, compare=False, repr=False)
    """How often each point was passed in this process."""

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Faults":
        env = os.environ if environ is None else environ
        at = tuple(PointFault.parse(s) for s in env.get("ROFORMER_FAULT_AT", "").split(",") if s.strip())
        return cls(nan_at_steps=_steps(env.get("ROFORMER_INJECT_NAN_AT", "")),
                   spike_at_steps=_steps(env.get("ROFORMER_INJECT_SPIKE_AT", "")),
                   slow_rank=_slow(env.get("ROFORMER_SLOW_RANK", "")),
                   crash_in_save_at=_steps(env.get("ROFORMER_CRASH_IN_SAVE_AT", "")),
                   step_delay_s=_step_delay(env),
                   write_delay_s=float(env.get("ROFORMER_WRITE_DELAY_S", "0") or 0),
                   at_points=at, rank=int(env.get("RANK", "0") or 0))

    def nan_at(self, step: int) -> bool:
        """Whether the loss of (1-based) ``step`` is to become NaN."""
        return step in self.nan_at_steps

    def delay(self) -> float:
        """This rank's sleep in each step's first forward (``ROFORMER_SLOW_RANK``)."""
        return self.slow_rank[1] if self.slow_rank[0] == self.rank else 0.0

    def spike_at(self, step: int) -> float:
        """The factor on the loss of (1-based) ``step``: :data:`SPIKE_FACTOR` at an injected spike, else 1."""
        return SPIKE_FACTOR if step in self.spike_at_steps else 1.0

    def in_save(self, step: int, rank: int, world_size: int) -> None:
        """Called by every rank between DeepSpeed's files and the trainer state of a save."""
        if step in self.crash_in_save_at and rank == world_size - 1:
            os._exit(9)

    def in_background_write(self, step: int) -> None:
        """Called by an asynchronous save's writer thread before it writes anything."""
        if self.write_delay_s > 0:
            time.sleep(self.write_delay_s)

    def after_step(self) -> None:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        self.point("step.end")

    def point(self, name: str) -> None:
        """The code passes the point ``name`` (one of :data:`POINTS`): do what ``at_points`` asks here."""
        if not self.at_points:
            return
        with _COUNTING:
            self._passed[name] += 1
            n = self._passed[name]
        for f in self.at_points:
            if f.point == name and f.occurrence == n and f.rank in (None, self.rank):
                os.write(2, f"fault injected: {f} (rank {self.rank}, pid {os.getpid()})\n".encode())
                do_action(f.action)


NO_FAULTS = Faults()


def _slow(text: str) -> tuple[int, float]:
    if not text.strip():
        return (-1, 0.0)
    rank, _, seconds = text.partition(":")
    return (int(rank), float(seconds))
