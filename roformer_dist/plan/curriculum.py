"""The sequence-length curriculum: a pure schedule (the trainer and the loop policy read it).

Steps are counted from 0: ``step`` is the index of the optimizer step about to
run (equivalently, the number of steps already done). Stage ``i`` covers steps
``[start_i, start_i + stages[i].steps)``.

Learning rate (``lr_at``):
- the global schedule: linear warmup from 0 to ``optim.lr`` over
  ``optim.warmup_steps``, then ``linear`` / ``cosine`` decay to
  ``optim.lr * optim.min_lr_ratio`` at the last step, or ``constant``, or
  ``wsd`` (warmup-stable-decay): ``optim.lr`` held until the last
  :func:`wsd_decay_steps` steps, which decay with ``optim.decay_shape``
  (``linear``, ``cosine``, ``1-sqrt``) to the same floor at the last step
  (the first of them already below the peak);
- a stage that sets its own ``lr`` re-warms up linearly to that value over its
  ``warmup_steps`` and then holds it for the rest of the stage (the paper's
  long stages were run as separate jobs with their own LR; this reproduces that
  without restarting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from roformer_dist.config import OptimConfig, StageConfig, wsd_decay_steps


@dataclass(frozen=True)
class StageAt:
    index: int
    """Position of the stage in the curriculum."""
    stage: StageConfig
    start_step: int
    """First step of the stage."""


def total_steps(stages: tuple[StageConfig, ...]) -> int:
    return sum(s.steps for s in stages)


def stage_at(stages: tuple[StageConfig, ...], step: int) -> StageAt:
    """The stage that step ``step`` (0-based) belongs to."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    start = 0
    for i, st in enumerate(stages):
        if step < start + st.steps:
            return StageAt(i, st, start)
        start += st.steps
    raise ValueError(f"step {step} is past the end of the curriculum ({start} steps)")


def lr_at(optim: OptimConfig, stages: tuple[StageConfig, ...], step: int) -> float:
    """Learning rate of step ``step`` (0-based); pure."""
    at = stage_at(stages, step)
    if at.stage.lr is not None:
        k = step - at.start_step
        warm = at.stage.warmup_steps
        return at.stage.lr * (min(1.0, (k + 1) / warm) if warm > 0 else 1.0)
    peak = optim.lr
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return peak * (step + 1) / optim.warmup_steps
    total = total_steps(stages)
    if optim.schedule == "wsd":
        decay = wsd_decay_steps(optim, total)
        progress = max(0.0, (step - (total - decay) + 1) / decay)
        return SCHEDULES[optim.decay_shape](peak, peak * optim.min_lr_ratio, min(1.0, progress))
    decay_steps = max(1, total - 1 - optim.warmup_steps)
    progress = min(1.0, max(0.0, (step - optim.warmup_steps) / decay_steps))
    return SCHEDULES[optim.schedule](peak, peak * optim.min_lr_ratio, progress)


def schedule_phases(optim: OptimConfig, stages: tuple[StageConfig, ...]) -> list[tuple[str, int, int, int]]:
    """The global schedule's phases as (name, first step, last step, tokens), steps counted from 1 as the log
    counts them, tokens as sequence positions (global batch x seq_len); empty phases left out."""
    total = total_steps(stages)
    warm = min(optim.warmup_steps, total)
    if optim.schedule == "wsd":
        decay = wsd_decay_steps(optim, total)
        bounds = [("warmup", 0, warm), ("stable", warm, total - decay), ("decay", total - decay, total)]
    else:
        bounds = [("warmup", 0, warm), ("constant" if optim.schedule == "constant" else "decay", warm, total)]
    out = []
    for name, lo, hi in bounds:
        if hi > lo:
            tokens = sum(st.global_batch_size * st.seq_len * max(0, min(hi, start + st.steps) - max(lo, start))
                         for st, start in zip(stages, [0, *stage_boundaries(stages)]))
            out.append((name, lo + 1, hi, tokens))
    return out


def describe_schedule(optim: OptimConfig, stages: tuple[StageConfig, ...]) -> str:
    """One log line: the schedule, its phases in steps and tokens, and the stages that set their own lr."""
    shape = f" ({optim.decay_shape} decay)" if optim.schedule == "wsd" else ""
    phases = ", ".join(f"{name} steps {lo}-{hi} ({tokens:,} tokens)" for name, lo, hi, tokens
                       in schedule_phases(optim, stages))
    own = [st.name for st in stages if st.lr is not None]
    return (f"lr schedule {optim.schedule}{shape}, peak {optim.lr:g}, floor {optim.lr * optim.min_lr_ratio:g}: "
            f"{phases}" + (f"; stage(s) {', '.join(own)} set their own lr" if own else ""))


Schedule = Callable[[float, float, float], float]
"""(peak, floor, progress in [0, 1] after the warmup) -> the learning rate."""

SCHEDULES: dict[str, Schedule] = {
    "linear": lambda peak, floor, p: floor + (peak - floor) * (1.0 - p),
    "cosine": lambda peak, floor, p: floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p)),
    "constant": lambda peak, floor, p: peak,
    "1-sqrt": lambda peak, floor, p: floor + (peak - floor) * (1.0 - math.sqrt(p)),
}
"""``optim.schedule`` (and ``optim.decay_shape``) -> its shape after the warmup (``config.LRSchedule`` and
``config.DecayShape`` list the names; ``wsd`` is in :func:`lr_at`)."""


def stage_boundaries(stages: tuple[StageConfig, ...]) -> list[int]:
    """The end step of each stage (where a checkpoint is written)."""
    out, start = [], 0
    for st in stages:
        start += st.steps
        out.append(start)
    return out


def trained_max_len(stages: tuple[StageConfig, ...], step: int) -> int:
    """The longest sequence length of the stages that ran up to ``step`` (0 before the first step)."""
    done, longest = 0, 0
    for st in stages:
        if done >= step:
            break
        longest = max(longest, st.seq_len)
        done += st.steps
    return longest
