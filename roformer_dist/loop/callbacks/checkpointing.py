"""Checkpoints: when to save (``LoopPolicy.save_now``), and the writing, synchronous or in the background
(``checkpoint.async``).

A save writes its payload (``tr.save()`` gathers it) through the checkpoint layer; before it can commit, the
callbacks' ``before_commit`` runs (the sinks flush: a checkpoint of step N exists only once N's records are on
disk). A background save in flight is waited for before a stage switch (the new stage's DataLoader workers are
forked with no writer thread running: a fork beside the writer once stalled a rank for 16 s and once hung a
launch, docs/architecture/trainer-loop.md), at the run's end, before a rollback, and when the loop raises.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.async_save import AsyncSaver
from roformer_dist.loop.callback import Callback, StageRequest, StepDone

if TYPE_CHECKING:
    from roformer_dist.checkpoint.trainer_state import TrainerState
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.policies import Stop
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Checkpointing"]

log = logging.getLogger("roformer_dist.trainer")


class Checkpointing(Callback):
    def __init__(self, ctx: "BuildContext"):
        cfg, env = ctx.run.cfg, ctx.env
        self.root = ctx.run.run_dir.checkpoints
        self.cfg, self.faults = cfg.checkpoint, ctx.faults
        self.saver: Optional[AsyncSaver] = None
        if cfg.checkpoint.async_:
            self.saver = AsyncSaver(self.root, env.rank, env.world_size, cfg.checkpoint.keep_last, ctx.comm,
                                    cfg.dist.timeout_s, ctx.faults, cfg.checkpoint.checksums)

    def step_end(self, tr: "Trainer", step: int, stop: Optional["Stop"]) -> None:
        if tr.policy.save_now(step, stop):
            tr.save()

    def save(self, tr: "Trainer", payload: "TrainerState") -> None:
        t0 = time.monotonic()

        def before_commit() -> None:
            # how long the loop was held: the save up to its commit, or (async) the wait for the previous save
            # and the snapshot
            tr.callbacks.before_commit(tr, time.monotonic() - t0)

        env = tr.env
        if self.saver is None:
            ckpt.save(tr.runner, self.root, tr.state.step, payload, env.rank, env.world_size, self.cfg.keep_last,
                      tr.comm, self.faults, before_commit, self.cfg.checksums)
        else:
            self.saver.save(tr.runner, tr.state.step, payload, before_commit)

    def post_step(self, tr: "Trainer", done: StepDone) -> None:
        if self.saver is not None:
            self.saver.poll()  # a failed background save ends the run here, as a synchronous one would

    def finish(self, tr: "Trainer") -> None:
        """Every rank: return once the save in flight is committed (a no-op for synchronous saves)."""
        if self.saver is None:
            return
        if self.saver.in_flight is not None:
            log.info("waiting for the checkpoint of step %d to be written", self.saver.in_flight)
        self.saver.wait()
        tr.comm.barrier()
        tr.progress("save.end")

    def pre_stage(self, tr: "Trainer", req: StageRequest) -> None:
        self.finish(tr)

    def pre_rewind(self, tr: "Trainer") -> None:
        self.finish(tr)

    def run_end(self, tr: "Trainer", stop: "Stop") -> None:
        self.finish(tr)

    def on_error(self, tr: "Trainer") -> None:
        if self.saver is not None:  # what was snapshotted is still written (rank 0: and committed)
            try:
                self.saver.wait()
            except Exception as e:
                log.error("the checkpoint in flight was not saved: %s", e)


def build(ctx: "BuildContext") -> Checkpointing:
    return Checkpointing(ctx)
