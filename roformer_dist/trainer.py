"""The training loop: load -> while not done: step -> log -> eval -> save -> maybe stop.

``run_rank(cfg)`` runs this process as one rank; the torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) must be set
by whoever started it (``roformer-train``'s spawner, torchrun, or the SLURM
launcher). It returns ``EXIT_DONE`` when the curriculum is finished or
``trainer.stop_at_step`` is reached, ``EXIT_REQUEUE`` after a stop signal
(a complete checkpoint was saved; run again to continue), ``EXIT_NONFINITE``
after too many consecutive non-finite losses.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from roformer_dist import checkpoint as ckpt
from roformer_dist import faults
from roformer_dist.config import Config, dump_yaml, micro_batch_size, replace, save_config, to_dict, validate
from roformer_dist.curriculum import lr_at, stage_at, stage_boundaries, total_steps
from roformer_dist.metrics import MetricsWriter, max_mem_gb, peak_flops
from roformer_dist.stop import EXIT_DONE, EXIT_NONFINITE, EXIT_REQUEUE, StopFlag

log = logging.getLogger("roformer_dist.trainer")


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Non-padding tokens consumed, all ranks."""
    samples_seen: int = 0
    """Sequences consumed, all ranks."""
    nonfinite_total: int = 0
    consecutive_nonfinite: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "samples_seen": self.samples_seen,
                "nonfinite_total": self.nonfinite_total, "consecutive_nonfinite": self.consecutive_nonfinite}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("step", "tokens_seen", "samples_seen", "nonfinite_total", "consecutive_nonfinite"):
            setattr(self, k, int(sd[k]))


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


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def setup_logging(cfg: Config, rank: int) -> None:
    logs = Path(cfg.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(logs / f"rank{rank}.log")
    fh.setFormatter(fmt)
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    sh.setLevel(cfg.logging.level.upper() if rank == 0 else logging.WARNING)
    root.addHandler(fh)
    root.addHandler(sh)
    root.setLevel(cfg.logging.level.upper())
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "compilers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def resolve_data(cfg: Config, resumed_state: Optional[dict]) -> tuple[Config, dict]:
    """Read the shard manifests; fill model.vocab_size; refuse mismatches before training."""
    from data_pipeline.shards import read_manifest

    if not cfg.data.shards:
        raise ValueError("data.shards: no training shard set given (a directory made by `roformer-data prepare`)")
    manifest = read_manifest(cfg.data.shards)
    vocab = int(manifest["vocab_size"])
    if cfg.model.vocab_size == "auto":
        cfg = replace(cfg, **{"model.vocab_size": vocab})
    elif cfg.model.vocab_size != vocab:
        raise ValueError(f"model.vocab_size: {cfg.model.vocab_size} differs from the shard manifest's "
                         f"vocab_size {vocab} ({cfg.data.shards}/manifest.json)")
    sha = manifest["tokenizer"]["sha256"]
    if cfg.data.eval_shards:
        ev = read_manifest(cfg.data.eval_shards)
        if ev["tokenizer"]["sha256"] != sha or int(ev["vocab_size"]) != vocab:
            raise ValueError(f"data.eval_shards: {cfg.data.eval_shards} was made with another tokenizer than "
                             f"data.shards ({ev['tokenizer']['sha256'][:12]} vs {sha[:12]})")
    if resumed_state is not None:
        old = resumed_state.get("tokenizer_sha256")
        if old and old != sha:
            raise ValueError(f"data.shards: tokenizer sha256 {sha[:12]} differs from the checkpoint's {old[:12]}; "
                             "resuming on shards of another tokenizer would scramble the vocabulary")
    return cfg, manifest


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg = cfg
        self.env = env
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.stages = cfg.curriculum.stages
        self.total = total_steps(self.stages)
        self.ends = set(stage_boundaries(self.stages))
        self.state = TrainState()
        self.stop = StopFlag()
        self.nan_steps = faults.nan_steps()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from data_pipeline.loader import ShardLoader
        from roformer_dist.model import RoFormerForMaskedLM
        from roformer_dist.parallel.runner import build_parallel_engine

        cfg, env = self.cfg, self.env
        found = ckpt.find_resume(self.ckpt_root) if cfg.checkpoint.resume else None
        resumed = ckpt.load_trainer_state(found.dir, 0) if found else None
        cfg, self.manifest = resolve_data(cfg, resumed)
        validate(cfg, env.world_size)
        self.cfg = cfg
        if env.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
            log.info("resolved config:\n%s", dump_yaml(cfg))

        self.elastic = bool(found) and found.world_size != env.world_size
        if found:
            old = resumed["config"]["parallel"]
            model_parallel = cfg.parallel.tensor > 1 or cfg.parallel.pipeline > 1
            if (old["tensor"], old["pipeline"]) != (cfg.parallel.tensor, cfg.parallel.pipeline) or (
                    self.elastic and model_parallel):
                raise ValueError(
                    f"parallel: the checkpoint {found.dir} was written with tensor {old['tensor']} x pipeline "
                    f"{old['pipeline']} on {found.world_size} ranks; resuming with tensor {cfg.parallel.tensor} x "
                    f"pipeline {cfg.parallel.pipeline} on {env.world_size} ranks is not supported (only the "
                    "data-parallel degree may change, and only without model parallelism)")
        if self.elastic and cfg.deepspeed.zero_stage > 0:
            if env.rank == 0:
                ckpt.to_universal(found.dir, cfg.deepspeed.zero_stage)
            dist.barrier()

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

    def resume(self, found: ckpt.Found, resumed: dict) -> None:
        env = self.env
        log.info("resuming from %s (step %d, written by %d rank(s))", found.dir, found.step, found.world_size)
        if self.elastic:
            log.warning("world size changed %d -> %d: the loader re-deals the unread shards", found.world_size,
                        env.world_size)
        if self.elastic and self.cfg.deepspeed.zero_stage > 0:
            log.warning("loading the universal checkpoint %s/%s", found.dir, ckpt.UNIVERSAL)
            self.engine.load_checkpoint(str(found.dir), tag=ckpt.UNIVERSAL)
        else:
            self.engine.load_checkpoint(str(self.ckpt_root), tag=found.tag)
        if self.elastic:
            old = [ckpt.load_trainer_state(found.dir, r)["loader"] for r in range(found.world_size)]
            self.loader.load_state_dict(old)  # every old rank's slots: the elastic rule
            own = resumed  # rank 0's step and counters; RNG streams start afresh at a new size
        else:
            own = resumed if env.rank == 0 else ckpt.load_trainer_state(found.dir, env.rank)
            self.loader.load_state_dict(own["loader"])
            set_rng_state(own["rng"])
        self.state.load_state_dict(own["trainer"])

    # ------------------------------------------------------------------ steps
    def switch_stage(self, index: int) -> None:
        st = self.stages[index]
        mbs = micro_batch_size(self.cfg, st, self.env.world_size)
        self.loader.set_stage(st.seq_len, mbs)
        self.runner.set_stage(st, self.env.world_size)
        self.stage_index = index
        log.info("stage %d/%d %r: seq_len %d, global batch %d, micro-batch %d, accumulation %d",
                 index + 1, len(self.stages), st.name, st.seq_len, st.global_batch_size, mbs,
                 self.engine.gradient_accumulation_steps())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and MLM accuracy at each eval length of the current stage, with the unigram and
        most-frequent-token baselines at the same predicted positions (:mod:`roformer_dist.evaluation`).
        The result does not depend on the world size."""
        from roformer_dist.evaluation import Evaluator

        if not self.cfg.data.eval_shards:
            return {}
        if getattr(self, "evaluator", None) is None:
            self.evaluator = Evaluator(self.cfg)  # keeps the unigram counts and per-length baselines
        reduce = dist.all_reduce if dist.get_world_size() > 1 else None
        return self.evaluator.evaluate_stage(self.stages[self.stage_index], self.runner.eval_step, self.dp_rank,
                                             self.dp_size, reduce, step=self.state.step)

    def save(self) -> None:
        sd = {"trainer": self.state.state_dict(), "loader": self.loader.state_dict(), "rng": rng_state(),
              "world_size": self.env.world_size, "rank": self.env.rank, "config": to_dict(self.cfg),
              "tokenizer_sha256": self.manifest["tokenizer"]["sha256"], "stage_index": self.stage_index}
        ckpt.save(self.engine, self.ckpt_root, self.state.step, sd, self.env.rank, self.env.world_size,
                  self.cfg.checkpoint.keep_last, dist.barrier)

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        cfg, t = self.cfg, self.cfg.trainer
        stop_at = t.stop_at_step or self.total
        if self.state.step >= min(stop_at, self.total):
            log.info("nothing to do: step %d already reached (stop at %d of %d)", self.state.step, stop_at, self.total)
            return EXIT_DONE
        at = stage_at(self.stages, self.state.step)
        self.switch_stage(at.index)
        it = iter(self.loader) if self.runner.reads_data else None
        last_good: Optional[int] = None
        while self.state.step < min(stop_at, self.total):
            at = stage_at(self.stages, self.state.step)
            if at.index != self.stage_index:
                self.switch_stage(at.index)
                it = iter(self.loader) if self.runner.reads_data else None
            lr = lr_at(cfg.optim, self.stages, self.state.step)
            self.runner.set_lr(lr)
            t0 = time.monotonic()
            out = self.runner.train_step(it, stop=self.stop.requested,
                                         inject_nan=self.state.step + 1 in self.nan_steps)
            dt = time.monotonic() - t0
            faults.step_delay()
            s = self.state
            s.step += 1
            s.tokens_seen += out["tokens"]
            s.samples_seen += out["samples"]
            if out["nonfinite"]:
                s.nonfinite_total += 1
                s.consecutive_nonfinite += 1
                log.warning("step %d: non-finite loss, update skipped (%d in a row, %d in all)", s.step,
                            s.consecutive_nonfinite, s.nonfinite_total)
            else:
                s.consecutive_nonfinite = 0
                last_good = s.step
            self.record(out, lr, dt, at)
            if s.consecutive_nonfinite >= t.max_nonfinite_steps:
                log.error("stopping: %d consecutive non-finite losses (trainer.max_nonfinite_steps); the "
                          "parameters are those of step %s, the last good update", s.consecutive_nonfinite,
                          last_good)
                self.save()
                return EXIT_NONFINITE
            stage_end = s.step in self.ends
            if (t.eval_every and s.step % t.eval_every == 0) or stage_end or s.step == self.total:
                ev = self.evaluate()
                if ev:
                    self.metrics.scalars(s.step, ev)
                    log.info("step %d eval: %s", s.step, "  ".join(f"{k}={v:.4f}" for k, v in ev.items()))
            if out["stop"]:
                log.warning("stop requested (signal %s): saving at step %d", self.stop.signum, s.step)
                self.save()
                return EXIT_REQUEUE
            if (t.save_every and s.step % t.save_every == 0) or stage_end or s.step == stop_at:
                self.save()
        log.info("done: %d steps, %d tokens", self.state.step, self.state.tokens_seen)
        return EXIT_DONE

    def record(self, out: dict, lr: float, dt: float, at) -> None:
        s, st = self.state, at.stage
        toks_per_s = out["tokens"] / dt if dt > 0 else 0.0
        rec = {"step": s.step, "loss": None if out["nonfinite"] else out["loss"], "mlm_acc": out["mlm_acc"],
               "lr": lr, "seq_len": st.seq_len, "stage": st.name, "samples": out["samples"],
               "global_batch": self.engine.train_batch_size(),
               "accumulation": self.engine.gradient_accumulation_steps(), "tokens_seen": s.tokens_seen,
               "skipped": out["nonfinite"]}
        self.metrics.step_record(rec)
        if s.step % self.cfg.trainer.log_every and s.step != self.total:
            return
        scalars = {"train/loss": None if out["nonfinite"] else out["loss"], "train/mlm_acc": out["mlm_acc"],
                   "train/lr": lr, "train/seq_len": st.seq_len, "train/stage": at.index,
                   "train/grad_norm": _grad_norm(self.engine), "train/loss_scale": _loss_scale(self.engine),
                   "perf/tokens_per_s": toks_per_s, "perf/samples_per_s": out["samples"] / dt if dt else 0.0,
                   "perf/step_time_s": dt, "perf/max_mem_gb": max_mem_gb()}
        peak = peak_flops()
        if peak:
            fpt = self.flops_per_token(st.seq_len, self.cfg.data.mlm_probability)
            scalars["perf/mfu"] = toks_per_s * fpt / (peak * self.env.world_size)
        self.metrics.scalars(s.step, scalars)
        if self.env.rank == 0:
            loss = "nan (skipped)" if out["nonfinite"] else f"{out['loss']:.4f}"
            log.info("step %d/%d [%s len %d] loss %s acc %.3f lr %.2e %.0f tok/s %.2f s/step", s.step,
                     self.total, st.name, st.seq_len, loss, out["mlm_acc"], lr, toks_per_s, dt)

    def close(self) -> None:
        if getattr(self, "metrics", None):
            self.metrics.close()
        self.stop.restore()


def _grad_norm(engine) -> Optional[float]:
    try:
        g = engine.get_global_grad_norm()
    except Exception:  # noqa: BLE001 - not every stage exposes it
        return None
    return float(g) if g is not None else None


def _loss_scale(engine) -> Optional[float]:
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


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


def run_rank(cfg: Config) -> int:
    """Run this process as one rank of the job described by ``cfg``; see the module docstring."""
    env = DistEnv.from_environ()
    setup_logging(cfg, env.rank)
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one machine share its cores; oversubscribed threads make every rank slower
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    own_group = not dist.is_initialized()
    init_distributed(cfg, env)
    trainer = Trainer(cfg, env)
    try:
        trainer.setup()
        code = trainer.fit()
    finally:
        trainer.close()
    if own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code
