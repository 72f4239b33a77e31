"""Stragglers: each rank's own times since the last log step, gathered at log steps (one small collective), and
the slowest named (``observe/stragglers.py``: the fields, scalars and warnings)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from roformer_dist.loop.callback import Callback, StepDone
from roformer_dist.observe.stragglers import StragglerWatch

if TYPE_CHECKING:
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Stragglers"]


class Stragglers(Callback):
    def __init__(self, ctx: "BuildContext"):
        d = ctx.run.cfg.dist
        self.watch = StragglerWatch(d.straggler_factor, d.straggler_log_steps, ctx.env.rank, ctx.comm)
        self.logged_step = 0

    def run_start(self, tr: "Trainer") -> None:
        self.logged_step = tr.state.step

    def step_read(self, tr: "Trainer", done: StepDone) -> None:
        if done.scalars is None:  # not a log step
            return
        fields, spread = self.watch.gather(done.step, tr.runner.times.take(), max(1, done.step - self.logged_step))
        self.logged_step = done.step
        done.record.update(fields)
        done.scalars.update(spread)

    def rewound(self, tr: "Trainer", step: int, note: dict) -> None:
        tr.runner.times.take()
        self.logged_step = step


def build(ctx: "BuildContext") -> Stragglers:
    return Stragglers(ctx)
