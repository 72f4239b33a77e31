"""One engine + step API for every layout (data, tensor x data, pipeline x tensor x data).

    engine, runner = build_parallel_engine(cfg, model, stage_plans(cfg, world_size)[0], world_size)
    loader = ShardLoader(..., dp_rank=runner.dp_rank, dp_size=runner.dp_size)
    torch.manual_seed(cfg.trainer.seed + 1 + runner.seed_offset)    # dropout streams
    stats = runner.train_step(iter(loader), stop=..., inject_nan=...)  # a StepStats

``train_step`` returns a :class:`StepStats` whose statistics are summed over the whole job and identical
on every rank: each is contributed once per data replica (loss and accuracy by the last pipeline stage's
tensor rank 0, tokens and samples by the first stage's). They come in two parts:

- what the host knows (micro-batches, tokens and samples: the loader counted them in its workers, and
  this rank's stop request) is summed at once, every step, by a small all-reduce of host memory (gloo:
  the default group on CPU, a gloo group of its own beside NCCL). So every rank learns at the same step
  that the job stops, and the trainer's counters are exact at every step;
- what the device computed (loss, correct and predicted counts, non-finite micro-batches) stays on the
  device, unread (``StepStats.pending``): a read is a sync, and on a GPU it would drain the launch queue
  every step. :meth:`ParallelRunner.read_stats` sums the pending steps over the job in one all-reduce on
  the device and reads them in one copy; the trainer calls it at log, save and stop steps only.

The one exception is ZeRO-0 without pipeline stages, which has no overflow check of its own: it reads
whether a micro-batch was non-finite before its last ``engine.step()`` (to drop the gradients), every step.

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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from roformer_dist.config import Config, StagePlan
from roformer_dist.errors import CheckpointError
from roformer_dist.nn.model import set_rotary_kernel
from roformer_dist.nn.rotary import model_kernel, set_rope
from roformer_dist.parallel.compiled import StageCompiler, compile_cache_dir, rotary_runs_compiled, splits_documents
from roformer_dist.parallel.snapshot import capture
from roformer_dist.parallel.topology import ParallelDims, check_layout
from roformer_dist.runtime.phases import phase

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
    num_spikes: int = 0
    """Micro-batches whose finite loss was above the spike threshold (``trainer.spike: skip``): update dropped."""
    num_stop_requests: int = 0
    """Ranks that asked to stop (a signal)."""
    pending: Optional[torch.Tensor] = None
    """The device's part (:data:`DEVICE_FIELDS`, float64, this rank's share) while it is unread: then those
    fields are not filled in yet (:meth:`ParallelRunner.read_stats` fills them)."""

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in _FIELDS], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepStats":
        return cls(**_typed(_FIELDS, t.tolist()))

    def filled(self, device_part: list[float]) -> "StepStats":
        """These host fields with the device's part (:data:`DEVICE_FIELDS` order), read."""
        return replace(self, pending=None, **_typed(DEVICE_FIELDS, device_part))

    def add_micro_batch(self, loss: float, correct: float, predicted: int) -> None:
        finite = loss == loss and abs(loss) != float("inf")
        self.loss_sum += loss if finite else 0.0
        self.num_micro_batches += 1
        self.num_correct += correct
        self.num_predicted += predicted
        self.num_nonfinite += 0 if finite else 1

    def keep_only(self, *, loss: bool, data: bool) -> "StepStats":
        """This rank's share: the loss/accuracy fields where it reports them, the data fields likewise."""
        out = replace(self)
        if not loss:
            out.loss_sum, out.num_micro_batches, out.num_correct, out.num_predicted = 0.0, 0, 0.0, 0
            out.num_nonfinite = out.num_spikes = 0
        if not data:
            out.num_tokens, out.num_samples = 0, 0
        return out

    # ------------------------------------------------------------------ what the trainer reads
    def _read(self) -> "StepStats":
        if self.pending is not None:
            raise RuntimeError("the step's device statistics are not read yet (ParallelRunner.read_stats)")
        return self

    @property
    def nonfinite(self) -> bool:
        return self._read().num_nonfinite > 0

    @property
    def skipped(self) -> bool:
        """The update was dropped: a non-finite loss or a spike."""
        return self.nonfinite or self.num_spikes > 0

    @property
    def loss(self) -> float:
        """Mean micro-batch loss; NaN when any was non-finite (the update was skipped)."""
        return float("nan") if self.nonfinite else self.loss_sum / max(1, self.num_micro_batches)

    @property
    def mlm_acc(self) -> float:
        return self._read().num_correct / max(1, self.num_predicted)

    @property
    def stop(self) -> bool:
        return self.num_stop_requests > 0


def build_parallel_engine(cfg: Config, model: torch.nn.Module, stage: StagePlan, world_size: int,
                          load_universal: bool = False, partition_method: str = "type:PipeLayer"):
    """Shard ``model`` (a freshly initialised, identical-on-every-rank ``RoFormerForMaskedLM``) for
    ``cfg.parallel`` and wrap it in DeepSpeed for the first stage's plan (``config.stage_plans`` at
    ``world_size``). Returns ``(engine, runner)``.

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
    engine = build_engine(cfg, module, stage, load_universal, mpu=mpu, extra_config=extra)
    return engine, ParallelRunner(engine, dims, cfg, loss_fn)


class RankTimes:
    """This rank's own seconds since the last :meth:`take`: waiting for its batches, and in its forward passes
    (wall time on the host; on a GPU device time through CUDA events, read at ``take`` after the log step's
    read has synced). With ZeRO 0-2 a forward runs before any collective of its step, so it shows a rank's own
    speed, where a whole step's time is the slowest rank's for every rank (``observe/stragglers.py``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.data = self.forward = 0.0
        self._events: list = []

    def forward_start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_end(self, start) -> None:
        if not self.cuda:
            self.forward += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end))

    def take(self) -> tuple[float, float]:
        """(data wait s, forward s) since the last call; resets them."""
        forward = self.forward + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        out = (self.data, forward)
        self.data = self.forward = 0.0
        self._events.clear()
        return out


class ParallelRunner:
    """The step API of one rank; see the module docstring."""

    def __init__(self, engine, dims: ParallelDims, cfg: Config, loss_fn=None):
        self.engine, self.dims, self.cfg, self.loss_fn = engine, dims, cfg, loss_fn
        self.pipeline = dims.pp_size > 1
        self.host_group = _host_group()
        self.times = RankTimes(engine.device)
        """This rank's data wait and forward time (non-pipeline layouts), for the straggler spread."""
        # trainer.compile: the model compiled per stage (set_stage); config refuses it with pipeline stages
        self.compiler = (StageCompiler(engine.module, compile_cache_dir(cfg), cfg.trainer.compile_mode,
                                       split=splits_documents(cfg)) if cfg.trainer.compile else None)

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

    def _host_sum(self, stats: StepStats) -> StepStats:
        """This rank's share of the host fields (:data:`HOST_FIELDS`), summed over the job: every step, in
        host memory, so no device work is waited for."""
        mine = stats.keep_only(loss=self._reporting("loss"), data=self._reporting("data"))
        t = torch.tensor([getattr(mine, name) for name in HOST_FIELDS], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, group=self.host_group)
        return replace(stats, **_typed(HOST_FIELDS, t.tolist()))

    def read_stats(self, steps: list[StepStats]) -> list[StepStats]:
        """``steps`` with the device's part filled in: summed over the job in one all-reduce on the device,
        then read in one copy (a sync: the trainer calls it at log, save and stop steps). Collective: every
        rank passes its own unread steps of the same step numbers."""
        pending = [s for s in steps if s.pending is not None]
        if not pending:
            return list(steps)
        stacked = torch.stack([s.pending for s in pending])  # (steps, DEVICE_FIELDS) float64, on the device
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stacked)
        values = iter(stacked.cpu().tolist())
        return [s.filled(next(values)) if s.pending is not None else s for s in steps]

    def train_step(self, batches: Optional[Iterator[dict]], stop: bool = False, inject_nan: bool = False,
                   spike_above: Optional[float] = None, inject_spike: float = 1.0, delay_s: float = 0.0) -> StepStats:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``batches``
        (dicts with input_ids, attention_mask, token_type_ids, labels, and what ``model.batch_plan`` adds;
        only read where ``reads_data``). ``stop``: this rank's stop request (any rank's stops all).
        ``spike_above``: a micro-batch loss above it is a spike (``loop/spikes.py``): its gradients become NaN,
        so that the update is dropped as a non-finite one is. ``inject_nan`` / ``inject_spike`` (a factor on
        the loss) / ``delay_s`` (a sleep in the first forward: a slow rank): the tests' faults. The device's
        statistics come back unread (see the module docstring)."""
        stats = StepStats(num_stop_requests=1 if stop else 0)
        if self.pipeline:
            self._pipeline_train(batches, stats, inject_nan)
            # DeepSpeed's pipeline engine hands the loss records to the host: every field is summed at once
            t = stats.keep_only(loss=self._reporting("loss"), data=self._reporting("data")).to_tensor()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(t, group=self.host_group)
            return StepStats.from_tensor(t)
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        engine.train()
        t0 = time.perf_counter()
        micro = []  # one DEVICE_FIELDS tensor per micro-batch, on the device
        times = self.times
        for i in range(gas):
            t_data = time.perf_counter()
            with phase("data"):
                batch = next(batches)
            times.data += time.perf_counter() - t_data
            started = times.forward_start()
            if delay_s and i == 0:
                time.sleep(delay_s)
            with phase("forward"):
                out = engine(**_on(batch, engine.device))
            times.forward_end(started)
            loss = out.loss * float("nan") if inject_nan else out.loss
            if inject_spike != 1:
                loss = loss * inject_spike
            stats.num_tokens += _num_tokens(batch)
            stats.num_samples += batch["input_ids"].shape[0]
            stats.num_micro_batches += 1
            spiked = None if spike_above is None else loss.detach() > spike_above
            micro.append(_micro_batch_stats(loss.detach(), out.accuracy, out.num_predicted, spiked))
            # a constant factor (no gradient through the choice): 1 keeps the gradients exact, NaN drops the update
            with phase("backward"):
                engine.backward(loss if spiked is None else loss * torch.where(spiked, float("nan"), 1.0))
            if i == 0 and self.compiler is not None:
                self.compiler.first_step_done(time.perf_counter() - t0)  # no-op after a stage's first
            if i < gas - 1:
                with phase("optimizer"):
                    engine.step()
        pending = torch.stack(micro).sum(0)
        if not self._reporting("loss"):
            pending = torch.zeros_like(pending)
        stats = self._host_sum(replace(stats, pending=pending))
        if self.cfg.deepspeed.zero_stage == 0:
            # ZeRO 1-3 detect non-finite gradients themselves and skip the update; stage 0 must be told
            stats = self.read_stats([stats])[0]
            if stats.skipped:
                for p in engine.module.parameters():
                    p.grad = None
        with phase("optimizer"):
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

    def set_stage(self, stage: StagePlan,
                  choose_kernel: Optional[Callable[[tuple[int, int, int, int], torch.device, bool], str]] = None
                  ) -> None:
        """New curriculum stage (its plan): micro-batch and accumulation (and the pipeline's activation shapes),
        the stage's rotary settings (they may differ from the model's) and its rotary
        kernel, all before the stage's first forward (and its compilation). ``choose_kernel``: the rotary
        backend for the stage's (micro-batch, S, heads per rank, head_dim) on the engine's device, run compiled
        or eagerly as the stage's training steps will run it (``compiled.rotary_runs_compiled``; the trainer's
        measured choice for ``auto``); None: ``model.rotary_backend`` as configured."""
        set_rope(self.engine, stage.rope, self.cfg.model.max_position_embeddings)
        mbs = stage.micro_batch_size
        self._set_rotary_kernel(mbs, stage.seq_len, choose_kernel)
        self.engine.set_train_micro_batch_size(mbs)
        self.engine.set_train_batch_size(stage.global_batch_size)
        if self.pipeline:
            self.engine.micro_batch_size = mbs
            self.engine.reset_activation_shape()
        if self.compiler is not None:
            self.compiler.compile_stage(stage.name, stage.seq_len, mbs)

    def _set_rotary_kernel(self, mbs: int, seq_len: int, choose_kernel) -> None:
        m = self.cfg.model
        if m.position_embedding != "rotary":
            return
        heads = m.num_attention_heads // self.dims.tp_size
        shape = (mbs, seq_len, heads, m.hidden_size // m.num_attention_heads)
        backend = (choose_kernel(shape, self.engine.device, rotary_runs_compiled(self.cfg)) if choose_kernel is not None
                   else m.rotary_backend)
        set_rotary_kernel(self.engine.module, model_kernel(backend, self.engine.device))

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


_FIELDS = tuple(f.name for f in fields(StepStats) if f.name != "pending")
DEVICE_FIELDS = ("loss_sum", "num_correct", "num_predicted", "num_nonfinite", "num_spikes")
"""The statistics the device computes (read at log, save and stop steps)."""
HOST_FIELDS = tuple(name for name in _FIELDS if name not in DEVICE_FIELDS)
"""The statistics the host knows at once (summed every step)."""
_INT_FIELDS = frozenset(f.name for f in fields(StepStats) if f.type in (int, "int"))


def _typed(names, values) -> dict:
    return {n: int(round(v)) if n in _INT_FIELDS else v for n, v in zip(names, values)}


def _host_group():
    """The group of the host-side sums: the default group when it is gloo, else a gloo group of its own
    (NCCL reduces only device tensors). Every rank creates it, in the same order (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _micro_batch_stats(loss: torch.Tensor, accuracy: torch.Tensor, num_predicted: torch.Tensor,
                       spiked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The :data:`DEVICE_FIELDS` of one micro-batch as a float64 tensor on the loss's device, computed
    without reading anything back to the host."""
    finite = torch.isfinite(loss)
    k = num_predicted.to(torch.float64)
    spikes = torch.zeros((), dtype=torch.float64, device=loss.device) if spiked is None else spiked.to(torch.float64)
    return torch.stack([torch.where(finite, loss, 0.0).to(torch.float64), accuracy.to(torch.float64) * k, k,
                        (~finite).to(torch.float64), spikes])


def _num_tokens(batch: dict) -> int:
    """Non-padding tokens of a batch: counted by the loader's workers (``model.batch_plan``), else on the
    loader's CPU tensor (never on the device's)."""
    n = batch.get("num_tokens")
    return n if n is not None else int(batch["attention_mask"].count_nonzero())


_DEVICE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels", "layout", "predicted")


def _on(batch: dict, device) -> dict:
    """The model's inputs on ``device``: host -> device copies that do not wait for the device (the
    DataLoader pins them on a GPU: ``non_blocking`` from pinned memory is asynchronous)."""
    return {k: batch[k].to(device, non_blocking=True) for k in _DEVICE_KEYS if batch.get(k) is not None}


def _pipe_inputs(batch: dict) -> tuple:
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    tt = batch.get("token_type_ids")
    return (ids, torch.ones_like(ids) if mask is None else mask.long(),
            torch.zeros_like(ids) if tt is None else tt, batch["labels"])
