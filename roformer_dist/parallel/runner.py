"""One engine + step API for every layout (data, tensor x data, pipeline x tensor x data).

    engine, runner = build_parallel_engine(cfg, model, stage, world_size)
    loader = ShardLoader(..., dp_rank=runner.dp_rank, dp_size=runner.dp_size)
    torch.manual_seed(cfg.trainer.seed + 1 + runner.seed_offset)    # dropout streams
    out = runner.train_step(iter(loader), stop=..., inject_nan=...)  # the trainer's train_step dict

``train_step`` returns the same dict as ``Trainer.train_step`` (loss, mlm_acc, tokens, samples,
nonfinite, stop), already reduced over the whole job and identical on every rank: each statistic is
contributed once per data replica (loss and accuracy by the last pipeline stage's tensor rank 0,
tokens and samples by the first stage's), then summed over all ranks.

Without pipeline parallelism the engine is a plain ``DeepSpeedEngine`` whose module keeps the
model's ``forward`` / ``MaskedLMOutput`` (tensor-parallel or not); with it, a ``PipelineEngine``
driven by ``train_batch`` (DeepSpeed runs forward, backward and the optimizer step of all
micro-batches itself). ``eval_step`` and ``set_stage`` hide the same difference.
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from roformer_dist.config import Config, StageConfig, micro_batch_size
from roformer_dist.parallel.topology import ParallelDims, check_layout

log = logging.getLogger(__name__)

_NO_LABELS = torch.zeros(1)
"""What the last pipeline stage gets as 'labels' from its iterator: the real labels travel with the
activations from the first stage."""


def build_parallel_engine(cfg: Config, model: torch.nn.Module, stage: StageConfig, world_size: int,
                          load_universal: bool = False, partition_method: str = "type:PipeLayer"):
    """Shard ``model`` (a freshly initialised, identical-on-every-rank ``RoFormerForMaskedLM``) for
    ``cfg.parallel`` and wrap it in DeepSpeed. Returns ``(engine, runner)``.

    ``torch.distributed`` and ``deepspeed.init_distributed`` must be initialised. ``model`` must not
    be used afterwards (its modules are sharded in place or copied into pipeline stages)."""
    from roformer_dist.engine import build_engine
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

    # ------------------------------------------------------------------ topology facts for the trainer
    @property
    def dp_rank(self) -> int:
        """The loader's ``dp_rank``: the tensor ranks (and pipeline stages) of a replica read the same data."""
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def is_first_stage(self) -> bool:
        return self.dims.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.dims.is_last_stage

    @property
    def reads_data(self) -> bool:
        """Only the first pipeline stage consumes training batches."""
        return self.dims.is_first_stage

    @property
    def seed_offset(self) -> int:
        """Add to the dropout seed: equal on the tensor ranks of a stage, different elsewhere."""
        return self.dims.replica_seed_offset

    # ------------------------------------------------------------------ steps
    def _reporting(self, what: str) -> bool:
        if self.dims.tp_rank != 0:
            return False
        return self.dims.is_last_stage if what == "loss" else self.dims.is_first_stage

    def _finish(self, stats: torch.Tensor) -> dict:
        """Zero what this rank does not report, sum over the job. Layout as Trainer.train_step's."""
        if not self._reporting("loss"):
            stats[[0, 1, 2, 3, 6]] = 0
        if not self._reporting("data"):
            stats[[4, 5]] = 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        nonfinite = stats[6].item() > 0
        return {"loss": stats[0].item() / max(1.0, stats[1].item()) if not nonfinite else float("nan"),
                "mlm_acc": stats[2].item() / max(1.0, stats[3].item()), "tokens": int(stats[4].item()),
                "samples": int(stats[5].item()), "nonfinite": nonfinite, "stop": stats[7].item() > 0}

    def train_step(self, batches: Optional[Iterator[dict]], stop: bool = False, inject_nan: bool = False) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``batches``
        (dicts with input_ids, attention_mask, token_type_ids, labels; only read where
        ``reads_data``). ``stop``: this rank's stop request (any rank's stops all)."""
        # [loss sum, micro-batches, correct, predicted, tokens, samples, non-finite, stop requested]
        stats = torch.zeros(8, dtype=torch.float64)
        stats[7] = 1.0 if stop else 0.0
        if self.pipeline:
            self._pipeline_train(batches, stats, inject_nan)
            return self._finish(stats)
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        engine.train()
        for i in range(gas):
            batch = next(batches)
            out = engine(**_on(batch, engine.device))
            loss = out.loss * float("nan") if inject_nan else out.loss
            finite = bool(torch.isfinite(loss.detach()).item())
            _count(stats, loss.item(), finite, float(out.accuracy) * int(out.num_predicted), int(out.num_predicted))
            stats[4] += int(batch["attention_mask"].sum())
            stats[5] += batch["input_ids"].shape[0]
            engine.backward(loss)
            if i < gas - 1:
                engine.step()
        nonfinite = torch.tensor([stats[6].item()], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(nonfinite)
        if nonfinite.item() > 0 and self.cfg.deepspeed.zero_stage == 0:
            # ZeRO 1-3 detect the non-finite gradients themselves and skip; stage 0 does not.
            for p in engine.module.parameters():
                p.grad = None
        engine.step()
        return self._finish(stats)

    def _pipeline_train(self, batches, stats: torch.Tensor, inject_nan: bool) -> None:
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        data = None
        if self.dims.is_first_stage:
            items = []
            for _ in range(gas):
                b = next(batches)
                stats[4] += int(b["attention_mask"].sum())
                stats[5] += b["input_ids"].shape[0]
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
                _count(stats, loss, loss == loss and abs(loss) != float("inf"), correct, k)

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
        """New curriculum stage: micro-batch and accumulation (and the pipeline's activation shapes)."""
        mbs = micro_batch_size(self.cfg, stage, world_size)
        self.engine.set_train_micro_batch_size(mbs)
        self.engine.set_train_batch_size(stage.global_batch_size)
        if self.pipeline:
            self.engine.micro_batch_size = mbs
            self.engine.reset_activation_shape()

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr


def _count(stats: torch.Tensor, loss: float, finite: bool, correct: float, predicted: int) -> None:
    stats[0] += loss if finite else 0.0
    stats[1] += 1
    stats[2] += correct
    stats[3] += predicted
    stats[6] += 0 if finite else 1


def _on(batch: dict, device) -> dict:
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")
    return {k: batch[k].to(device) for k in keys if batch.get(k) is not None}


def _pipe_inputs(batch: dict) -> tuple:
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    tt = batch.get("token_type_ids")
    return (ids, torch.ones_like(ids) if mask is None else mask.long(),
            torch.zeros_like(ids) if tt is None else tt, batch["labels"])
