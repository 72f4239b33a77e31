"""The hang watch (``dist.hang_timeout_s``): each rank's progress at the loop's points, and a watchdog that
ends a rank whose progress stopped (``runtime/heartbeat.py``: the report, exit 76).

A stage's switch and first step may take ``dist.first_step_timeout_s`` where they measure or compile (on a
GPU: the rotary measurement, flex attention; with ``trainer.compile``: the stage).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from roformer_dist.loop.callback import Callback, StepRequest
from roformer_dist.runtime.heartbeat import Heartbeat

if TYPE_CHECKING:
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.trainer import Trainer

__all__ = ["HangWatch"]


class HangWatch(Callback):
    def __init__(self, ctx: "BuildContext"):
        self.cfg, self.env, self.on_hang = ctx.run.cfg, ctx.env, ctx.on_hang
        self.dir = ctx.run.run_dir.hang
        self.heartbeat: Optional[Heartbeat] = None
        """Armed when the loop starts; the job's last barrier arms it again (``launch/entry.py``)."""
        self.first_step = False
        """The next step is the first of a stage."""

    def run_start(self, tr: "Trainer") -> None:
        self.heartbeat = Heartbeat.armed(self.dir, self.env, self.cfg.dist.hang_timeout_s, self.on_hang)

    def progress(self, tr: "Trainer", point: str, first_step: bool = False) -> None:
        if self.heartbeat is not None:
            slow = first_step and (self.cfg.trainer.compile or torch.cuda.is_available())
            allow = self.cfg.dist.first_step_timeout_s if slow else None
            self.heartbeat.beat(point, tr.state.step, allow, "dist.first_step_timeout_s, a stage's first step")

    def stage_start(self, tr: "Trainer", index: int) -> None:
        self.first_step = True

    def pre_step(self, tr: "Trainer", req: StepRequest) -> None:
        self.progress(tr, "step", first_step=self.first_step)
        self.first_step = False

    def pre_save(self, tr: "Trainer") -> None:
        self.progress(tr, "save")

    def post_save(self, tr: "Trainer") -> None:
        self.progress(tr, "save.end")

    def close(self, tr: "Trainer") -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()


def build(ctx: "BuildContext") -> HangWatch:
    return HangWatch(ctx)


def last_barrier_watch(callbacks) -> Optional[Heartbeat]:
    """The run's heartbeat, for the job's last barrier (None: the watch is off or never armed)."""
    watch = callbacks.get("heartbeat")
    return watch.heartbeat if watch is not None else None
