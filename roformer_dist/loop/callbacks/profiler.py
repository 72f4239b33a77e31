"""The profiler window (``trainer.profile``): ``torch.profiler`` around steps [start_step, start_step + steps)
on rank 0, written as a trace and tables (``observe/profiling.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from roformer_dist.loop.callback import Callback, StepDone, StepRequest
from roformer_dist.observe.profiling import ProfileWindow

if TYPE_CHECKING:
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.policies import Stop
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Profiler"]


class Profiler(Callback):
    def __init__(self, ctx: "BuildContext"):
        self.cfg, self.run_dir, self.rank = ctx.run.cfg.trainer.profile, ctx.run.run_dir.root, ctx.env.rank
        self.window: Optional[ProfileWindow] = None

    def run_start(self, tr: "Trainer") -> None:
        self.window = ProfileWindow(self.cfg, self.run_dir, self.rank, last_step=tr.policy.last_step)

    def pre_step(self, tr: "Trainer", req: StepRequest) -> None:
        self.window.before_step(req.step)

    def post_step(self, tr: "Trainer", done: StepDone) -> None:
        self.window.after_step(done.step)

    def run_end(self, tr: "Trainer", stop: "Stop") -> None:
        self.window.close()

    def close(self, tr: "Trainer") -> None:
        if self.window is not None:
            self.window.close()  # a run that raised inside the window


def build(ctx: "BuildContext") -> Optional[Profiler]:
    return Profiler(ctx) if ctx.run.cfg.trainer.profile.start_step > 0 else None
