"""The training loop: load -> while not done: step -> log -> save -> eval -> stop.

``run_rank(cfg)`` runs this process as one rank; the torch.distributed environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) must be set by whoever started it (``roformer-train``'s spawner,
torchrun, or the SLURM launcher). It returns ``EXIT_DONE`` when the curriculum is finished or
``trainer.stop_at_step`` is reached, ``EXIT_REQUEUE`` after a stop signal (a complete checkpoint was
saved; run again to continue), ``EXIT_NONFINITE`` after too many consecutive non-finite losses, and
raises the errors of :mod:`roformer_dist.errors` (config, data, checkpoint, lock, storage) for its
caller to report. When and what the loop logs, saves and evaluates is decided by
:class:`~roformer_dist.policies.LoopPolicy`; the step itself is the runner's
(:class:`~roformer_dist.parallel.runner.ParallelRunner`); files are the checkpoint layer's.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from roformer_dist import checkpoint as ckpt
from roformer_dist.config import Config, dump_yaml, micro_batch_size, replace, save_config, to_dict, validate
from roformer_dist.curriculum import lr_at, stage_at, total_steps
from roformer_dist.errors import CheckpointError, DataError, StorageError
from roformer_dist.evaluation import Evaluator
from roformer_dist.faults import NO_FAULTS, Faults
from roformer_dist.metrics import MetricsWriter, max_mem_gb, peak_flops
from roformer_dist.policies import LoopPolicy, Stop
from roformer_dist.resume_check import check_compatible
from roformer_dist.stop import EXIT_DONE, EXIT_NONFINITE, EXIT_REQUEUE, StopFlag, ignore_late_stop_signals
from roformer_dist.trainer_state import TrainCounters, TrainerState, rng_state, set_rng_state

__all__ = ["run_rank", "Trainer", "DistEnv", "init_distributed", "resolve_data", "EXIT_DONE", "EXIT_REQUEUE",
           "EXIT_NONFINITE"]

log = logging.getLogger("roformer_dist.trainer")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"run_rank needs the torch.distributed environment; missing {missing}")
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


class TorchComm(ckpt.Comm):
    """The checkpoint layer's collectives over the default process group."""

    @staticmethod
    def _multi() -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def barrier(self) -> None:
        if self._multi():
            dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        if not self._multi():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self._multi():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class _FileHandler(logging.FileHandler):
    """A rank's log file that, when it cannot be written (disk full), says so once on stderr and goes
    quiet, instead of printing a traceback for every record."""

    failed = False

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            e = sys.exc_info()[1]
            print(f"roformer-train: cannot write the log file {self.baseFilename} ({e}); logging to it stops",
                  file=sys.stderr, flush=True)


def setup_logging(cfg: Config, rank: int) -> None:
    logs = Path(cfg.run_dir) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        fh = _FileHandler(logs / f"rank{rank}.log")
    except OSError as e:
        raise StorageError.from_os_error(e, "opening the rank log") from None
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    fh.setFormatter(fmt)
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    sh.setLevel(cfg.logging.level.upper() if rank == 0 else logging.WARNING)
    root.addHandler(fh)
    root.addHandler(sh)
    root.setLevel(cfg.logging.level.upper())
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "compilers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _data_error(e: Exception, during: str) -> DataError:
    """A DataError with the loader's own message, saying when it happened. A DataLoader worker's
    exception arrives re-raised with the worker's traceback in its text ("Caught X in DataLoader worker
    ... Original Traceback ..."): only its last line, the error itself, is kept."""
    text = str(e)
    if "Original Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        kind, sep, rest = last.partition(": ")
        text = rest if sep and kind.split(".")[-1].endswith("Error") else last
    return DataError(f"{during}: {text}")


def resolve_data(cfg: Config, resumed_state: Optional[dict]) -> tuple[Config, dict]:
    """Read the shard manifests; fill model.vocab_size; refuse mismatches before training
    (:func:`data_pipeline.manifest.check_training_data`: DataError / UsageError naming the key and field)."""
    from data_pipeline.errors import UsageError
    from data_pipeline.manifest import check_training_data
    from data_pipeline.source import RetryPolicy, set_default_retry

    from roformer_dist.errors import ConfigError

    # URL reads of this process and of the loaders it creates (their workers inherit the policy)
    set_default_retry(RetryPolicy(attempts=cfg.data.url_retries, wait_s=cfg.data.url_retry_wait_s))
    auto = cfg.model.vocab_size == "auto"
    try:
        manifest = check_training_data(
            cfg.data.shards, cfg.data.eval_shards, model_vocab_size=None if auto else cfg.model.vocab_size,
            checkpoint_tokenizer_sha256=(resumed_state or {}).get("tokenizer_sha256"))
    except UsageError as e:  # a config key (data.shards empty, model.vocab_size) that disagrees with the data
        raise ConfigError(str(e)) from None
    if auto:
        cfg = replace(cfg, **{"model.vocab_size": int(manifest["vocab_size"])})
    return cfg, manifest


class Trainer:
    """One rank's training run; see the module docstring.

    ``stop``: the process's stop flag, installed by its entry point (the default is inert: a trainer
    built in a test or a notebook never stops on a signal); ``faults``: fault injection for tests."""

    def __init__(self, cfg: Config, env: DistEnv, stop: Optional[StopFlag] = None, faults: Faults = NO_FAULTS):
        self.cfg = cfg
        self.env = env
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.stages = cfg.curriculum.stages
        self.total = total_steps(self.stages)
        self.policy = LoopPolicy.from_config(cfg)
        self.state = TrainCounters()
        self.stop = stop if stop is not None else StopFlag()
        self.faults = faults
        self.comm = TorchComm()
        self.metrics: Optional[MetricsWriter] = None
        self.elastic = False
        self.last_good: Optional[int] = None
        """The last step whose update was applied (for the non-finite stop's message)."""
        self.evaluator = Evaluator(cfg) if cfg.data.eval_shards else None
        """Keeps the unigram counts (read at the first eval) and each length's baselines."""

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Read the data manifests, choose and check the checkpoint, build model, engine and loader,
        load the checkpoint. The run's record (config.yaml, metrics.jsonl, TensorBoard) is not touched
        before the checks passed: config.yaml is written last (a damaged checkpoint may be marked BAD)."""
        from data_pipeline.loader import ShardLoader
        from roformer_dist.model import RoFormerForMaskedLM
        from roformer_dist.parallel.runner import build_parallel_engine

        cfg, env = self.cfg, self.env
        cfg, self.manifest = resolve_data(cfg, None)  # the tokenizer vs checkpoint check is check_compatible's
        validate(cfg, env.world_size)
        found = ckpt.choose_resume(self.ckpt_root, env.rank, env.world_size, self.comm) \
            if cfg.checkpoint.resume else None
        resumed = ckpt.read_trainer_state(found.dir, 0) if found else None
        if found:
            check_compatible(found, resumed, cfg, env.world_size, self.manifest)
        self.cfg = cfg
        self.policy = LoopPolicy.from_config(cfg)
        if env.rank == 0:
            log.info("resolved config:\n%s", dump_yaml(cfg))

        self.elastic = bool(found) and found.world_size != env.world_size
        if self.elastic and cfg.deepspeed.zero_stage > 0:
            if env.rank == 0:
                ckpt.to_universal(found.dir, cfg.deepspeed.zero_stage)
            self.comm.barrier()

        torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
        model = RoFormerForMaskedLM(cfg.model)
        self.flops_per_token = model.flops_per_token
        if cfg.parallel.tensor == cfg.parallel.pipeline == 1:
            self.preflight(model)
        first = stage_at(self.stages, found.step if found and found.step < self.total else 0)
        self.stage_index = first.index
        self.engine, self.runner = build_parallel_engine(
            cfg, model, first.stage, env.world_size, load_universal=self.elastic and cfg.deepspeed.zero_stage > 0)
        self.dp_rank, self.dp_size = self.runner.dp_rank, self.runner.dp_size
        mbs = micro_batch_size(cfg, first.stage, env.world_size)
        self.loader = ShardLoader(cfg.data.shards, seq_len=first.stage.seq_len, micro_batch_size=mbs,
                                  dp_rank=self.dp_rank, dp_size=self.dp_size, num_workers=cfg.data.num_workers,
                                  seed=cfg.trainer.seed, mlm_probability=cfg.data.mlm_probability,
                                  whole_word_mask=cfg.data.whole_word_mask, skip_bad_shards=cfg.data.skip_bad_shards,
                                  pin_memory=torch.cuda.is_available())
        # dropout: one stream per replica and pipeline stage, shared by the tensor ranks of a stage
        torch.manual_seed(cfg.trainer.seed + 1 + self.runner.seed_offset)
        if found:
            self.resume(found, resumed)
        if env.rank == 0:
            try:
                save_config(cfg, self.run_dir / "config.yaml")
            except OSError as e:
                raise StorageError.from_os_error(e, "writing config.yaml") from None
        self.metrics = MetricsWriter(self.run_dir, env.rank, self.state.step, cfg.logging.tensorboard)
        if env.rank == 0 and not found:
            self.metrics.text("config", "```\n" + dump_yaml(cfg) + "\n```")

    def preflight(self, model) -> None:
        """On GPU: one forward/backward at the largest micro-batch of the curriculum, before DeepSpeed.

        A micro-batch that does not fit then fails at start-up, naming the stage, not hours later
        when a long stage begins."""
        if not torch.cuda.is_available():
            return
        worst = max(self.stages, key=lambda s: micro_batch_size(self.cfg, s, self.env.world_size) * s.seq_len
                    * (1 + s.seq_len / 1024))
        mbs = micro_batch_size(self.cfg, worst, self.env.world_size)
        dev = torch.device("cuda", self.env.local_rank)
        model.to(dev)
        ids = torch.randint(5, self.cfg.model.vocab_size, (mbs, worst.seq_len), device=dev)
        labels = torch.where(torch.rand(ids.shape, device=dev) < 0.15, ids, torch.full_like(ids, -100))
        try:
            model(ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
        except torch.cuda.OutOfMemoryError:
            raise RuntimeError(
                f"curriculum stage {worst.name!r} (seq_len {worst.seq_len}, micro_batch_size {mbs}) does not fit "
                "in GPU memory: lower curriculum.tokens_per_micro_batch or the stage's micro_batch_size "
                "(gradient accumulation keeps the global batch)") from None
        finally:
            model.zero_grad(set_to_none=True)
        model.cpu()
        torch.cuda.empty_cache()

    def resume(self, found: ckpt.Found, resumed: TrainerState) -> None:
        env = self.env
        log.info("resuming from %s (step %d, written by %d rank(s))", found.dir, found.step, found.world_size)
        if self.elastic:
            log.warning("world size changed %d -> %d: the loader re-deals the unread shards", found.world_size,
                        env.world_size)
        if self.elastic and self.cfg.deepspeed.zero_stage > 0:
            log.warning("loading the universal checkpoint %s/%s", found.dir, ckpt.UNIVERSAL)
            self.runner.load_checkpoint(str(found.dir), ckpt.UNIVERSAL)
        else:
            self.runner.load_checkpoint(str(self.ckpt_root), found.tag)
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

    # ------------------------------------------------------------------ steps
    def switch_stage(self, index: int) -> None:
        st = self.stages[index]
        mbs = micro_batch_size(self.cfg, st, self.env.world_size)
        self.loader.set_stage(st.seq_len, mbs)
        self.runner.set_stage(st, self.env.world_size)
        self.stage_index = index
        log.info("stage %d/%d %r: seq_len %d, global batch %d, micro-batch %d, accumulation %d",
                 index + 1, len(self.stages), st.name, st.seq_len, st.global_batch_size, mbs,
                 self.runner.accumulation_steps)

    def _batches(self):
        return iter(self.loader) if self.runner.reads_data else None

    def train_step(self, batches, lr: float):
        """One optimizer step (the runner's) and the counters; returns (StepStats, seconds)."""
        from data_pipeline.shards import CorruptShardError

        self.runner.set_lr(lr)
        t0 = time.monotonic()
        try:
            stats = self.runner.train_step(batches, stop=self.stop.requested,
                                           inject_nan=self.faults.nan_at(self.state.step + 1))
        except (DataError, CorruptShardError) as e:
            raise _data_error(e, f"training step {self.state.step + 1}") from None
        dt = time.monotonic() - t0
        self.faults.after_step()
        s = self.state
        s.step += 1
        s.tokens_seen += stats.num_tokens
        s.samples_seen += stats.num_samples
        if stats.nonfinite:
            s.nonfinite_total += 1
            s.consecutive_nonfinite += 1
            log.warning("step %d: non-finite loss, update skipped (%d in a row, %d in all)", s.step,
                        s.consecutive_nonfinite, s.nonfinite_total)
        else:
            s.consecutive_nonfinite = 0
            self.last_good = s.step
        return stats, dt

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and MLM accuracy at each eval length of the current stage, with the unigram and
        most-frequent-token baselines at the same predicted positions (:mod:`roformer_dist.evaluation`).
        The result does not depend on the world size."""
        if self.evaluator is None:
            return {}
        reduce = self._all_reduce_on_device if dist.get_world_size() > 1 else None
        return self.evaluator.evaluate_stage(self.stages[self.stage_index], self.runner.eval_step, self.dp_rank,
                                             self.dp_size, reduce, step=self.state.step)

    def _all_reduce_on_device(self, sums: torch.Tensor) -> None:
        """Sum a CPU tensor over all ranks, in place, on the engine's device (NCCL reduces no CPU tensors)."""
        on_device = sums.to(self.engine.device)
        dist.all_reduce(on_device)
        sums.copy_(on_device.cpu())

    def run_eval(self) -> None:
        from data_pipeline.shards import CorruptShardError

        try:
            ev = self.evaluate()
        except (DataError, CorruptShardError) as e:
            raise _data_error(e, f"eval at step {self.state.step} (the checkpoint of this step is saved)") from None
        if ev:
            self.metrics.scalars(self.state.step, ev)
            log.info("step %d eval: %s", self.state.step, "  ".join(f"{k}={v:.4f}" for k, v in ev.items()))

    def save(self) -> None:
        payload = TrainerState(trainer=self.state, loader=self.loader.state_dict(), rng=rng_state(),
                               world_size=self.env.world_size, rank=self.env.rank, config=to_dict(self.cfg),
                               tokenizer_sha256=self.manifest["tokenizer"]["sha256"], stage_index=self.stage_index)
        ckpt.save(self.runner, self.ckpt_root, self.state.step, payload, self.env.rank, self.env.world_size,
                  self.cfg.checkpoint.keep_last, self.comm, self.faults)

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        """load (done in setup) -> while not done: step -> log -> save -> eval -> stop."""
        policy, s = self.policy, self.state
        if policy.done(s.step):
            log.info("nothing to do: step %d already reached (stop at %d of %d)", s.step, policy.last_step,
                     self.total)
            return EXIT_DONE
        self.switch_stage(stage_at(self.stages, s.step).index)
        batches = self._batches()
        while True:
            at = stage_at(self.stages, s.step)
            if at.index != self.stage_index:
                self.switch_stage(at.index)
                batches = self._batches()
            lr = lr_at(self.cfg.optim, self.stages, s.step)
            stats, dt = self.train_step(batches, lr)
            self.record(stats, lr, dt, at)
            stop = policy.stop(s.step, stop_requested=stats.stop, consecutive_nonfinite=s.consecutive_nonfinite)
            self._announce(stop)
            if policy.save_now(s.step, stop):
                self.save()
            if policy.eval_now(s.step, stop):
                self.run_eval()
            elif stop is not None and policy.eval(s.step):
                log.info("step %d: eval skipped (stopping)", s.step)
            if stop is not None:
                self._announce_end(stop)
                return stop.status

    def _announce(self, stop: Optional[Stop]) -> None:
        s = self.state
        if stop is None:
            return
        if stop.reason == "nonfinite":
            log.error("stopping: %d consecutive non-finite losses (trainer.max_nonfinite_steps); the parameters "
                      "are those of step %s, the last good update", s.consecutive_nonfinite, self.last_good)
        elif stop.reason == "signal":
            own = f"signal {self.stop.name}" if self.stop.requested else "another rank was signalled"
            self._say("stop requested (%s): saving at step %d", own, s.step)

    def _announce_end(self, stop: Stop) -> None:
        if stop.reason == "done":
            log.info("done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)
        elif stop.reason == "signal":
            self._say("saved step %d after the stop request; exit status %d (run again to continue)",
                      self.state.step, EXIT_REQUEUE)

    def _say(self, msg: str, *args) -> None:
        """A warning on the console once (rank 0); the other ranks note it in their own log."""
        (log.warning if self.env.rank == 0 else log.info)(msg, *args)

    def record(self, stats, lr: float, dt: float, at) -> None:
        s, st = self.state, at.stage
        toks_per_s = stats.num_tokens / dt if dt > 0 else 0.0
        loss = None if stats.nonfinite else stats.loss
        # time: when the step ended (Unix seconds); step_time_s: the runner's share of it (data + compute +
        # communication), so that the loop's own cost is time[i] - time[i - 1] - step_time_s[i]
        rec = {"step": s.step, "loss": loss, "mlm_acc": stats.mlm_acc, "lr": lr, "seq_len": st.seq_len,
               "stage": st.name, "samples": stats.num_samples, "global_batch": self.runner.global_batch_size,
               "accumulation": self.runner.accumulation_steps, "tokens_seen": s.tokens_seen,
               "skipped": stats.nonfinite, "time": round(time.time(), 4), "step_time_s": round(dt, 5)}
        self.metrics.step_record(rec)
        if not self.policy.log(s.step):
            return
        scalars = {"train/loss": loss, "train/mlm_acc": stats.mlm_acc, "train/lr": lr, "train/seq_len": st.seq_len,
                   "train/stage": at.index, "train/grad_norm": self.runner.grad_norm(),
                   "train/loss_scale": self.runner.loss_scale(), "perf/tokens_per_s": toks_per_s,
                   "perf/samples_per_s": stats.num_samples / dt if dt else 0.0, "perf/step_time_s": dt,
                   "perf/max_mem_gb": max_mem_gb()}
        peak = peak_flops()
        if peak:
            fpt = self.flops_per_token(st.seq_len, self.cfg.data.mlm_probability)
            scalars["perf/mfu"] = toks_per_s * fpt / (peak * self.env.world_size)
        self.metrics.scalars(s.step, scalars)
        if self.env.rank == 0:
            shown = "nan (skipped)" if stats.nonfinite else f"{stats.loss:.4f}"
            log.info("step %d/%d [%s len %d] loss %s acc %.3f lr %.2e %.0f tok/s %.2f s/step", s.step,
                     self.total, st.name, st.seq_len, shown, stats.mlm_acc, lr, toks_per_s, dt)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def init_distributed(cfg: Config, env: DistEnv) -> None:
    backend = cfg.dist.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=cfg.dist.timeout_s))
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def _take_run_lock(cfg: Config, env: DistEnv, stop: StopFlag):
    """Global rank 0 takes the run lock and checks that the checkpoint directory is writable; every
    rank learns the outcome (collective), so a refused launch ends on every rank with the same error."""
    from roformer_dist.errors import RunLockedError
    from roformer_dist.runlock import RunLock

    lock, error = None, None
    if env.rank == 0:
        try:
            lock = RunLock(cfg.run_dir).acquire()
            ckpt.check_writable(Path(cfg.run_dir) / "checkpoints", "the checkpoint directory")
        except (RunLockedError, StorageError) as e:
            error = e
    error = TorchComm().broadcast(error)
    if error is not None:
        if lock is not None:
            lock.release()
        raise error
    if lock is not None:
        stop.on_abort(lock.release)
    return lock


def run_rank(cfg: Config, *, stop: Optional[StopFlag] = None, faults: Optional[Faults] = None,
             hold_lock: bool = True) -> int:
    """Run this process as one rank of the job described by ``cfg``; see the module docstring.

    ``stop``: the stop flag the caller installed (``roformer-train`` does it first thing, in its launcher
    and in each rank it spawns, and under torchrun or srun); None installs it here (the submitit job of
    ``roformer-submit``, a direct call). ``faults``: None reads the test fault
    variables of the environment, once. ``hold_lock``: global rank 0 holds the run lock (torchrun,
    SLURM); the local spawner holds it itself and passes False."""
    env = DistEnv.from_environ()
    if stop is None:
        stop = StopFlag.install()
    if faults is None:
        faults = Faults.from_environ()
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one machine share its cores; oversubscribed threads make every rank slower
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    own_group = not dist.is_initialized()
    init_distributed(cfg, env)
    lock = _take_run_lock(cfg, env, stop) if hold_lock else None
    try:
        setup_logging(cfg, env.rank)
        trainer = Trainer(cfg, env, stop=stop, faults=faults)
        try:
            trainer.setup()
            code = trainer.fit()
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.release()
    if code == EXIT_DONE:
        ignore_late_stop_signals()
    if own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code
