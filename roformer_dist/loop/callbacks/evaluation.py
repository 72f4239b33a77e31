"""Evaluation: the held-out sets at each eval length of the current stage, beside the unigram and
most-frequent-token baselines (``observe/evaluation.py``), at the steps ``LoopPolicy.eval_now`` names.

The eval of a step comes before its save: a checkpoint of step N exists only once N's eval is recorded (and
flushed). Every rank reads every eval batch, so an eval data error is raised on all ranks alike: they save (a
failing eval loses no training), then raise it. A stop skips a scheduled eval (under a deadline the checkpoint
matters); its checkpoint says so (``eval_due``), and the launch that resumes from it runs that eval first, once.
A warm-started run evaluates its parent before its first step (step 0 of the new curves).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from data_pipeline.atomic import atomic_write_text
from data_pipeline.shards import CorruptShardError
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.errors import DataError, StorageError
from roformer_dist.loop.callback import Callback
from roformer_dist.observe.evaluation import Evaluator
from roformer_dist.plan.curriculum import stage_at
from roformer_dist.plan.data import data_error

if TYPE_CHECKING:
    from roformer_dist.checkpoint.trainer_state import TrainerState
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.policies import Stop
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Evaluation"]

log = logging.getLogger("roformer_dist.trainer")


class Evaluation(Callback):
    def __init__(self, ctx: "BuildContext"):
        cfg, shares = ctx.run.cfg, ctx.run.mixture.overall
        self.main: Optional[Evaluator] = Evaluator(cfg, training_shares=shares) if cfg.data.eval_shards else None
        """``data.eval_shards``'s; keeps the unigram counts (read at the first eval) and each length's baselines."""
        self.sets = [("eval", self.main)] if self.main is not None else []
        shared = self.main
        for e in cfg.data.eval_sources:  # one per data.eval_sources set, sharing the unigram counts
            ev = Evaluator(cfg, e.shards, training_shares=shares, shared=shared, batches=e.batches)
            self.sets.append((f"eval_{e.name}", ev))
            shared = shared or ev
        self.due = False
        """The eval of the current step is scheduled but was not run (a stop skipped it)."""
        self.parent_first = ctx.run.resume.warm_start is not None
        """Evaluate the parent (``init.from``) before the first step."""

    @torch.no_grad()
    def evaluate(self, tr: "Trainer") -> dict:
        """Loss and MLM accuracy at each eval length of the current stage, with the baselines at the same
        predicted positions. The result does not depend on the world size."""
        if not self.sets:
            return {}
        device = tr.engine.device
        reduce = (lambda sums: tr.comm.sum_on(sums, device)) if tr.env.world_size > 1 else None
        stage, out, runner = tr.cfg.curriculum.stages[tr.stage_index], {}, tr.runner

        def eval_step(*args, **kwargs):  # each eval batch is progress
            tr.progress("eval.batch")
            return runner.eval_step(*args, **kwargs)

        for prefix, ev in self.sets:
            tr.progress("eval")
            out.update(ev.evaluate_stage(stage, eval_step, runner.dp_rank, runner.dp_size, reduce,
                                         step=tr.state.step, prefix=prefix))
        return out

    def run_eval(self, tr: "Trainer", then_save: bool = False) -> None:
        """Evaluate and record; ``then_save``: this step's checkpoint is due (saved before an eval error is raised)."""
        step = tr.state.step
        try:
            ev = self.evaluate(tr)
        except (DataError, CorruptShardError) as e:
            if then_save:
                tr.save()
            raise data_error(e, f"eval at step {step}" + (" (the checkpoint of this step is saved)"
                                                          if then_save else "")) from None
        if ev:
            tr.callbacks.scalars(tr, step, ev)
            log.info("step %d eval: %s", step, "  ".join(f"{k}={v:.4f}" for k, v in ev.items()))

    def run_start(self, tr: "Trainer") -> None:
        if self.due:
            self._run_skipped(tr)

    def _run_skipped(self, tr: "Trainer") -> None:
        """The eval of the resumed step, which the stop that saved it skipped, in that step's stage; once.

        Its events are flushed, then ``EVALUATED`` is written into the checkpoint (rank 0), so a later launch
        resuming from the same checkpoint does not log them again (a resume purges only the events after the
        checkpoint's step)."""
        marker = tr.resumed_dir / ckpt.EVALUATED
        if tr.comm.broadcast(marker.exists() if tr.env.rank == 0 else None):
            return
        step = tr.state.step
        tr.switch_stage(stage_at(tr.cfg.curriculum.stages, step - 1).index)
        log.info("step %d: running the eval the stop skipped", step)
        self.run_eval(tr)
        tr.callbacks.flush(tr)
        if tr.env.rank == 0:
            try:
                atomic_write_text(marker, f"{step}\n")
            except OSError as e:
                raise StorageError.from_os_error(e, f"recording the eval of step {step}") from None

    def stage_start(self, tr: "Trainer", index: int) -> None:
        if self.parent_first and tr.state.step == 0:
            self.parent_first = False
            log.info("evaluating the parent before the first step")
            self.run_eval(tr)  # step 0 of the new curves is the parent's, on this run's eval sets

    def step_end(self, tr: "Trainer", step: int, stop: Optional["Stop"]) -> None:
        p = tr.policy
        if p.eval_now(step, stop):
            self.run_eval(tr, then_save=p.save_now(step, stop))
        self.due = stop is not None and not p.eval_now(step, stop) and p.eval(step)
        if self.due:
            log.info("step %d: eval skipped (stopping; the next launch runs it first)", step)

    def rewound(self, tr: "Trainer", step: int, note: dict) -> None:
        self.due = False  # any eval the checkpoint's stop skipped ran before the steps rolled back

    def state_dict(self) -> dict:
        return {"eval_due": self.due}

    def load_state_dict(self, state: "TrainerState") -> None:
        self.due = state.eval_due


def build(ctx: "BuildContext") -> Evaluation:
    return Evaluation(ctx)
