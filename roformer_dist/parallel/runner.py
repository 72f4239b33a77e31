"""One engine + step API for every layout (data, tensor x data, pipeline x tensor x data).

    engine, runner = build_parallel_engine(cfg, model, stage, world_size)
    loader = ShardLoader(..., dp_rank=runner.dp_rank, dp_size=runner.dp_size)
    torch.manual_seed(cfg.trainer.seed + 1 + runner.seed_offset)    # dropout streams
    stats = runner.train_step(iter(loader), stop=..., inject_nan=...)  # a StepStats

``train_step`` returns a :class:`StepStats` already reduced over the whole job and identical on every
rank: each statistic is contributed once per data replica (loss and accuracy by the last pipeline
stage's tensor rank 0, tokens and samples by the first stage's), then summed over all ranks in one
all-reduce (``StepStats.to_tensor`` / ``from_tensor``). A stop request of any rank travels in the same
all-reduce, so every rank learns at the same step that the job stops.

Without pipeline parallelism the statistics stay on the engine's device while the micro-batches run
(no ``.item()``: on a GPU every one would wait for the kernels queued so far) and are read once, after
that all-reduce; the all-reduce runs on the engine's device too (NCCL has no CPU tensors), before the
last ``engine.step()``, because ZeRO-0 must know there whether any rank saw a non-finite loss.

Without pipeline parallelism the engine is a plain ``DeepSpeedEngine`` whose module keeps the
model's ``forward`` / ``MaskedLMOutput`` (tensor-parallel or not); with it, a ``PipelineEngine``
driven by ``train_batch`` (DeepSpeed runs forward, backward and the optimizer step of all
micro-batches itself). ``eval_step``, ``set_stage``, ``save_checkpoint`` and ``load_checkpoint`` hide
the same difference, so the trainer never touches the engine.

With ``trainer.compile`` the engine's module is compiled once per curriculum stage by ``set_stage``
(``parallel/compiled.py``; static shapes): training steps run the compiled model, ``eval_step`` the eager one.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from roformer_dist.config import Config, StageConfig, micro_batch_size, rope_settings
from roformer_dist.errors import CheckpointError
from roformer_dist.nn.rotary import set_rope
from roformer_dist.parallel.compiled import StageCompiler, compile_cache_dir
from roformer_dist.parallel.snapshot import capture
from roformer_dist.parallel.topology import ParallelDims, check_layout

log = logging.getLogger(__name__)

_NO_LABELS = torch.zeros(1)
"""What the last pipeline stage gets as 'labels' from its iterator: the real labels travel with the
activations from the first stage."""


@dataclass
class StepStats:
    """The statistics of one optimizer step; summed over ranks as one float64 tensor."""

    loss_sum: float = 0.0
    """Sum of the finite micro-batch losses."""
    num_micro_batches: int = 0
    """Micro-batches whose loss was computed (finite or not)."""
    num_correct: float = 0.0
    """Masked positions predicted right."""
    num_predicted: int = 0
    """Masked positions (MLM targets)."""
    num_tokens: int = 0
    """Non-padding tokens read."""
    num_samples: int = 0
    """Sequences read."""
    num_nonfinite: int = 0
    """Micro-batches with a NaN/inf loss."""
    num_stop_requests: int = 0
    """Ranks that asked to stop (a signal)."""

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepStats":
        values = t.tolist()
        return cls(**{f.name: (v if f.type in (float, "float") else int(round(v)))
                      for f, v in zip(fields(cls), values)})

    def add_micro_batch(self, loss: float, correct: float, predicted: int) -> None:
        finite = loss == loss and abs(loss) != float("inf")
        self.loss_sum += loss if finite else 0.0
        self.num_micro_batches += 1
        self.num_correct += correct
        self.num_predicted += predicted
        self.num_nonfinite += 0 if finite else 1

    def keep_only(self, *, loss: bool, data: bool) -> "StepStats":
        """This rank's share: the loss/accuracy fields where it reports them, the data fields likewise."""
        out = StepStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        if not loss:
            out.loss_sum, out.num_micro_batches, out.num_correct, out.num_predicted = 0.0, 0, 0.0, 0
            out.num_nonfinite = 0
        if not data:
            out.num_tokens, out.num_samples = 0, 0
        return out

    # ------------------------------------------------------------------ what the trainer reads
    @property
    def nonfinite(self) -> bool:
        return self.num_nonfinite > 0

    @property
    def loss(self) -> float:
        """Mean micro-batch loss; NaN when any was non-finite (the update was skipped)."""
        return float("nan") if self.nonfinite else self.loss_sum / max(1, self.num_micro_batches)

    @property
    def mlm_acc(self) -> float:
        return self.num_correct / max(1, self.num_predicted)

    @property
    def stop(self) -> bool:
        return self.num_stop_requests > 0


def build_parallel_engine(cfg: Config, model: torch.nn.Module, stage: StageConfig, world_size: int,
                          load_universal: bool = False, partition_method: str = "type:PipeLayer"):
    """Shard ``model`` (a freshly initialised, identical-on-every-rank ``RoFormerForMaskedLM``) for
    ``cfg.parallel`` and wrap it in DeepSpeed. Returns ``(engine, runner)``.

    ``torch.distributed`` and ``deepspeed.init_distributed`` must be initialised. ``model`` must not
    be used afterwards (its modules are sharded in place or copied into pipeline stages)."""
    from roformer_dist.parallel.engine import build_engine
    from roformer_dist.parallel.pipeline import build_pipeline_module
    from roformer_dist.parallel.tensor import parallelize

    layout = check_layout(cfg, world_size)
    dims = ParallelDims(layout)
    loss_fn, mpu, extra = None, None, None
    if layout.pipeline > 1:
        module, loss_fn = build_pipeline_module(model, dims, partition_method, cfg.deepspeed.activation_checkpointing)
        # Tensor ranks send full activations (no partition + all-gather): simpler, and on one node as cheap.
        extra = {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    elif layout.tensor > 1:
        model.gradient_checkpointing = cfg.deepspeed.activation_checkpointing
        module, mpu = parallelize(model, dims), dims
    else:
        module = model
    engine = build_engine(cfg, module, stage, world_size, load_universal, mpu=mpu, extra_config=extra)
    return engine, ParallelRunner(engine, dims, cfg, loss_fn)


class ParallelRunner:
    """The step API of one rank; see the module docstring."""

    def __init__(self, engine, dims: ParallelDims, cfg: Config, loss_fn=None):
        self.engine, self.dims, self.cfg, self.loss_fn = engine, dims, cfg, loss_fn
        self.pipeline = dims.pp_size > 1
        # trainer.compile: the model compiled per stage (set_stage); config refuses it with pipeline stages
        self.compiler = StageCompiler(engine.module, compile_cache_dir(cfg)) if cfg.trainer.compile else None

    # ------------------------------------------------------------------ topology facts for the trainer
    @property
    def dp_rank(self) -> int:
        """The loader's ``dp_rank``: the tensor ranks (and pipeline stages) of a replica read the same data."""
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def reads_data(self) -> bool:
        """Only the first pipeline stage consumes training batches."""
        return self.dims.is_first_stage

    @property
    def seed_offset(self) -> int:
        """Add to the dropout seed: equal on the tensor ranks of a stage, different elsewhere."""
        return self.dims.replica_seed_offset

    # ------------------------------------------------------------------ engine facts for the trainer's records
    @property
    def global_batch_size(self) -> int:
        return self.engine.train_batch_size()

    @property
    def accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps()

    def grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm, where the engine exposes it."""
        try:
            g = self.engine.get_global_grad_norm()
        except Exception:  # noqa: BLE001 - not every ZeRO stage / engine exposes it
            return None
        return float(g) if g is not None else None

    def loss_scale(self) -> float:
        """fp16's dynamic loss scale; 1.0 without one."""
        opt = self.engine.optimizer
        scale = getattr(opt, "loss_scale", None) or getattr(getattr(opt, "loss_scaler", None), "cur_scale", None)
        return float(scale) if scale is not None else 1.0

    # ------------------------------------------------------------------ steps
    def _reporting(self, what: str) -> bool:
        if self.dims.tp_rank != 0:
            return False
        return self.dims.is_last_stage if what == "loss" else self.dims.is_first_stage

    def _reduce(self, t: torch.Tensor) -> StepStats:
        """Keep what this rank reports of ``t`` (StepStats fields, float64, on the engine's device), sum
        over the job (the step's one all-reduce), read it (the step's one device -> host copy)."""
        mask = StepStats(*([1] * len(fields(StepStats)))).keep_only(loss=self._reporting("loss"),
                                                                    data=self._reporting("data"))
        t = t * mask.to_tensor().to(t.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return StepStats.from_tensor(t.cpu())

    def train_step(self, batches: Optional[Iterator[dict]], stop: bool = False, inject_nan: bool = False) -> StepStats:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``batches``
        (dicts with input_ids, attention_mask, token_type_ids, labels; only read where
        ``reads_data``). ``stop``: this rank's stop request (any rank's stops all)."""
        stats = StepStats(num_stop_requests=1 if stop else 0)
        if self.pipeline:
            self._pipeline_train(batches, stats, inject_nan)
            return self._reduce(stats.to_tensor().to(self.engine.device))
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        engine.train()
        t0 = time.perf_counter()
        micro = []  # one StepStats tensor per micro-batch (its loss and accuracy fields), on the device
        for i in range(gas):
            batch = next(batches)
            out = engine(**_on(batch, engine.device))
            loss = out.loss * float("nan") if inject_nan else out.loss
            stats.num_tokens += int(batch["attention_mask"].count_nonzero())  # the loader's CPU tensors: no device sync
            stats.num_samples += batch["input_ids"].shape[0]
            micro.append(_micro_batch_stats(loss.detach(), out.accuracy, out.num_predicted))
            engine.backward(loss)
            if i == 0 and self.compiler is not None:
                self.compiler.first_step_done(time.perf_counter() - t0)  # no-op after a stage's first
            if i < gas - 1:
                engine.step()
        stats = self._reduce(stats.to_tensor().to(engine.device) + torch.stack(micro).sum(0))
        if stats.nonfinite and self.cfg.deepspeed.zero_stage == 0:
            # ZeRO 1-3 detect the non-finite gradients themselves and skip; stage 0 does not.
            for p in engine.module.parameters():
                p.grad = None
        engine.step()
        return stats

    def _pipeline_train(self, batches, stats: StepStats, inject_nan: bool) -> None:
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        data = None
        if self.dims.is_first_stage:
            items = []
            for _ in range(gas):
                b = next(batches)
                stats.num_tokens += int(b["attention_mask"].count_nonzero())
                stats.num_samples += b["input_ids"].shape[0]
                items.append((_pipe_inputs(b), _NO_LABELS))
            data = iter(items)
        elif self.dims.is_last_stage:
            data = itertools.repeat((None, _NO_LABELS))
        self.loss_fn.records.clear()
        self.loss_fn.inject_nan = inject_nan
        engine.train_batch(data)
        self.loss_fn.inject_nan = False
        if self.dims.is_last_stage:
            for loss, correct, k in self.loss_fn.records:
                stats.add_micro_batch(loss, correct, k)

    @torch.no_grad()
    def eval_step(self, batch: dict) -> torch.Tensor:
        """float64 [loss * predicted, correct, predicted] of one batch, non-zero on one rank per replica:
        sum over all ranks (``dist.all_reduce``) for the job's totals."""
        sums = torch.zeros(3, dtype=torch.float64)
        engine = self.engine
        if self.pipeline:
            engine.reset_activation_shape()  # eval batches have their own shapes
            self.loss_fn.records.clear()
            data = (iter([(_pipe_inputs(batch), _NO_LABELS)]) if self.dims.is_first_stage
                    else itertools.repeat((None, _NO_LABELS)) if self.dims.is_last_stage else None)
            engine.eval_batch(data, num_micro_batches=1, bcast_loss=False)
            engine.reset_activation_shape()
            for loss, correct, k in self.loss_fn.records:
                sums += torch.tensor([loss * k, correct, k], dtype=torch.float64)
            engine.train()
        else:
            was_training = engine.module.training
            engine.eval()
            o = engine(**_on(batch, engine.device))
            k = int(o.num_predicted)
            sums += torch.tensor([float(o.loss) * k, float(o.accuracy) * k, k], dtype=torch.float64)
            engine.train(was_training)
        if not self._reporting("loss"):
            sums.zero_()
        return sums

    def set_stage(self, stage: StageConfig, world_size: int) -> None:
        """New curriculum stage: micro-batch and accumulation (and the pipeline's activation shapes), and the
        stage's rotary settings (``config.rope_settings``: they may differ from the model's)."""
        set_rope(self.engine, rope_settings(self.cfg.model, stage), self.cfg.model.max_position_embeddings)
        mbs = micro_batch_size(self.cfg, stage, world_size)
        self.engine.set_train_micro_batch_size(mbs)
        self.engine.set_train_batch_size(stage.global_batch_size)
        if self.pipeline:
            self.engine.micro_batch_size = mbs
            self.engine.reset_activation_shape()
        if self.compiler is not None:
            self.compiler.compile_stage(stage.name, stage.seq_len, mbs)

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------ checkpoints (files: roformer_dist/checkpoint/store.py)
    def save_checkpoint(self, ckpt_root: str, tag: str) -> None:
        """This rank's DeepSpeed files of checkpoint ``tag`` (collective); DeepSpeed's ``latest`` is not written."""
        self.engine.save_checkpoint(ckpt_root, tag=tag, save_latest=False)

    def snapshot_checkpoint(self, ckpt_root: str, tag: str) -> list[tuple[Path, bytes]]:
        """:meth:`save_checkpoint` into host memory (collective): ``(path, bytes)`` of each file, unwritten."""
        with capture(self.engine) as files:
            self.save_checkpoint(ckpt_root, tag)
        return files

    def load_checkpoint(self, ckpt_root: str, tag: str) -> None:
        """Load model and optimizer state of ``tag`` (collective); ``load_universal`` was fixed at build time."""
        path, _ = self.engine.load_checkpoint(ckpt_root, tag=tag)
        if path is None:
            raise CheckpointError(f"{ckpt_root}/{tag}: DeepSpeed found no model state to load on this rank")


_FIELDS = [f.name for f in fields(StepStats)]


def _micro_batch_stats(loss: torch.Tensor, accuracy: torch.Tensor, num_predicted: torch.Tensor) -> torch.Tensor:
    """What :meth:`StepStats.add_micro_batch` adds for one micro-batch, as a float64 StepStats tensor on
    the loss's device, computed without reading anything back to the host."""
    finite = torch.isfinite(loss)
    k = num_predicted.to(torch.float64)
    zero = torch.zeros_like(k)
    values = {"loss_sum": torch.where(finite, loss, 0.0).to(torch.float64), "num_micro_batches": torch.ones_like(k),
              "num_correct": accuracy.to(torch.float64) * k, "num_predicted": k,
              "num_nonfinite": (~finite).to(torch.float64)}
    return torch.stack([values.get(name, zero) for name in _FIELDS])


def _on(batch: dict, device) -> dict:
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")
    return {k: batch[k].to(device) for k in keys if batch.get(k) is not None}


def _pipe_inputs(batch: dict) -> tuple:
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    tt = batch.get("token_type_ids")
    return (ids, torch.ones_like(ids) if mask is None else mask.long(),
            torch.zeros_like(ids) if tt is None else tt, batch["labels"])
