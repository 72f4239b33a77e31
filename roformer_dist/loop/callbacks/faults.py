"""Fault injection for tests and the fault campaign (``runtime/faults.py``): the loop's named points
(``ROFORMER_FAULT_AT``), the injected NaN losses and loss spikes, the slow rank, the delay after each step.

The loop names its moments through ``tr.progress(point)``; this callback acts at the ones
``runtime.faults.POINTS`` lists. The checkpoint layer takes the same :class:`~roformer_dist.runtime.faults.
Faults` object for the points inside a save. With :data:`~roformer_dist.runtime.faults.NO_FAULTS` (every run
not started by a test) the callback is left out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from roformer_dist.loop.callback import Callback, StepRequest
from roformer_dist.runtime.faults import NO_FAULTS, POINTS, Faults

if TYPE_CHECKING:
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Faulting"]


class Faulting(Callback):
    def __init__(self, faults: Faults):
        self.faults = faults

    def pre_step(self, tr: "Trainer", req: StepRequest) -> None:
        f = self.faults
        req.inject_nan = f.nan_at(req.step)
        req.inject_spike = f.spike_at(req.step + tr.state.rolled_back_steps)
        req.delay_s = f.delay()

    def progress(self, tr: "Trainer", point: str, first_step: bool = False) -> None:
        if point == "step.end":
            self.faults.after_step()  # the delay after each step, then the point
        elif point in POINTS:
            self.faults.point(point)


def build(ctx: "BuildContext") -> Optional[Faulting]:
    return Faulting(ctx.faults) if replace(ctx.faults, rank=0) != NO_FAULTS else None
