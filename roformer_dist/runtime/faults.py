"""Fault injection for tests: a hook object passed to the trainer and the checkpoint layer.

The default, :data:`NO_FAULTS`, does nothing. Subprocess tests ask for faults through environment
variables, read once where a rank process starts (``run_rank``) by :meth:`Faults.from_environ`:

- ``ROFORMER_INJECT_NAN_AT=3,4``: the loss of these (1-based) steps becomes NaN on every rank.
- ``ROFORMER_CRASH_IN_SAVE_AT=6``: the last rank dies (``os._exit``) in the middle of saving that step,
  after DeepSpeed wrote its files and before the trainer state and COMPLETE.
- ``ROFORMER_STEP_DELAY_S=0.3``: sleep after every step (lets a test signal a run mid-way).
- ``ROFORMER_WRITE_DELAY_S=2``: an asynchronous save's background writer sleeps this long before writing
  (lets a test signal a run while a save is in flight).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional


def _steps(text: str) -> frozenset[int]:
    return frozenset(int(s) for s in text.split(",") if s.strip())


@dataclass(frozen=True)
class Faults:
    nan_at_steps: frozenset[int] = frozenset()
    """1-based steps whose loss becomes NaN on every rank."""
    crash_in_save_at: frozenset[int] = frozenset()
    """Steps whose save the last rank does not survive."""
    step_delay_s: float = 0.0
    """Sleep after every step."""
    write_delay_s: float = 0.0
    """Sleep before an asynchronous save's background writing."""

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Faults":
        env = os.environ if environ is None else environ
        return cls(nan_at_steps=_steps(env.get("ROFORMER_INJECT_NAN_AT", "")),
                   crash_in_save_at=_steps(env.get("ROFORMER_CRASH_IN_SAVE_AT", "")),
                   step_delay_s=float(env.get("ROFORMER_STEP_DELAY_S", "0") or 0),
                   write_delay_s=float(env.get("ROFORMER_WRITE_DELAY_S", "0") or 0))

    def nan_at(self, step: int) -> bool:
        """Whether the loss of (1-based) ``step`` is to become NaN."""
        return step in self.nan_at_steps

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


NO_FAULTS = Faults()
