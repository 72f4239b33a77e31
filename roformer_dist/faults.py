"""Fault injection for tests, driven by environment variables; nothing happens when they are unset.

- ``ROFORMER_INJECT_NAN_AT=3,4``: the loss of these (1-based) steps becomes NaN on every rank.
- ``ROFORMER_CRASH_IN_SAVE_AT=6``: the last rank dies (``os._exit``) in the middle of saving that step,
  after DeepSpeed wrote its files and before the trainer state and COMPLETE.
- ``ROFORMER_STEP_DELAY_S=0.3``: sleep after every step (lets a test signal a run mid-way).
"""

from __future__ import annotations

import os
import time


def _steps(var: str) -> set[int]:
    return {int(s) for s in os.environ.get(var, "").split(",") if s.strip()}


def nan_steps() -> set[int]:
    return _steps("ROFORMER_INJECT_NAN_AT")


def maybe_crash_in_save(step: int, rank: int, world_size: int) -> None:
    if step in _steps("ROFORMER_CRASH_IN_SAVE_AT") and rank == world_size - 1:
        os._exit(9)


def step_delay() -> None:
    delay = float(os.environ.get("ROFORMER_STEP_DELAY_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)
