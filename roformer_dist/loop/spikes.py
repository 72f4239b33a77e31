"""Loss spikes (``trainer.spike: skip | rollback``): a step whose loss is far above the recent ones.

A finite loss more than ``trainer.spike_factor`` times the median of the last ``trainer.spike_window`` kept
steps' losses is a spike, the classic start of a divergence in long runs. The runner compares each
micro-batch's loss on the device with the threshold the host hands it (``ParallelRunner.train_step``'s
``spike_above``: no sync) and turns a spike's gradients into NaN, which DeepSpeed's overflow check drops,
as it drops a non-finite step's. The step is recorded with its loss and ``"spike": true``, counted, and
warned about. With ``skip`` that is all; with ``rollback`` the trainer then goes back to the newest
checkpoint before the spike and skips the batches since (``loop/callbacks/spikes.py``). ``trainer.spike_max``
spikes within the window stop the run (exit 3, the checkpoint of the last step saved).

Exact resume: the threshold of step ``t`` is computed from the kept losses of the steps up to the last log
step before ``t`` only (the steps whose losses every run has read by then, whatever its stops and saves), and
:class:`SpikeGuard`'s state is in the checkpoint; so a resumed run takes the same decisions as an
uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Optional

from roformer_dist.config import TrainerConfig

__all__ = ["SpikeGuard", "MIN_HISTORY"]

log = logging.getLogger(__name__)

MIN_HISTORY = 20
"""Kept losses needed before spikes are looked for (or the whole window, when it is shorter)."""


class SpikeGuard:
    """The spike policy's state: the recent kept losses, the recent spikes, the total. ``state_dict`` /
    ``load_state_dict`` go into each rank's trainer state."""

    def __init__(self, t: TrainerConfig):
        self.on = t.spike != "none"
        self.rollback = t.spike == "rollback"
        self.factor, self.window, self.max, self.log_every = t.spike_factor, t.spike_window, t.spike_max, t.log_every
        self.recent: list[tuple[int, float]] = []
        """(step, loss) of the latest kept steps (not skipped, finite)."""
        self.spikes: list[int] = []
        """Steps skipped as spikes within the window."""
        self.total = 0
        self._given: dict[int, float] = {}  # step -> the threshold it ran with (for the warning)

    def threshold(self, step: int) -> Optional[float]:
        """The loss above which step ``step`` (1-based, about to run) is a spike; None: none yet (off, or too
        little history)."""
        if not self.on:
            return None
        last_log = (step - 1) // self.log_every * self.log_every
        losses = [loss for s, loss in self.recent if s <= last_log][-self.window:]
        if len(losses) < min(self.window, MIN_HISTORY):
            return None
        self._given[step] = value = self.factor * statistics.median(losses)
        return value

    def observe(self, step: int, loss: float, spiked: bool, nonfinite: bool) -> None:
        """Step ``step``'s read statistics, in step order."""
        given = self._given.pop(step, None)
        if spiked:
            self.total += 1
            self.spikes.append(step)
        elif not nonfinite and math.isfinite(loss):
            self.recent.append((step, loss))
            del self.recent[:-(self.window + self.log_every)]
        self.spikes = self.in_window(step)
        if spiked:
            log.warning("step %d: loss spike %.4f, above %.4f (trainer.spike_factor %g x the median of the last %d "
                        "steps): update skipped%s (%d in the last %d steps, %d in all)", step, loss, given or math.nan,
                        self.factor, self.window, ", rolling back" if self.rollback and not self.too_many else "",
                        len(self.spikes), self.window, self.total)

    def in_window(self, step: int) -> list[int]:
        return [s for s in self.spikes if s > step - self.window]

    @property
    def too_many(self) -> bool:
        """``trainer.spike_max`` spikes within the window: the run stops."""
        return self.on and len(self.spikes) >= self.max

    def keep_counts(self, before: dict) -> None:
        """After a rollback loaded an older state: the spikes counted before it (the spike rolled back from
        included) still count; the loss history is the checkpoint's."""
        self.spikes, self.total = [int(s) for s in before["spikes"]], int(before["total"])

    def stop_message(self, step: int) -> str:
        return (f"stopping: {len(self.spikes)} loss spikes in the last {self.window} steps (trainer.spike_max "
                f"{self.max}): the data or the learning rate needs a look; step {step} is saved")

    def state_dict(self) -> dict:
        return {"recent": [[s, v] for s, v in self.recent], "spikes": list(self.spikes), "total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.recent = [(int(s), float(v)) for s, v in sd.get("recent", [])]
        self.spikes = [int(s) for s in sd.get("spikes", [])]
        self.total = int(sd.get("total", 0))
