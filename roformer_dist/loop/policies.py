"""When the trainer logs, saves, evaluates and stops: pure decisions over (step, stage ends, config).

The loop (``Trainer.fit``) asks these after every optimizer step, in this order::

    step -> log -> save -> eval -> stop

A save comes before the eval of the same step, so an eval that fails (a damaged eval shard, an
out-of-memory at a long eval length) loses no training. A stop (signal, too many non-finite losses)
saves and skips the eval: under a SLURM deadline the checkpoint matters, the eval does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from roformer_dist.config import Config
from roformer_dist.errors import EXIT_DONE, EXIT_NONFINITE, EXIT_REQUEUE
from roformer_dist.plan.curriculum import stage_boundaries, total_steps


@dataclass(frozen=True)
class Stop:
    """Why the loop ends after this step, and with which exit status."""

    reason: str
    """signal | nonfinite | spikes | done."""
    status: int


@dataclass(frozen=True)
class LoopPolicy:
    total_steps: int
    """Steps of the whole curriculum."""
    stage_ends: frozenset[int]
    """The last step of each stage (1-based step counts)."""
    last_step: int
    """Where this run ends: ``trainer.stop_at_step`` or the end of the curriculum."""
    save_every: int = 0
    eval_every: int = 0
    log_every: int = 1
    max_nonfinite_steps: int = 5

    @classmethod
    def from_config(cls, cfg: Config) -> "LoopPolicy":
        t, stages = cfg.trainer, cfg.curriculum.stages
        total = total_steps(stages)
        return cls(total_steps=total, stage_ends=frozenset(stage_boundaries(stages)),
                   last_step=min(t.stop_at_step or total, total), save_every=t.save_every,
                   eval_every=t.eval_every, log_every=t.log_every, max_nonfinite_steps=t.max_nonfinite_steps)

    def done(self, step: int) -> bool:
        """No step is left to run after ``step`` steps."""
        return step >= self.last_step

    def log(self, step: int) -> bool:
        """Console line and TensorBoard scalars (``metrics.jsonl`` gets every step)."""
        return step % self.log_every == 0 or step == self.total_steps

    def save(self, step: int) -> bool:
        """Periodic saves, every stage end, and the last step of the run."""
        return self.scheduled_save(step) or step == self.last_step

    def scheduled_save(self, step: int) -> bool:
        """Periodic saves and stage ends: the checkpoints every launch of the run writes, whatever its stops."""
        return bool(self.save_every and step % self.save_every == 0) or step in self.stage_ends

    def eval(self, step: int) -> bool:
        """Periodic evals, every stage end, and the end of the curriculum."""
        return bool(self.eval_every and step % self.eval_every == 0) or step in self.stage_ends or \
            step == self.total_steps

    def stop(self, step: int, *, stop_requested: bool, consecutive_nonfinite: int, too_many_spikes: bool = False
             ) -> Optional[Stop]:
        """The reason to end the loop after ``step``, None to go on.

        Too many non-finite losses win (the status says what went wrong); a signal at the last step
        of the run changes nothing: the run is done."""
        if consecutive_nonfinite >= self.max_nonfinite_steps:
            return Stop("nonfinite", EXIT_NONFINITE)
        if too_many_spikes:  # trainer.spike_max within the window (loop/spikes.py)
            return Stop("spikes", EXIT_NONFINITE)
        if self.done(step):
            return Stop("done", EXIT_DONE)
        if stop_requested:
            return Stop("signal", EXIT_REQUEUE)
        return None

    def save_now(self, step: int, stop: Optional[Stop]) -> bool:
        """Save after ``step``: by schedule, or because the loop stops early."""
        return self.save(step) or (stop is not None and stop.reason != "done")

    def eval_now(self, step: int, stop: Optional[Stop]) -> bool:
        """Evaluate after ``step`` (after its save): by schedule, unless the loop stops early."""
        return self.eval(step) and (stop is None or stop.reason == "done")
