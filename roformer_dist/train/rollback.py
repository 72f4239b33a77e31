"""Loss-spike rollback (``trainer.spike: rollback``): back to the newest checkpoint before a spike, past the
batches since.

When the steps read at a log step hold a spike (``train/spikes.py``) at step ``t``, every rank:

1. waits for a checkpoint in flight (``checkpoint.async``);
2. loads the newest usable checkpoint of a scheduled step (a multiple of ``trainer.save_every`` or a stage's
   end: ``LoopPolicy.scheduled_save``) before ``t``, or, when there is none, of any step before ``t`` (a
   stop's), with the checks and the BAD-marking fallback of a resume. The steps after it are undone: weights,
   optimizer, counters, RNG streams and the loader's position are the checkpoint's;
3. draws and drops the batches of the steps from that checkpoint up to ``t`` (those seen before and during
   the spike), stage by stage as they were drawn, and counts them (``TrainCounters.rolled_back_steps``);
4. rewinds the record: every sink drops the steps after the checkpoint, as a resume from it does, and the
   next step's line in ``metrics.jsonl`` carries ``"rollback": {"spike_step", "to_step", "steps_skipped"}``.

The spike stays counted (``trainer.spike_max``). Training goes on from the checkpoint's step with the batches
after ``t``.

Exact resume: a launch resumed from a checkpoint written after the rollback goes on from it as any resume does.
One resumed from a checkpoint before the spike replays the steps up to it, meets the same spike and rolls
back to the same scheduled checkpoint (a stop's checkpoint in between is not a target): the same run.
Without any checkpoint before the spike, or when the checkpoint was written at another world size, there is
no rollback: the spike's update is skipped (as with ``skip``) and a warning says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from data_pipeline.shards import CorruptShardError
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.errors import DataError
from roformer_dist.train.curriculum import stage_at
from roformer_dist.train.data import data_error
from roformer_dist.train.metrics import MetricsWriter, run_sinks

if TYPE_CHECKING:
    from roformer_dist.train.trainer import Trainer

__all__ = ["roll_back"]


def roll_back(tr: "Trainer", spike_step: int) -> bool:
    """Roll ``tr`` back past the spike of ``spike_step`` (collective); False: no checkpoint to roll back to (the
    spike's update is skipped, as it already was on the device)."""
    env = tr.env
    tr.finish_saves()
    found = ckpt.choose_resume(tr.ckpt_root, env.rank, env.world_size, tr.comm,
                               accept=lambda f: f.step < spike_step and tr.policy.scheduled_save(f.step))
    if found is None:
        found = ckpt.choose_resume(tr.ckpt_root, env.rank, env.world_size, tr.comm,
                                   accept=lambda f: f.step < spike_step)
    if found is None or found.world_size != env.world_size:
        why = ("no checkpoint before it" if found is None else
               f"the newest checkpoint before it, {found.dir}, was written by {found.world_size} rank(s)")
        tr.say("step %d: no rollback (%s): the spike's update is skipped instead", spike_step, why)
        return False
    counted = tr.spikes.state_dict()
    tr.resume(found, ckpt.read_trainer_state(found.dir, 0), why=f"rolling back past the loss spike of step "
                                                                 f"{spike_step}")
    tr.spikes.keep_counts(counted)
    skip_batches(tr, found.step, spike_step)
    skipped = spike_step - found.step
    tr.state.rolled_back_steps += skipped
    tr.say("step %d: rolled back to step %d; the batches of steps %d-%d are skipped (%d step(s) of data "
           "skipped by rollbacks in all)", spike_step, found.step, found.step + 1, spike_step,
           tr.state.rolled_back_steps)
    tr.metrics.close()  # every sink drops the steps after the checkpoint, as on a resume
    tr.metrics = MetricsWriter(tr.run_dir, env.rank, found.step, run_sinks(tr.cfg), tr.cfg.logging)
    tr.restart_window({"spike_step": spike_step, "to_step": found.step, "steps_skipped": skipped})
    return True


def skip_batches(tr: "Trainer", done: int, last: int) -> None:
    """Draw and drop the batches of steps ``done + 1`` to ``last`` (each rank its own, in each step's stage),
    then set the loader to the stage of step ``done + 1``."""
    if tr.runner.reads_data:
        current, batches = None, None
        for step in range(done + 1, last + 1):
            index = stage_at(tr.stages, step - 1).index
            if index != current:
                tr.loader_stage(index)
                current, batches = index, iter(tr.loader)
            try:
                for _ in range(tr.run.stages[index].accumulation):
                    next(batches)
            except (DataError, CorruptShardError) as e:
                raise data_error(e, f"skipping the batches of step {step} (a loss-spike rollback)") from None
            tr.beat("rollback")
    tr.loader_stage(stage_at(tr.stages, done).index)
