"""Before DeepSpeed, on a GPU: does the curriculum's largest micro-batch fit, as the run will run it?

One forward and backward at the stage whose activations the memory estimate finds largest, on a copy of the
freshly built model in the run's precision (bf16 / fp16 as DeepSpeed will cast it; the model itself, whose
fp32 weights become DeepSpeed's master copy, stays on the host untouched), over a batch the loader would
ship: rows packed with documents of the training sets' mean length (``data.packing: document``) or whole
rows (``cross_document``), planned by the same ``model.batch_plan`` the loader's workers call (so through
flex attention, flash-attn's varlen or the blocks, whichever the run takes), masked at the stage's rate.

The verdict is arithmetic on what was measured: the step's peak over the copy's own weights (activations and
gradients, what the device allocated for the step) plus what DeepSpeed will add and the copy does not hold
(the memory estimate's optimizer state, master weights and buckets: :func:`needed_bytes`) against the device's
memory less :data:`~roformer_dist.launch.memory_estimate.HEADROOM`, as ``--dry-run`` budgets it. A micro-batch
that does not fit (or runs out of memory in the step itself) fails at start-up naming the stage and the largest
micro-batch that would, not hours later when a long stage begins.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from roformer_dist.config import Config, StagePlan
from roformer_dist.errors import ConfigError
from roformer_dist.launch.memory_estimate import HEADROOM, StageMemory, estimate_stage, format_bytes, maskless
from roformer_dist.nn.model import IGNORE_INDEX, batch_plan, document_kernel

__all__ = ["preflight", "worst_stage", "preflight_batch", "run_copy", "Verdict", "needed_bytes", "verdict",
           "mean_document_length"]

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def worst_stage(cfg: Config, stages, world_size: int, device_type: str = "cuda") -> tuple[StagePlan, StageMemory]:
    """The stage whose activations the memory estimate finds largest, with its estimate."""
    estimates = [(plan, estimate_stage(cfg, plan, world_size, device_type, maskless(cfg, device_type)))
                 for plan in stages]
    return max(estimates, key=lambda pe: pe[1].activations)


def mean_document_length(manifests: dict) -> float:
    """Tokens per document over the training sets (their manifests' totals); 0 when they say nothing."""
    docs = sum(int(m.get("num_docs") or 0) for m in manifests.values())
    tokens = sum(int(m.get("num_tokens") or 0) for m in manifests.values())
    return tokens / docs if docs else 0.0


def preflight_batch(cfg: Config, stage: StagePlan, device_type: str, document_length: float) -> dict:
    """One micro-batch of ``stage`` as the loader ships it (host tensors and the plan its workers add), from a
    private generator (the run's random streams are not touched): full rows, [CLS] first; with packed documents
    each row numbers documents of ``document_length`` tokens (the last cut at the row's end) in its mask."""
    B, S = stage.micro_batch_size, stage.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.model.vocab_size, (B, S), generator=g)
    if cfg.data.packing == "document" and document_length > 0:
        doc = 1 + np.arange(S) // max(2, int(round(document_length)))
        mask = torch.from_numpy(np.broadcast_to(doc, (B, S)).copy())
    else:
        mask = torch.ones(B, S, dtype=torch.int64)
    chosen = torch.rand(B, S, generator=g) < stage.mlm_probability
    chosen[:, 0] = False  # [CLS]
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": labels}
    batch.update(batch_plan(cfg.model, device_type)(batch))
    return batch


def run_copy(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` in the run's precision, with the run's activation checkpointing."""
    out = copy.deepcopy(model).to(device=device, dtype=_DTYPES[cfg.deepspeed.precision])
    out.gradient_checkpointing = cfg.deepspeed.activation_checkpointing
    return out.train()


def forward_backward(model: torch.nn.Module, batch: dict, device: torch.device) -> None:
    """One training step's forward and backward of ``batch`` (what the runner moves to the device)."""
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels", "layout", "predicted")
    model(**{k: batch[k].to(device) for k in keys if batch.get(k) is not None}).loss.backward()


def needed_bytes(step_peak: int, estimate: StageMemory) -> int:
    """The run's peak on a device from a step's measured peak over the copy's weights (``step_peak``: the
    activations and gradients of the stage's micro-batch) and what DeepSpeed adds beside them: its optimizer
    state and master weights (partitioned as the estimate partitions them) and its gradient buckets. The
    copy's gradients are counted where the run keeps only a partition of them: conservative."""
    return step_peak + estimate.weights + estimate.optimizer + estimate.buckets


@dataclass(frozen=True)
class Verdict:
    stage: StagePlan
    step_peak: int
    """Bytes the step allocated over the copy's weights, measured."""
    needed: int
    budget: int
    device_memory: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.budget

    def largest_micro_batch(self) -> int:
        """Scaling the measured step linearly in the micro-batch: the largest that stays within the budget."""
        per_sample = self.step_peak / self.stage.micro_batch_size
        return max(0, int((self.budget - (self.needed - self.step_peak)) // per_sample)) if per_sample else 0


def verdict(stage: StagePlan, estimate: StageMemory, step_peak: int, device_memory: int) -> Verdict:
    """What the preflight decides for ``stage`` from its measured ``step_peak`` on a device of ``device_memory``
    bytes (see the module docstring)."""
    return Verdict(stage, step_peak, needed_bytes(step_peak, estimate), int(device_memory * (1 - HEADROOM)),
                   device_memory)


def _refusal(v: Verdict, why: str) -> ConfigError:
    fits = v.largest_micro_batch()
    return ConfigError(
        f"curriculum.stages[{v.stage.index}] ({v.stage.name!r}, seq_len {v.stage.seq_len}, micro_batch_size "
        f"{v.stage.micro_batch_size}) does not fit in GPU memory: {why}; set the stage's micro_batch_size to at "
        f"most {fits} (gradient accumulation keeps the global batch), or use a higher ZeRO stage or "
        "deepspeed.activation_checkpointing")


def preflight(model: torch.nn.Module, cfg: Config, stages, manifests: dict, world_size: int,
              local_rank: int) -> Optional[Verdict]:
    """No-op without CUDA (None). Else the verdict of the worst stage; ConfigError when it does not fit."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", local_rank)
    stage, estimate = worst_stage(cfg, stages, world_size)
    batch = preflight_batch(cfg, stage, "cuda", mean_document_length(manifests))
    total = torch.cuda.get_device_properties(device).total_memory
    run = None
    try:
        with torch.cuda.device(device):
            run = run_copy(model, cfg, device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                forward_backward(run, batch, device)
            except torch.cuda.OutOfMemoryError:
                v = verdict(stage, estimate, int(total), int(total))
                raise _refusal(v, f"one forward and backward in {cfg.deepspeed.precision} ran out of the "
                                  f"{format_bytes(total)} the device has") from None
            peak = torch.cuda.max_memory_allocated(device) - base
    finally:
        del run
        torch.cuda.empty_cache()
    v = verdict(stage, estimate, int(peak), int(total))
    layout = batch.get("layout")
    log.info("preflight: stage %r, micro-batch %d x %d in %s (%s, %s): the step took %s over the weights "
             "(estimate %s); with DeepSpeed's states and buckets %s of the %s usable: %s", stage.name,
             stage.micro_batch_size, stage.seq_len, cfg.deepspeed.precision, f"packing {cfg.data.packing}",
             f"{layout.form} rows, document kernel {document_kernel(cfg.model, device)}" if layout is not None
             else "whole rows", format_bytes(peak), format_bytes(estimate.activations + estimate.gradients),
             format_bytes(v.needed), format_bytes(v.budget), "fits" if v.fits else "DOES NOT FIT")
    if not v.fits:
        raise _refusal(v, f"the step took {format_bytes(peak)} measured, with DeepSpeed's states and buckets "
                          f"{format_bytes(v.needed)} of the {format_bytes(v.budget)} usable")
    return v
