"""The training loop: while not done: step -> read -> stop? -> (callbacks: eval, save) -> stop.

:class:`Trainer` is one rank's run, built by :func:`roformer_dist.launch.build.build_trainer` from the resolved
run. It owns the step counter, the batches, the call to the runner and the stop decision; everything else
(metrics, checkpoints, evaluation, the hang watch, stragglers, loss spikes, the profiler, the rotary measurement,
fault injection) is a callback (``loop/callback.py``, ``loop/callbacks/``). When the loop logs, saves and
evaluates is :class:`~roformer_dist.loop.policies.LoopPolicy`'s; the step itself is the runner's
(:class:`~roformer_dist.parallel.runner.ParallelRunner`); a stage switch is :class:`~roformer_dist.loop.stage.
StageSwitch`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from data_pipeline.shards import CorruptShardError
from roformer_dist.checkpoint.trainer_state import TrainCounters, TrainerState, rng_state
from roformer_dist.config import to_dict
from roformer_dist.errors import EXIT_DONE, EXIT_REQUEUE, DataError
from roformer_dist.loop.callback import Callbacks, StepDone, StepRequest
from roformer_dist.loop.policies import LoopPolicy, Stop
from roformer_dist.loop.stage import StageSwitch
from roformer_dist.plan.curriculum import lr_at, stage_at
from roformer_dist.plan.data import data_error
from roformer_dist.runtime.process_group import TorchComm
from roformer_dist.runtime.stop import StopFlag

if TYPE_CHECKING:
    from roformer_dist.launch.resolved import ResolvedRun
    from roformer_dist.runtime.process_group import DistEnv

__all__ = ["Trainer"]

log = logging.getLogger("roformer_dist.trainer")


class Trainer:
    """One rank's training run; see the module docstring.

    ``run``: the launch resolved by its launcher; ``runner``, ``loader``: the step's and the batches' (built by
    ``launch/build.py``); ``callbacks``: the run's concerns, in the table's order; ``stop``: the process's stop
    flag (the default is inert: a trainer built in a test never stops on a signal)."""

    def __init__(self, run: "ResolvedRun", env: "DistEnv", runner, loader, callbacks: Callbacks,
                 stop: Optional[StopFlag] = None, stage_index: int = 0):
        self.run, self.cfg, self.env = run, run.cfg, env
        self.runner, self.loader, self.callbacks = runner, loader, callbacks
        self.stop = stop if stop is not None else StopFlag()
        self.comm = TorchComm()
        self.policy = LoopPolicy.from_config(self.cfg)
        self.state = TrainCounters()
        self.stage = StageSwitch(stage_index, self.cfg.model.hidden_dropout_prob)
        self.last_good: Optional[int] = None
        """The last step whose update was applied (for the non-finite stop's message)."""
        self.resumed_dir: Optional[Path] = None
        """The checkpoint this launch resumed from (``loop/restore.py``)."""
        self.unread: list[StepDone] = []
        """Steps whose device statistics are not read yet (read at log, save and stop steps: :meth:`read_due`)."""
        self.rewound = False
        """The last read went back to an older checkpoint (:meth:`rewind`): the loop starts over from there."""

    @property
    def engine(self):
        return self.runner.engine

    @property
    def stage_index(self) -> int:
        return self.stage.index

    # ------------------------------------------------------------------ what callbacks call
    def progress(self, point: str, first_step: bool = False) -> None:
        """Long work moved on at ``point`` (the hang watch, fault points); ``first_step``: what follows is a
        stage's switch or first step, allowed ``dist.first_step_timeout_s``."""
        self.callbacks.progress(self, point, first_step)

    def switch_stage(self, index: int) -> None:
        self.stage.switch(self, index)

    def save(self) -> None:
        """Save this step's checkpoint: the counters, the loader's position, the RNG streams and every
        callback's state (the checkpointing callback writes it)."""
        loader = self.loader.state_dict()
        self.progress("loader.state")
        payload = TrainerState(trainer=self.state, loader=loader, rng=rng_state(), world_size=self.env.world_size,
                               rank=self.env.rank, config=to_dict(self.cfg),
                               tokenizer_sha256=self.run.manifest["tokenizer"]["sha256"], stage_index=self.stage_index,
                               **self.callbacks.state_dict())
        self.callbacks.pre_save(self)
        self.callbacks.save(self, payload)
        self.callbacks.post_save(self)

    def rewind(self, step: int, note: dict) -> None:
        """The run went back to the checkpoint of ``step`` (a rollback): nothing is unread, the loop starts over
        from there, and the callbacks hear of it (``note`` goes into the next step's record)."""
        self.unread, self.rewound = [], True
        self.callbacks.rewound(self, step, note)

    def say(self, msg: str, *args) -> None:
        """A warning on the console once (rank 0); the other ranks note it in their own log."""
        (log.warning if self.env.rank == 0 else log.info)(msg, *args)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> int:
        """while not done: step -> read -> stop? -> eval, save (callbacks) -> stop."""
        s = self.state
        if self.policy.done(s.step):
            log.info("nothing to do: step %d already reached (stop at %d of %d)", s.step, self.policy.last_step,
                     self.policy.total_steps)
            return EXIT_DONE
        self.callbacks.run_start(self)
        self.switch_stage(stage_at(self.cfg.curriculum.stages, s.step).index)
        try:
            return self._loop()
        except Exception:
            self.callbacks.on_error(self)
            raise

    def _batches(self):
        return iter(self.loader) if self.runner.reads_data else None

    def _loop(self) -> int:
        policy, s, stages = self.policy, self.state, self.cfg.curriculum.stages
        batches = self._batches()
        while True:
            at = stage_at(stages, s.step)
            if at.index != self.stage_index:
                self.switch_stage(at.index)
                batches = self._batches()
            lr = lr_at(self.cfg.optim, stages, s.step)
            stats, dt = self.train_step(batches, lr)
            done = StepDone(s.step, stats, lr, dt, at, s.tokens_seen, time.time())
            self.callbacks.post_step(self, done)
            self.unread.append(done)
            if self.read_due(s.step, stats.stop):
                self.read_steps()
            if self.rewound:
                self.rewound, batches = False, self._batches()
                continue
            stop = policy.stop(s.step, stop_requested=stats.stop, consecutive_nonfinite=s.consecutive_nonfinite,
                               too_many_spikes=self.callbacks.wants_stop(self))
            if stop is not None:
                self._announce(stop)
                self.callbacks.on_stop(self, stop)
            self.callbacks.step_end(self, s.step, stop)  # eval, then save (the table's order)
            if stop is not None:
                self.callbacks.run_end(self, stop)
                self._announce_end(stop)
                return stop.status

    def train_step(self, batches, lr: float):
        """One optimizer step (the runner's) and the host's counters; returns (StepStats, seconds). The step's
        device statistics may be unread (``StepStats.pending``): :meth:`read_steps` accounts for them."""
        self.runner.set_lr(lr)
        req = StepRequest(self.state.step + 1, stop=self.stop.requested)
        self.callbacks.pre_step(self, req)
        t0 = time.monotonic()
        try:
            stats = self.runner.train_step(batches, **req.runner_kwargs())
        except (DataError, CorruptShardError) as e:
            raise data_error(e, f"training step {req.step}") from None
        dt = time.monotonic() - t0
        self.progress("step.end")
        s = self.state
        s.step += 1
        s.tokens_seen += stats.num_tokens
        s.samples_seen += stats.num_samples
        return stats, dt

    def read_due(self, step: int, stop_requested: bool) -> bool:
        """Whether the steps run so far are read now: at log steps (records, console), saves (the checkpoint
        holds the non-finite counters, and every record of its steps is written before it commits), the end
        and stop requests; each a decision every rank takes alike."""
        p = self.policy
        return p.log(step) or p.save(step) or p.done(step) or stop_requested

    def read_steps(self) -> None:
        """Read the unread steps' device statistics (one sync), account for their non-finite losses in order,
        and hand each to the callbacks (which record it; a rollback may end the read)."""
        unread, self.unread = self.unread, []
        if not unread:
            return
        t0 = time.monotonic()
        read = self.runner.read_stats([u.stats for u in unread])
        self.progress("read")
        unread[0].waited_s = time.monotonic() - t0  # the device's work the host waited for
        s = self.state
        for u, stats in zip(unread, read):
            u.stats = stats
            if stats.nonfinite:
                s.nonfinite_total += 1
                s.consecutive_nonfinite += 1
                log.warning("step %d: non-finite loss, update skipped (%d in a row, %d in all)", u.step,
                            s.consecutive_nonfinite, s.nonfinite_total)
            else:
                s.consecutive_nonfinite = 0
                self.last_good = u.step if not stats.skipped else self.last_good
            self.callbacks.step_read(self, u)
            self.callbacks.step_recorded(self, u)
            if self.rewound:
                return  # the later steps read here are undone, their records dropped

    def _announce(self, stop: Stop) -> None:
        if stop.reason == "nonfinite":
            log.error("stopping: %d consecutive non-finite losses (trainer.max_nonfinite_steps); the parameters "
                      "are those of step %s, the last good update", self.state.consecutive_nonfinite, self.last_good)
        elif stop.reason == "signal":
            own = f"signal {self.stop.name}" if self.stop.requested else "another rank was signalled"
            self.say("stop requested (%s): saving at step %d", own, self.state.step)

    def _announce_end(self, stop: Stop) -> None:
        if stop.reason == "done":
            log.info("done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)
        elif stop.reason == "signal":
            self.say("saved step %d after the stop request; exit status %d (run again to continue)",
                     self.state.step, EXIT_REQUEUE)

    def close(self) -> None:
        self.callbacks.close(self)
        if self.loader is not None:
            self.loader.close()  # its workers end with the run, not when the garbage collector gets to them
