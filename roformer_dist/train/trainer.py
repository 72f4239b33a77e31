"""The training loop: load -> while not done: step -> log -> save -> eval -> stop.

:class:`Trainer` is one rank's run; :func:`roformer_dist.train.entry.run_rank` builds it inside the
process group. When and what the loop logs, saves and evaluates is decided by
:class:`~roformer_dist.train.policies.LoopPolicy`; the step itself is the runner's
(:class:`~roformer_dist.parallel.runner.ParallelRunner`); files are the checkpoint layer's
(:mod:`roformer_dist.checkpoint.store`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from data_pipeline.loader import ShardLoader
from data_pipeline.shards import CorruptShardError
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.async_save import AsyncSaver
from roformer_dist.checkpoint.compat import changed_settings
from roformer_dist.checkpoint.lineage import Parent, write_parent
from roformer_dist.checkpoint.safe_load import weights_only_loads
from roformer_dist.checkpoint.trainer_state import TrainCounters, TrainerState, rng_state, set_rng_state
from roformer_dist.checkpoint.universal import UNIVERSAL, to_universal
from roformer_dist.config import Config, dump_yaml, rope_settings, save_config, to_dict
from roformer_dist.errors import EXIT_DONE, EXIT_REQUEUE, CheckpointError, DataError, StorageError
from roformer_dist.nn.model import RoFormerForMaskedLM, batch_plan
from roformer_dist.nn.rotary_tune import RotaryChoices
from roformer_dist.parallel.runner import StepStats, build_parallel_engine
from roformer_dist.runtime.faults import NO_FAULTS, Faults
from roformer_dist.runtime.heartbeat import Heartbeat
from roformer_dist.runtime.process_group import DistEnv, TorchComm
from roformer_dist.runtime.rundir import RunDir
from roformer_dist.runtime.stop import StopFlag
from roformer_dist.train.curriculum import StageAt, lr_at, stage_at, total_steps
from roformer_dist.train.data import data_error
from roformer_dist.train.eval_steps import EvalSteps
from roformer_dist.train.evaluation import Evaluator
from roformer_dist.train.metrics import MetricsWriter, matmul_precision, max_mem_gb, peak_flops, run_sinks
from roformer_dist.train.mixture import loader_sources
from roformer_dist.train.policies import LoopPolicy, Stop
from roformer_dist.train.preflight import preflight
from roformer_dist.train.profiling import ProfileWindow
from roformer_dist.train.resolved import ResolvedRun
from roformer_dist.train.rollback import roll_back
from roformer_dist.train.rotary_choice import choose_rotary_backend
from roformer_dist.train.spikes import SpikeGuard
from roformer_dist.train.stragglers import StragglerWatch
from roformer_dist.train.warm_start import optimizer_checkpoint, warm_start

__all__ = ["Trainer"]

log = logging.getLogger("roformer_dist.trainer")



class Unread(NamedTuple):
    """A step run whose device statistics may not be read yet, with what its record needs."""
    step: int
    stats: StepStats
    lr: float
    dt: float
    at: StageAt
    tokens_seen: int
    ended: float
    """When the host finished the step (Unix seconds)."""
    rotary: Optional[dict] = None
    """The rotary backend's measurement, on the first step after it."""


class Trainer(EvalSteps):
    """One rank's training run; see the module docstring.

    ``run``: the launch resolved by its launcher (config, manifests, mixture plan, stage plans, resume decision);
    the trainer derives none of it again. ``stop``: the process's stop flag, installed by its entry point (the default is inert: a trainer
    built in a test or a notebook never stops on a signal); ``faults``: fault injection for tests."""

    def __init__(self, run: ResolvedRun, env: DistEnv, stop: Optional[StopFlag] = None, faults: Faults = NO_FAULTS,
                 on_hang: Callable[[], None] = lambda: None):
        if run.world_size != env.world_size:
            raise ValueError(f"Trainer: the run was resolved for {run.world_size} rank(s), this rank is one of "
                             f"{env.world_size}")
        self.run = run
        cfg = self.cfg = run.cfg
        self.env = env
        self.on_hang = on_hang
        self.heartbeat: Optional[Heartbeat] = None  # the hang watchdog (dist.hang_timeout_s), armed in fit()
        self.spikes = SpikeGuard(cfg.trainer)  # trainer.spike
        self.run_dir = run.run_dir.root
        self.paths = run.run_dir
        self.ckpt_root = self.paths.checkpoints
        self.manifest = run.manifest
        self.stages = cfg.curriculum.stages
        self.total = total_steps(self.stages)
        self.policy = LoopPolicy.from_config(cfg)
        self.state = TrainCounters()
        self.stop = stop if stop is not None else StopFlag()
        self.faults = faults
        self.comm = TorchComm()
        self.stragglers = StragglerWatch(cfg.dist.straggler_factor, cfg.dist.straggler_log_steps, env.rank, self.comm)
        self.metrics: Optional[MetricsWriter] = None
        self.loader: Optional[ShardLoader] = None
        self.elastic = False
        self.last_good: Optional[int] = None
        """The last step whose update was applied (for the non-finite stop's message)."""
        self.evaluator: Optional[Evaluator] = None
        """Keeps the unigram counts (read at the first eval) and each length's baselines."""
        self.source_evaluators: dict[str, Evaluator] = {}
        """One per data.eval_sources set (sharing the unigram counts)."""
        self._source_tokens_logged: Optional[dict] = None
        self._eval_due = False
        """The eval of the current step is scheduled but was not run (a stop skipped it)."""
        self._resumed_dir: Optional[Path] = None
        """The checkpoint this launch resumed from."""
        self.plan = run.mixture
        """The corpus mixture's plan: each stage's shares of the sources."""
        self._rope = None
        """The rotary settings in force (a stage may change them)."""
        self.parent: Optional[Parent] = None
        """What this run's weights were initialised from (``init.from``), when it started so in this process."""
        self.saver: Optional[AsyncSaver] = None
        """The background checkpoint writer (``checkpoint.async``)."""
        self.profiler: Optional[ProfileWindow] = None
        self.peak_flops = peak_flops(matmul_precision(cfg.deepspeed.precision))
        """Dense peak FLOP/s of this GPU at the run's matmul precision; None: no MFU (said once in the log)."""
        self._unread: list[Unread] = []
        """Steps whose device statistics are not read yet (read at log, save and stop steps: ``_read_due``)."""
        self._window = [0, 0, 0.0]
        """Tokens, samples and seconds of the steps since the last log step (perf/*)."""
        self._logged_step = 0
        """The step the window starts after."""
        self._rotary_record: Optional[dict] = None
        """A rotary backend measured at the last stage switch, for the next step's record (rank 0)."""
        self._rollback_note: Optional[dict] = None
        """A loss-spike rollback just done (``train/rollback.py``), for the next step's record."""
        self._rolled_back = False
        """The last read rolled the run back: the loop starts over from the checkpoint's step."""
        self._stage_first_step = False
        """The next step is the first of a stage (the hang watchdog allows it dist.first_step_timeout_s)."""

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the model (from ``init.from``'s weights when the run resolved a warm start), engine and loader,
        load the checkpoint the run resolved. The run's record (config.yaml, metrics.jsonl, TensorBoard) is not
        touched before the checkpoint loaded: config.yaml is written last."""
        cfg, env, run = self.cfg, self.env, self.run
        self._build_evaluators(cfg)
        found = run.resume.checkpoint
        resumed = ckpt.read_trainer_state(found.dir, 0) if found else None
        if env.rank == 0:
            log.info("resolved config:\n%s", dump_yaml(cfg))
            run.log_notes()
            log.info("%s", run.summary())
            log.info("%s", self.plan.table())
            for warning in self.plan.warnings():
                log.warning("%s", warning)

        self.elastic = run.elastic
        if self.elastic and cfg.deepspeed.zero_stage > 0:
            if env.rank == 0:
                to_universal(found.dir, cfg.deepspeed.zero_stage)
            self.comm.barrier()

        torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
        model = RoFormerForMaskedLM(cfg.model)
        if found and cfg.init.from_ and not cfg.init.decay_steps and env.rank == 0:
            log.info("init.from %s not read: resuming this run's own checkpoint", cfg.init.from_)
        if run.resume.warm_start is not None:
            self.parent, weights = warm_start(cfg, self.manifest["tokenizer"]["sha256"])
            model.load_state_dict(weights)
            if env.rank == 0:
                log.info("warm start from %s %s%s", self.parent.kind, self.parent.path,
                         f" (step {self.parent.step})" if self.parent.step is not None else "")
        self.flops_per_token = model.flops_per_token
        if cfg.parallel.tensor == cfg.parallel.pipeline == 1:
            preflight(model, cfg, run.stages, run.manifests, run.world_size, env.local_rank)
        first = stage_at(self.stages, found.step if found and found.step < self.total else 0)
        self.stage_index = first.index
        plan = run.stages[first.index]
        self.engine, self.runner = build_parallel_engine(
            cfg, model, plan, env.world_size, load_universal=self.elastic and cfg.deepspeed.zero_stage > 0)
        self.dp_rank, self.dp_size = self.runner.dp_rank, self.runner.dp_size
        self.rotary_choices = RotaryChoices.load(self.paths.rotary_choices) if env.rank == 0 else None
        self.loader = ShardLoader(loader_sources(cfg), seq_len=plan.seq_len, micro_batch_size=plan.micro_batch_size,
                                  dp_rank=self.dp_rank, dp_size=self.dp_size, num_workers=cfg.data.num_workers,
                                  seed=cfg.trainer.seed, mlm_probability=plan.mlm_probability,
                                  whole_word_mask=cfg.data.whole_word_mask, skip_bad_shards=cfg.data.skip_bad_shards,
                                  pin_memory=torch.cuda.is_available(), packing=cfg.data.packing,
                                  weights=self.plan.stage_weights(first.index), mask_replace=cfg.data.mask_replace,
                                  prepare=None if cfg.parallel.pipeline > 1 else
                                  batch_plan(cfg.model, self.engine.device.type))
        # dropout: one stream per replica and pipeline stage, shared by the tensor ranks of a stage
        torch.manual_seed(cfg.trainer.seed + 1 + self.runner.seed_offset)
        if found:
            self.resume(found, resumed)
        elif self.parent is not None and cfg.init.load_optimizer:
            with weights_only_loads():
                self.runner.load_checkpoint(*optimizer_checkpoint(self.parent))
            log.info("optimizer state taken from %s", self.parent.path)
        if env.rank == 0:
            try:
                if self.parent is not None:
                    write_parent(self.run_dir, self.parent)
                save_config(cfg, self.paths.config)
            except OSError as e:
                raise StorageError.from_os_error(e, "writing config.yaml") from None
        self.metrics = MetricsWriter(self.run_dir, env.rank, self.state.step, run_sinks(cfg), cfg.logging)
        if cfg.checkpoint.async_:
            self.saver = AsyncSaver(self.ckpt_root, env.rank, env.world_size, cfg.checkpoint.keep_last, self.comm,
                                    cfg.dist.timeout_s, self.faults, cfg.checkpoint.checksums)
        if env.rank == 0 and not found:
            self.metrics.text("config", "```\n" + dump_yaml(cfg) + "\n```")
            self.metrics.text("mixture", "```\n" + self.plan.table() + "\n```")

    def _build_evaluators(self, cfg: Config) -> None:
        shares = self.plan.overall
        if cfg.data.eval_shards:
            self.evaluator = Evaluator(cfg, training_shares=shares)
        for e in cfg.data.eval_sources:
            self.source_evaluators[e.name] = Evaluator(cfg, e.shards, training_shares=shares, shared=self.evaluator,
                                                       batches=e.batches)
            self.evaluator = self.evaluator or self.source_evaluators[e.name]

    def resume(self, found: ckpt.Found, resumed: TrainerState, why: str = "resuming") -> None:
        env = self.env
        log.info("%s from %s (step %d, written by %d rank(s))", why, found.dir, found.step, found.world_size)
        for change in changed_settings(resumed.config, self.cfg):
            log.warning("resuming with a changed setting: %s", change)
        if self.elastic:
            log.warning("world size changed %d -> %d: the loader re-deals the unread shards", found.world_size,
                        env.world_size)
        with weights_only_loads():  # DeepSpeed's loads run no code stored in the files
            if self.elastic and self.cfg.deepspeed.zero_stage > 0:
                log.warning("loading the universal checkpoint %s/%s", found.dir, UNIVERSAL)
                self.runner.load_checkpoint(str(found.dir), UNIVERSAL)
            else:
                self.runner.load_checkpoint(str(self.ckpt_root), found.tag)
        self.faults.point("resume.loaded")
        try:
            if self.elastic:
                old = [ckpt.read_trainer_state(found.dir, r).loader for r in range(found.world_size)]
                self.loader.load_state_dict(old)  # every old rank's slots: the elastic rule
                own = resumed  # rank 0's step and counters; RNG streams start afresh at a new size
            else:
                own = resumed if env.rank == 0 else ckpt.read_trainer_state(found.dir, env.rank)
                self.loader.load_state_dict(own.loader)
                set_rng_state(own.rng)
        except (ValueError, KeyError) as e:  # the loader refuses a state saved for other data
            raise CheckpointError(f"{found.dir}: the loader position saved there does not fit this run's data: "
                                  f"{e}") from None
        self.state.load_state_dict(own.trainer.state_dict())
        self._source_tokens_logged = own.source_tokens_logged or None
        self._eval_due = own.eval_due
        self.spikes.load_state_dict(resumed.spikes)  # rank 0's: every rank's is the same
        self._resumed_dir = found.dir

    # ------------------------------------------------------------------ steps
    def loader_stage(self, index: int) -> None:
        """Point the loader at stage ``index``: its length, micro-batch, source weights and masking rate."""
        st = self.run.stages[index]
        self.loader.set_stage(st.seq_len, st.micro_batch_size, weights=self.plan.stage_weights(index),
                              mlm_probability=st.mlm_probability)

    def switch_stage(self, index: int) -> None:
        self.beat("stage.switch", first_step=True)  # measures the rotary kernel; the stage's first step compiles
        self._stage_first_step = True
        st, was = self.run.stages[index], self.run.stages[self.stage_index]
        if st.mlm_probability != was.mlm_probability:
            log.info("stage %r: masking %g of the tokens (was %g)", st.name, st.mlm_probability, was.mlm_probability)
        self.loader_stage(index)
        self.faults.point("stage.switch")
        self.runner.set_stage(st, choose_kernel=self.choose_rotary_backend)  # the stage's rotary settings too
        if st.rope != self._rope and (st.rope != rope_settings(self.cfg.model) or self._rope is not None):
            log.info("stage %r: rotary %s", st.name, ", ".join(f"{k} {v}" for k, v in st.rope.to_dict().items()))
        self._rope = st.rope
        self.stage_index = index
        log.info("stage %d/%d %r: seq_len %d, global batch %d, micro-batch %d, accumulation %d",
                 index + 1, len(self.stages), st.name, st.seq_len, st.global_batch_size, st.micro_batch_size,
                 self.runner.accumulation_steps)

    def choose_rotary_backend(self, shape: tuple[int, int, int, int], device: torch.device, compiled: bool) -> str:
        """The rotary backend of a stage (the runner asks at each stage switch, saying whether the stage runs it
        compiled; ``train/rotary_choice.py``); its measurement, if any, goes into the stage's first step record."""
        backend, self._rotary_record = choose_rotary_backend(self.cfg, self.rotary_choices, self.env.rank, self.comm,
                                                             self.paths.rotary_choices, shape, device, compiled)
        return backend

    def _batches(self):
        return iter(self.loader) if self.runner.reads_data else None

    def train_step(self, batches, lr: float):
        """One optimizer step (the runner's) and the host's counters; returns (StepStats, seconds). The step's
        device statistics may be unread (``StepStats.pending``): :meth:`read_steps` accounts for them."""
        self.runner.set_lr(lr)
        self.beat("step", first_step=self._stage_first_step)
        self._stage_first_step = False
        t0 = time.monotonic()
        try:
            step = self.state.step + 1
            stats = self.runner.train_step(batches, stop=self.stop.requested, spike_above=self.spikes.threshold(step),
                                           inject_nan=self.faults.nan_at(step),
                                           inject_spike=self.faults.spike_at(step + self.state.rolled_back_steps),
                                           delay_s=self.faults.delay())
        except (DataError, CorruptShardError) as e:
            raise data_error(e, f"training step {self.state.step + 1}") from None
        dt = time.monotonic() - t0
        self.beat("step.end")
        self.faults.after_step()
        s = self.state
        s.step += 1
        s.tokens_seen += stats.num_tokens
        s.samples_seen += stats.num_samples
        return stats, dt

    def _read_due(self, step: int, stop_requested: bool) -> bool:
        """Whether the steps run so far are read now: at log steps (records, console), saves (the checkpoint
        holds the non-finite counters, and every record of its steps is written before it commits), the end
        and stop requests; each a decision every rank takes alike."""
        p = self.policy
        return p.log(step) or p.save(step) or p.done(step) or stop_requested

    def read_steps(self) -> None:
        """Read the unread steps' device statistics (one sync), account for their non-finite losses in
        order, and record them."""
        unread, self._unread = self._unread, []
        if not unread:
            return
        t0 = time.monotonic()
        read = self.runner.read_stats([u.stats for u in unread])
        self.beat("read")
        self._window[2] += time.monotonic() - t0  # the device's work the host waited for: the window's too
        s = self.state
        for u, stats in zip(unread, read):
            if stats.nonfinite:
                s.nonfinite_total += 1
                s.consecutive_nonfinite += 1
                log.warning("step %d: non-finite loss, update skipped (%d in a row, %d in all)", u.step,
                            s.consecutive_nonfinite, s.nonfinite_total)
            else:
                s.consecutive_nonfinite = 0
                self.last_good = u.step if not stats.skipped else self.last_good
            self.spikes.observe(u.step, stats.loss, stats.num_spikes > 0, stats.nonfinite)
            self.record(u._replace(stats=stats))
            if stats.num_spikes and self.spikes.rollback and not self.spikes.too_many and roll_back(self, u.step):
                self._rolled_back = True  # the later steps read here are undone, their records dropped
                return

    def restart_window(self, rollback: dict) -> None:
        """After a rollback (``train/rollback.py``): nothing unread, the log window starts at the checkpoint's
        step, and the next record carries ``rollback``."""
        self._unread, self._window, self._logged_step = [], [0, 0, 0.0], self.state.step
        self._eval_due = False  # any eval the checkpoint's stop skipped ran before the steps rolled back
        self.runner.times.take()
        self._rollback_note = rollback

    def save(self) -> None:
        loader = self.loader.state_dict()
        self.faults.point("loader.state")
        payload = TrainerState(trainer=self.state, loader=loader, rng=rng_state(), spikes=self.spikes.state_dict(),
                               world_size=self.env.world_size, rank=self.env.rank, config=to_dict(self.cfg),
                               tokenizer_sha256=self.manifest["tokenizer"]["sha256"], stage_index=self.stage_index,
                               source_tokens_logged=self._source_tokens_logged or {}, eval_due=self._eval_due)
        t0 = time.monotonic()

        def before_commit() -> None:
            # Everything recorded up to this step is on disk before the checkpoint can count: a resume from it
            # purges only later events, so no step's events are lost. How long the loop was held: the save up to
            # its commit, or (async) the wait for the previous save and the snapshot.
            self.metrics.scalars(self.state.step, {"perf/checkpoint_stall_s": time.monotonic() - t0})
            self.metrics.flush()

        self.beat("save")
        if self.saver is None:
            ckpt.save(self.runner, self.ckpt_root, self.state.step, payload, self.env.rank, self.env.world_size,
                      self.cfg.checkpoint.keep_last, self.comm, self.faults, before_commit,
                      self.cfg.checkpoint.checksums)
        else:
            self.saver.save(self.runner, self.state.step, payload, before_commit)
        self.beat("save.end")

    def finish_saves(self) -> None:
        """Every rank: return once the save in flight is committed (a no-op for synchronous saves)."""
        if self.saver is None:
            return
        if self.saver.in_flight is not None:
            log.info("waiting for the checkpoint of step %d to be written", self.saver.in_flight)
        self.saver.wait()
        self.comm.barrier()
        self.beat("save.end")

    def beat(self, point: str, first_step: bool = False) -> None:
        """Progress at ``point`` (runtime/heartbeat.py: what the hang watchdog watches); ``first_step``: what
        follows is a stage's switch or first step, allowed ``dist.first_step_timeout_s`` where it measures or
        compiles (on a GPU: the rotary measurement, flex attention; with ``trainer.compile``: the stage)."""
        if self.heartbeat is not None:
            slow = first_step and (self.cfg.trainer.compile or torch.cuda.is_available())
            allow = self.cfg.dist.first_step_timeout_s if slow else None
            self.heartbeat.beat(point, self.state.step, allow, "dist.first_step_timeout_s, a stage's first step")

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        """load (done in setup) -> while not done: step -> log -> save -> eval -> stop."""
        policy, s = self.policy, self.state
        if policy.done(s.step):
            log.info("nothing to do: step %d already reached (stop at %d of %d)", s.step, policy.last_step,
                     self.total)
            return EXIT_DONE
        self._logged_step = s.step
        self.heartbeat = Heartbeat.armed(self.paths.hang, self.env, self.cfg.dist.hang_timeout_s, self.on_hang)
        if self._eval_due:
            self.run_skipped_eval()
        self.switch_stage(stage_at(self.stages, s.step).index)
        if self.parent is not None and s.step == 0:
            log.info("evaluating the parent before the first step")
            self.run_eval()  # step 0 of the new curves is the parent's, on this run's eval sets
        try:
            return self._loop()
        except Exception:
            if self.saver is not None:  # what was snapshotted is still written (rank 0: and committed)
                try:
                    self.saver.wait()
                except Exception as e:
                    log.error("the checkpoint in flight was not saved: %s", e)
            raise

    def _loop(self) -> int:
        policy, s = self.policy, self.state
        batches = self._batches()
        self.profiler = ProfileWindow(self.cfg.trainer.profile, self.run_dir, self.env.rank, last_step=policy.last_step)
        while True:
            at = stage_at(self.stages, s.step)
            if at.index != self.stage_index:
                # the new stage's DataLoader workers are forked with no checkpoint writer thread running: a fork
                # beside the writer once stalled a rank for 16 s and once hung a launch
                # (docs/architecture/trainer-loop.md)
                self.finish_saves()
                self.switch_stage(at.index)
                batches = self._batches()
            lr = lr_at(self.cfg.optim, self.stages, s.step)
            self.profiler.before_step(s.step + 1)
            stats, dt = self.train_step(batches, lr)
            self.profiler.after_step(s.step)
            if self.saver is not None:
                self.saver.poll()  # a failed background save ends the run here, as a synchronous one would
            self._unread.append(Unread(s.step, stats, lr, dt, at, s.tokens_seen, time.time(), self._rotary_record))
            self._rotary_record = None
            w = self._window
            w[0], w[1], w[2] = w[0] + stats.num_tokens, w[1] + stats.num_samples, w[2] + dt
            if self._read_due(s.step, stats.stop):
                self.read_steps()
            if self._rolled_back:
                self._rolled_back, batches = False, self._batches()
                continue
            stop = policy.stop(s.step, stop_requested=stats.stop, consecutive_nonfinite=s.consecutive_nonfinite,
                               too_many_spikes=self.spikes.too_many)
            self._announce(stop)
            # eval before the save: a checkpoint of step N exists only once N's eval is recorded (and flushed).
            # Every rank reads every eval batch, so an eval data error is raised on all ranks alike: they save
            # (a failing eval loses no training), then raise it.
            if policy.eval_now(s.step, stop):
                self.run_eval(then_save=policy.save_now(s.step, stop))
            # a stop skips a scheduled eval (under a deadline the checkpoint matters); its checkpoint says so,
            # and the launch that resumes from it runs that eval first
            self._eval_due = stop is not None and not policy.eval_now(s.step, stop) and policy.eval(s.step)
            if self._eval_due:
                log.info("step %d: eval skipped (stopping; the next launch runs it first)", s.step)
            if policy.save_now(s.step, stop):
                self.save()
            if stop is not None:
                self.profiler.close()
                self.finish_saves()
                self._announce_end(stop)
                return stop.status

    def _announce(self, stop: Optional[Stop]) -> None:
        s = self.state
        if stop is None:
            return
        if stop.reason == "nonfinite":
            log.error("stopping: %d consecutive non-finite losses (trainer.max_nonfinite_steps); the parameters "
                      "are those of step %s, the last good update", s.consecutive_nonfinite, self.last_good)
        elif stop.reason == "spikes":
            log.error("%s", self.spikes.stop_message(s.step))
        elif stop.reason == "signal":
            own = f"signal {self.stop.name}" if self.stop.requested else "another rank was signalled"
            self.say("stop requested (%s): saving at step %d", own, s.step)

    def _announce_end(self, stop: Stop) -> None:
        if stop.reason == "done":
            log.info("done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)
        elif stop.reason == "signal":
            self.say("saved step %d after the stop request; exit status %d (run again to continue)",
                      self.state.step, EXIT_REQUEUE)

    def say(self, msg: str, *args) -> None:
        """A warning on the console once (rank 0); the other ranks note it in their own log."""
        (log.warning if self.env.rank == 0 else log.info)(msg, *args)

    def record(self, u: "Unread") -> None:
        """One step's record in metrics.jsonl and, at a log step, the scalars and the console line. perf/*
        cover the steps since the last log step: on a GPU the host runs ahead of the device, so one step's
        host time says little, while the window (its steps' host times and the wait for the device at this
        read) is the real rate."""
        s, st, stats, lr = self.state, u.at.stage, u.stats, u.lr
        loss = None if stats.nonfinite else stats.loss
        # time: when the host finished the step (Unix seconds); step_time_s: the runner's share of the host's
        # time for the step (data + launching the compute + communication), so that the loop's own cost is
        # time[i] - time[i - 1] - step_time_s[i]
        rec = {"step": u.step, "loss": loss, "mlm_acc": stats.mlm_acc, "lr": lr, "seq_len": st.seq_len,
               "stage": st.name, "samples": stats.num_samples, "global_batch": self.runner.global_batch_size,
               "accumulation": self.runner.accumulation_steps, "tokens_seen": u.tokens_seen,
               "skipped": stats.skipped, "time": round(u.ended, 4), "step_time_s": round(u.dt, 5),
               **({"spike": True} if stats.num_spikes else {})}
        if u.rotary is not None:
            rec["rotary_backend"] = u.rotary  # measured for this stage (``auto``)
        if self._rollback_note is not None:
            rec["rollback"], self._rollback_note = self._rollback_note, None
        logging_now = self.policy.log(u.step)
        mixture = self._mixture_scalars() if logging_now and self.plan and len(self.plan.sources) > 1 else {}
        if mixture:
            rec["sources"] = {name: {"tokens": int(mixture[f"data/{name}/tokens"]), "share": mixture[f"data/{name}/share"]}
                              for name in self.loader.stats["sources"]}
        spread = {}
        if logging_now:  # every rank's own times since the last log step (a collective)
            fields, spread = self.stragglers.gather(u.step, self.runner.times.take(), max(1, u.step - self._logged_step))
            rec.update(fields)
        self.metrics.step_record(rec)
        if not logging_now:
            return
        tokens, samples, seconds = self._window
        steps = max(1, u.step - self._logged_step)
        self._window, self._logged_step = [0, 0, 0.0], u.step
        toks_per_s = tokens / seconds if seconds > 0 else 0.0
        step_time = seconds / steps
        scalars = {"train/loss": loss, "train/mlm_acc": stats.mlm_acc, "train/lr": lr, "train/seq_len": st.seq_len,
                   "train/stage": u.at.index, "train/grad_norm": self.runner.grad_norm(),
                   "train/loss_scale": self.runner.loss_scale(), "perf/tokens_per_s": toks_per_s,
                   "perf/samples_per_s": samples / seconds if seconds > 0 else 0.0, "perf/step_time_s": step_time,
                   "perf/max_mem_gb": max_mem_gb(), **mixture, **spread}
        if self.peak_flops:
            fpt = self.flops_per_token(st.seq_len, self.run.stages[u.at.index].mlm_probability)
            scalars["perf/mfu"] = toks_per_s * fpt / (self.peak_flops * self.env.world_size)
        self.metrics.scalars(u.step, scalars)
        if self.env.rank == 0:
            shown = "nan (skipped)" if stats.nonfinite else \
                f"{stats.loss:.4f}" + (" (spike, skipped)" if stats.skipped else "")
            log.info("step %d/%d [%s len %d] loss %s acc %.3f lr %.2e %.0f tok/s %.2f s/step", u.step,
                     self.total, st.name, st.seq_len, shown, stats.mlm_acc, lr, toks_per_s, step_time)

    def _mixture_scalars(self) -> dict:
        """Per source: tokens drawn so far by the whole job, and its share of the tokens since the last
        log step beside its target (``data/<name>/tokens|share|target``). Every rank takes part (one
        small all-reduce); each data-parallel replica's batches count once."""
        names = list(self.loader.stats["sources"])
        counts = self.runner.reads_data and self.runner.dims.tp_rank == 0
        mine = torch.tensor([float(self.loader.stats["sources"][n]["tokens"]) if counts else 0.0 for n in names],
                            dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._all_reduce_on_device(mine)
        totals = dict(zip(names, mine.tolist()))
        before, self._source_tokens_logged = self._source_tokens_logged or {}, totals
        return self.plan.window_scalars(totals, before, self.stage_index)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.loader is not None:
            self.loader.close()  # its workers end with the run, not when the garbage collector gets to them
        if self.profiler is not None:
            self.profiler.close()  # a run that raised inside the window
        if self.metrics is not None:
            self.metrics.close()


