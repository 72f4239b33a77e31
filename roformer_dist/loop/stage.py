"""The one place a curriculum stage switch happens: the loader, the runner (micro-batch, accumulation, rotary
settings and kernel, compilation), the masking rate, the stage's own values of run settings
(``StagePlan.settings``: the hidden dropout here); then the stage hooks.

The loop switches at a stage boundary and at its first step; the evaluation of a step a stop skipped switches
to that step's stage first, and a loss-spike rollback points the loader at each stage it skips batches of
(:meth:`StageSwitch.skip_batches`). Each goes through here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from data_pipeline.shards import CorruptShardError
from roformer_dist.config import rope_settings
from roformer_dist.errors import DataError
from roformer_dist.loop.callback import StageRequest
from roformer_dist.plan.curriculum import stage_at
from roformer_dist.plan.data import data_error

if TYPE_CHECKING:
    from roformer_dist.loop.trainer import Trainer

__all__ = ["StageSwitch"]

log = logging.getLogger("roformer_dist.trainer")


class StageSwitch:
    """Which stage a trainer's loader and runner are set for (``index``), and the switch between stages."""

    def __init__(self, index: int, hidden_dropout: float):
        self.index = index
        self.rope = None
        """The rotary settings in force (a stage may change them); None before the first switch."""
        self.hidden_dropout = hidden_dropout
        """The dropout probability the model's ``nn.Dropout`` modules hold."""

    def point_loader(self, tr: "Trainer", index: int) -> None:
        """Point the loader at stage ``index``: its length, micro-batch, source weights and masking rate."""
        st = tr.run.stages[index]
        tr.loader.set_stage(st.seq_len, st.micro_batch_size, weights=tr.run.mixture.stage_weights(index),
                            mlm_probability=st.mlm_probability)

    def switch(self, tr: "Trainer", index: int) -> None:
        """Set the loader and the runner for stage ``index`` (collective: the rotary choice), then raise
        ``stage_start``."""
        req = StageRequest(index)
        tr.callbacks.pre_stage(tr, req)
        st, was = tr.run.stages[index], tr.run.stages[self.index]
        if st.mlm_probability != was.mlm_probability:
            log.info("stage %r: masking %g of the tokens (was %g)", st.name, st.mlm_probability, was.mlm_probability)
        self.point_loader(tr, index)
        dropout = st.settings["model.hidden_dropout_prob"]
        if dropout != self.hidden_dropout:  # before the stage compiles
            for module in tr.engine.module.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = dropout
            log.info("stage %r: hidden dropout %g (was %g)", st.name, dropout, self.hidden_dropout)
            self.hidden_dropout = dropout
        tr.progress("stage.switch", first_step=True)  # measures the rotary kernel; the stage's first step compiles
        tr.runner.set_stage(st, choose_kernel=req.choose_kernel)  # the stage's rotary settings too
        if st.rope != self.rope and (st.rope != rope_settings(tr.cfg.model) or self.rope is not None):
            log.info("stage %r: rotary %s", st.name, ", ".join(f"{k} {v}" for k, v in st.rope.to_dict().items()))
        self.rope, self.index = st.rope, index
        log.info("stage %d/%d %r: seq_len %d, global batch %d, micro-batch %d, accumulation %d",
                 index + 1, len(tr.run.stages), st.name, st.seq_len, st.global_batch_size, st.micro_batch_size,
                 tr.runner.accumulation_steps)
        tr.callbacks.stage_start(tr, index)

    def skip_batches(self, tr: "Trainer", done: int, last: int) -> None:
        """Draw and drop the batches of steps ``done + 1`` to ``last`` (each rank its own, in each step's stage),
        then point the loader at the stage of step ``done + 1``."""
        stages = tr.cfg.curriculum.stages
        if tr.runner.reads_data:
            current: Optional[int] = None
            batches = None
            for step in range(done + 1, last + 1):
                index = stage_at(stages, step - 1).index
                if index != current:
                    self.point_loader(tr, index)
                    current, batches = index, iter(tr.loader)
                try:
                    for _ in range(tr.run.stages[index].accumulation):
                        next(batches)
                except (DataError, CorruptShardError) as e:
                    raise data_error(e, f"skipping the batches of step {step} (a loss-spike rollback)") from None
                tr.progress("rollback")
        self.point_loader(tr, stage_at(stages, done).index)
