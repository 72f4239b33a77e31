"""A trainer put back to a checkpoint: weights and optimizer (DeepSpeed's files, or the universal form at another
world size), the loader's position, the RNG streams, the counters and every callback's state.

A launch that resumes restores once before its first step (``launch/build.py``); a loss-spike rollback
(``loop/callbacks/spikes.py``) restores an older checkpoint of the same run mid-way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.compat import changed_settings
from roformer_dist.checkpoint.safe_load import weights_only_loads
from roformer_dist.checkpoint.trainer_state import TrainerState, set_rng_state
from roformer_dist.checkpoint.universal import UNIVERSAL
from roformer_dist.errors import CheckpointError

if TYPE_CHECKING:
    from roformer_dist.loop.trainer import Trainer

__all__ = ["restore"]

log = logging.getLogger("roformer_dist.trainer")


def restore(tr: "Trainer", found: ckpt.Found, first: TrainerState, why: str = "resuming") -> None:
    """Load ``found`` into ``tr`` (collective); ``first``: rank 0's trainer state of it (read by every rank)."""
    env, elastic = tr.env, tr.run.elastic
    log.info("%s from %s (step %d, written by %d rank(s))", why, found.dir, found.step, found.world_size)
    for change in changed_settings(first.config, tr.cfg):
        log.warning("resuming with a changed setting: %s", change)
    if elastic:
        log.warning("world size changed %d -> %d: the loader re-deals the unread shards", found.world_size,
                    env.world_size)
    with weights_only_loads():  # DeepSpeed's loads run no code stored in the files
        if elastic and tr.cfg.deepspeed.zero_stage > 0:
            log.warning("loading the universal checkpoint %s/%s", found.dir, UNIVERSAL)
            tr.runner.load_checkpoint(str(found.dir), UNIVERSAL)
        else:
            tr.runner.load_checkpoint(str(tr.run.run_dir.checkpoints), found.tag)
    tr.progress("resume.loaded")
    try:
        if elastic:
            old = [ckpt.read_trainer_state(found.dir, r).loader for r in range(found.world_size)]
            tr.loader.load_state_dict(old)  # every old rank's slots: the elastic rule
            own = first  # rank 0's step and counters; RNG streams start afresh at a new size
        else:
            own = first if env.rank == 0 else ckpt.read_trainer_state(found.dir, env.rank)
            tr.loader.load_state_dict(own.loader)
            set_rng_state(own.rng)
    except (ValueError, KeyError) as e:  # the loader refuses a state saved for other data
        raise CheckpointError(f"{found.dir}: the loader position saved there does not fit this run's data: "
                              f"{e}") from None
    tr.state.load_state_dict(own.trainer.state_dict())
    tr.resumed_dir = found.dir
    for cb in tr.callbacks:
        cb.load_state_dict(own)
