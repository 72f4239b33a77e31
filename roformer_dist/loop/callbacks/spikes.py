"""Loss spikes (``trainer.spike: skip | rollback``): the guard's threshold handed to each step, its verdict on
each read step, and the rollback.

The guard itself (``loop/spikes.py``) is pure: what a spike is, how many stop the run. With ``rollback``, when a
read step holds a spike at step ``t`` every rank:

1. waits for a checkpoint in flight (``pre_rewind``);
2. loads the newest usable checkpoint of a scheduled step (a multiple of ``trainer.save_every`` or a stage's
   end: ``LoopPolicy.scheduled_save``) before ``t``, or, when there is none, of any step before ``t`` (a
   stop's), with the checks and the BAD-marking fallback of a resume (``loop/restore.py``). The steps after it
   are undone: weights, optimizer, counters, RNG streams and the loader's position are the checkpoint's;
3. draws and drops the batches of the steps from that checkpoint up to ``t`` (those seen before and during
   the spike), stage by stage as they were drawn (``StageSwitch.skip_batches``), and counts them
   (``TrainCounters.rolled_back_steps``);
4. rewinds the record (``tr.rewind``): every sink drops the steps after the checkpoint, as a resume from it
   does, and the next step's line in ``metrics.jsonl`` carries ``"rollback": {"spike_step", "to_step",
   "steps_skipped"}``.

The spike stays counted (``trainer.spike_max``). Training goes on from the checkpoint's step with the batches
after ``t``.

Exact resume: a launch resumed from a checkpoint written after the rollback goes on from it as any resume does.
One resumed from a checkpoint before the spike replays the steps up to it, meets the same spike and rolls
back to the same scheduled checkpoint (a stop's checkpoint in between is not a target): the same run.
Without any checkpoint before the spike, or when the checkpoint was written at another world size, there is
no rollback: the spike's update is skipped (as with ``skip``) and a warning says why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.loop.callback import Callback, StepDone, StepRequest
from roformer_dist.loop.restore import restore
from roformer_dist.loop.spikes import SpikeGuard

if TYPE_CHECKING:
    from roformer_dist.checkpoint.trainer_state import TrainerState
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.policies import Stop
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Spikes", "roll_back"]

log = logging.getLogger("roformer_dist.trainer")


class Spikes(Callback):
    def __init__(self, ctx: "BuildContext"):
        self.guard = SpikeGuard(ctx.run.cfg.trainer)
        self.note: Optional[dict] = None
        """A rollback just done, for the next step's record."""

    def pre_step(self, tr: "Trainer", req: StepRequest) -> None:
        req.spike_above = self.guard.threshold(req.step)

    def post_step(self, tr: "Trainer", done: StepDone) -> None:
        if self.note is not None:
            done.notes["rollback"], self.note = self.note, None

    def step_read(self, tr: "Trainer", done: StepDone) -> None:
        s = done.stats
        self.guard.observe(done.step, s.loss, s.num_spikes > 0, s.nonfinite)

    def step_recorded(self, tr: "Trainer", done: StepDone) -> None:
        g = self.guard
        if done.stats.num_spikes and g.rollback and not g.too_many:
            roll_back(tr, g, done.step)

    def rewound(self, tr: "Trainer", step: int, note: dict) -> None:
        self.note = note

    def wants_stop(self, tr: "Trainer") -> bool:
        return self.guard.too_many

    def on_stop(self, tr: "Trainer", stop: "Stop") -> None:
        if stop.reason == "spikes":
            log.error("%s", self.guard.stop_message(tr.state.step))

    def state_dict(self) -> dict:
        return {"spikes": self.guard.state_dict()}

    def load_state_dict(self, state: "TrainerState") -> None:
        self.guard.load_state_dict(state.spikes)


def roll_back(tr: "Trainer", guard: SpikeGuard, spike_step: int) -> bool:
    """Roll ``tr`` back past the spike of ``spike_step`` (collective); False: no checkpoint to roll back to (the
    spike's update is skipped, as it already was on the device)."""
    env, root = tr.env, tr.run.run_dir.checkpoints
    tr.callbacks.pre_rewind(tr)
    found = ckpt.choose_resume(root, env.rank, env.world_size, tr.comm,
                               accept=lambda f: f.step < spike_step and tr.policy.scheduled_save(f.step))
    if found is None:
        found = ckpt.choose_resume(root, env.rank, env.world_size, tr.comm, accept=lambda f: f.step < spike_step)
    if found is None or found.world_size != env.world_size:
        why = ("no checkpoint before it" if found is None else
               f"the newest checkpoint before it, {found.dir}, was written by {found.world_size} rank(s)")
        tr.say("step %d: no rollback (%s): the spike's update is skipped instead", spike_step, why)
        return False
    counted = guard.state_dict()
    restore(tr, found, ckpt.read_trainer_state(found.dir, 0),
            why=f"rolling back past the loss spike of step {spike_step}")
    guard.keep_counts(counted)
    tr.stage.skip_batches(tr, found.step, spike_step)
    skipped = spike_step - found.step
    tr.state.rolled_back_steps += skipped
    tr.say("step %d: rolled back to step %d; the batches of steps %d-%d are skipped (%d step(s) of data "
           "skipped by rollbacks in all)", spike_step, found.step, found.step + 1, spike_step,
           tr.state.rolled_back_steps)
    tr.rewind(found.step, {"spike_step": spike_step, "to_step": found.step, "steps_skipped": skipped})
    return True


def build(ctx: "BuildContext") -> Spikes:
    return Spikes(ctx)
