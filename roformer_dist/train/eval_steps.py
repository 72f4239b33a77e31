"""The trainer's evaluation: the eval of a step, the eval a stop skipped, and the on-device reduce both use.

:class:`EvalSteps` is a part of :class:`~roformer_dist.train.trainer.Trainer` (a base class), kept apart so that
the loop's module stays readable; it reads the trainer's evaluators, runner, metrics and counters.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from data_pipeline.atomic import atomic_write_text
from data_pipeline.shards import CorruptShardError
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.errors import DataError, StorageError
from roformer_dist.train.curriculum import stage_at
from roformer_dist.train.data import data_error

__all__ = ["EvalSteps"]

log = logging.getLogger("roformer_dist.trainer")


class EvalSteps:
    """Evaluation for :class:`~roformer_dist.train.trainer.Trainer`."""

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and MLM accuracy at each eval length of the current stage, with the unigram and
        most-frequent-token baselines at the same predicted positions (:mod:`roformer_dist.train.evaluation`).
        The result does not depend on the world size."""
        if self.evaluator is None:
            return {}
        reduce = self._all_reduce_on_device if dist.get_world_size() > 1 else None
        stage, out = self.stages[self.stage_index], {}

        def eval_step(*args, **kwargs):  # each eval batch is progress
            return self.beat("eval") or self.runner.eval_step(*args, **kwargs)

        sets = ([("eval", self.evaluator)] if self.cfg.data.eval_shards else []) + \
            [(f"eval_{name}", ev) for name, ev in self.source_evaluators.items()]
        for prefix, ev in sets:
            self.faults.point("eval")
            out.update(ev.evaluate_stage(stage, eval_step, self.dp_rank, self.dp_size, reduce,
                                         step=self.state.step, prefix=prefix))
        return out

    def _all_reduce_on_device(self, sums: torch.Tensor) -> None:
        """Sum a CPU tensor over all ranks, in place, on the engine's device (NCCL reduces no CPU tensors)."""
        on_device = sums.to(self.engine.device)
        dist.all_reduce(on_device)
        sums.copy_(on_device.cpu())

    def run_eval(self, then_save: bool = False) -> None:
        """Evaluate and record; ``then_save``: this step's checkpoint is due (saved before an eval error is raised)."""
        try:
            ev = self.evaluate()
        except (DataError, CorruptShardError) as e:
            if then_save:
                self.save()
            raise data_error(e, f"eval at step {self.state.step}" + (" (the checkpoint of this step is saved)"
                                                                     if then_save else "")) from None
        if ev:
            self.metrics.scalars(self.state.step, ev)
            log.info("step %d eval: %s", self.state.step, "  ".join(f"{k}={v:.4f}" for k, v in ev.items()))

    def run_skipped_eval(self) -> None:
        """The eval of the resumed step, which the stop that saved it skipped, in that step's stage; once.

        Its events are flushed, then ``EVALUATED`` is written into the checkpoint (rank 0), so a later
        launch resuming from the same checkpoint does not log them again (a resume purges only the
        events after the checkpoint's step)."""
        marker = self._resumed_dir / ckpt.EVALUATED
        if self.comm.broadcast(marker.exists() if self.env.rank == 0 else None):
            return
        step = self.state.step
        self.switch_stage(stage_at(self.stages, step - 1).index)
        log.info("step %d: running the eval the stop skipped", step)
        self.run_eval()
        self.metrics.flush()
        if self.env.rank == 0:
            try:
                atomic_write_text(marker, f"{step}\n")
            except OSError as e:
                raise StorageError.from_os_error(e, f"recording the eval of step {step}") from None
