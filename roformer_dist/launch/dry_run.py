"""``roformer-train --dry-run`` (and ``roformer-submit --dry-run``): resolve a run as a launch would, write
nothing, and say whether each curriculum stage fits the device's memory.

What it prints: the resume decision (the checkpoint it would resume, a warm start, or a fresh start; a
damaged checkpoint is reported, not marked), the training mixture's shares, each stage's plan, and per
stage the memory one rank needs (:mod:`roformer_dist.launch.memory_estimate`) against the budget: the given
``--gpu-memory``, else the visible GPU's, less :data:`~roformer_dist.launch.memory_estimate.HEADROOM`, with
the largest micro-batch that would fit. A stage that does not fit is a ConfigError naming it and its figures
(exit 2), after the plan is printed.
"""

from __future__ import annotations

from typing import Optional

from roformer_dist.config import Config
from roformer_dist.errors import ConfigError
from roformer_dist.launch.memory_estimate import HEADROOM, StageMemory, estimate_stage, format_bytes, maskless
from roformer_dist.launch.resolved import ResolvedRun, resolve_run

__all__ = ["dry_run", "plan_text", "visible_gpu_memory"]


def visible_gpu_memory() -> Optional[int]:
    """Total memory of the first visible CUDA device (bytes), None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def plan_text(run: ResolvedRun, estimates: list[StageMemory], device: str, gpu_memory: Optional[int]) -> str:
    """The dry run's report: the resolved plan and the memory table."""
    cfg = run.cfg
    lines = [f"dry run of {run.run_dir.root} (nothing written, no lock taken)", run.summary()]
    lines.append("training mixture: " + ", ".join(
        f"{s.name} {sum(s.shares) / max(1, len(s.shares)):.3f}" for s in run.mixture.sources))
    for name, manifest in run.manifests.items():
        shards = manifest.get("shards") or []
        lines.append(f"  source {name}: {len(shards)} shard(s), vocabulary {cfg.model.vocab_size}")
    d, par = cfg.deepspeed, cfg.parallel
    lines.append(f"memory per {'GPU' if device == 'cuda' else 'rank (CPU)'}: {estimates[0].parameters / 1e6:.1f} M "
                 f"parameters on each rank's slice (tensor {par.tensor} x pipeline {par.pipeline}), "
                 f"ZeRO-{d.zero_stage}, {d.precision}, optimizer offload {d.offload_optimizer}, activation checkpointing "
                 f"{'on' if d.activation_checkpointing else 'off'}, packing {cfg.data.packing}")
    budget = None if gpu_memory is None else int(gpu_memory * (1 - HEADROOM))
    if budget is not None:
        lines.append(f"budget: {format_bytes(budget)} of {format_bytes(gpu_memory)} ({HEADROOM:.0%} left for the "
                     "CUDA context, NCCL and the allocator)")
    head = f"  {'stage':<10} {'seq':>5} {'micro':>5} {'weights':>10} {'grads':>10} {'optimizer':>10} " \
           f"{'buckets':>10} {'activations':>12} {'peak':>10}"
    lines.append(head + ("  largest micro-batch that fits" if budget is not None else ""))
    for e in estimates:
        row = (f"  {e.stage:<10} {e.seq_len:>5} {e.micro_batch:>5} {format_bytes(e.weights):>10} "
               f"{format_bytes(e.gradients):>10} {format_bytes(e.optimizer):>10} {format_bytes(e.buckets):>10} "
               f"{format_bytes(e.activations):>12} {format_bytes(e.total):>10}")
        if budget is not None:
            row += f"  {e.largest_micro_batch(budget)}" + ("" if e.total <= budget else "  DOES NOT FIT")
        lines.append(row)
    if budget is None:
        lines.append("no --gpu-memory and no visible GPU: the estimate is not checked against a budget")
    return "\n".join(lines)


def dry_run(cfg: Config, world_size: Optional[int] = None, gpu_memory: Optional[int] = None,
            print_fn=print) -> ResolvedRun:
    """Resolve ``cfg`` read-only, print the plan and the memory table; ConfigError (exit 2) naming the first
    stage that does not fit ``gpu_memory`` (bytes; default: the visible GPU's, if any)."""
    run = resolve_run(cfg, world_size, take_lock=None, read_only=True)
    run.log_notes()
    gpu_memory = visible_gpu_memory() if gpu_memory is None else gpu_memory
    device = "cpu" if gpu_memory is None else "cuda"  # without a GPU budget: the CPU ranks' own estimate
    estimates = [estimate_stage(run.cfg, plan, run.world_size, device, maskless(run.cfg, device))
                 for plan in run.stages]
    print_fn(plan_text(run, estimates, device, gpu_memory))
    if gpu_memory is None:
        return run
    budget = int(gpu_memory * (1 - HEADROOM))
    for plan, e in zip(run.stages, estimates):
        if e.total > budget:
            fits = e.largest_micro_batch(budget)
            advice = (f"set curriculum.stages[{plan.index}].micro_batch_size to at most {fits} (it must divide "
                      f"the per-rank batch)" if fits else
                      "not even one sequence fits: use a higher ZeRO stage, deepspeed.activation_checkpointing, "
                      "tensor or pipeline parallelism, or more memory")
            raise ConfigError(
                f"curriculum.stages[{plan.index}] ({plan.name!r}, seq_len {plan.seq_len}, micro-batch "
                f"{plan.micro_batch_size}): needs about {format_bytes(e.total)} per GPU (states "
                f"{format_bytes(e.states)}, buckets {format_bytes(e.buckets)}, activations "
                f"{format_bytes(e.activations)}), over the {format_bytes(budget)} usable of "
                f"{format_bytes(gpu_memory)}; {advice}")
    return run
