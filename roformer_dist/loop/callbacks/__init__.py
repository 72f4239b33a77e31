"""The loop's callbacks: one concern of a run per module, each with a ``build(ctx)`` that returns its callback
(None: off for this run), chosen by :data:`CALLBACKS`.

``heartbeat.py`` (the hang watch), ``faults.py`` (the tests' fault injection), ``rotary.py`` (each stage's
rotary backend, measured at its switch), ``profiler.py`` (the ``torch.profiler`` window), ``recording.py``
(metrics and sinks: step records, scalars, the console line), ``stragglers.py`` (each rank's own times at log
steps), ``spikes.py`` (the loss-spike guard and rollback), ``evaluation.py`` (the held-out sets beside their
baselines), ``checkpointing.py`` (when to save, synchronously or in the background).

A new per-step concern is one module here and one line in :data:`CALLBACKS`
(docs/architecture/changing-things.md).

May import: ``loop.callback``, ``loop.restore``, ``loop.spikes``, ``observe``, ``plan``, ``checkpoint``,
``parallel``, ``nn``, ``runtime``, ``config``, ``errors``, ``data_pipeline``; never ``loop.trainer`` (hooks
are handed the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from roformer_dist.loop.callback import Callback, Callbacks
from roformer_dist.loop.callbacks import (checkpointing, evaluation, faults, heartbeat, profiler, recording, rotary,
                                          spikes, stragglers)
from roformer_dist.runtime.faults import NO_FAULTS, Faults

if TYPE_CHECKING:
    from roformer_dist.launch.resolved import ResolvedRun
    from roformer_dist.runtime.process_group import DistEnv, TorchComm

__all__ = ["BuildContext", "CALLBACKS", "build_callbacks"]


@dataclass(frozen=True)
class BuildContext:
    """What a callback may be built from: the resolved run and this rank's place in it."""
    run: "ResolvedRun"
    env: "DistEnv"
    comm: "TorchComm"
    flops_per_token: Callable[[int, float], float]
    """The model's FLOPs per token at (sequence length, masking rate)."""
    faults: Faults = NO_FAULTS
    on_hang: Callable[[], None] = lambda: None


CALLBACKS: dict[str, Callable[[BuildContext], Optional[Callback]]] = {
    "heartbeat": heartbeat.build,
    "faults": faults.build,
    "rotary": rotary.build,
    "profiler": profiler.build,
    "recording": recording.build,
    "stragglers": stragglers.build,
    "spikes": spikes.build,
    "evaluation": evaluation.build,
    "checkpointing": checkpointing.build,
}
"""Every callback, in the order its hooks are called: the heartbeat and the fault points first (they watch
the others' work); the step's record is filled (``recording``, then ``stragglers``) before it is written and a
spike may roll the run back; a step is evaluated before it is saved."""


def build_callbacks(ctx: BuildContext, table: Optional[dict] = None) -> Callbacks:
    built = {name: make(ctx) for name, make in (CALLBACKS if table is None else table).items()}
    return Callbacks({name: cb for name, cb in built.items() if cb is not None})
