"""What the loop tells its callbacks, and when: the hooks, and the three small records they are handed.

A callback is one concern of a run (its metrics, its checkpoints, its evaluation, the hang watch...) in a file
of its own under ``loop/callbacks/``. :class:`Callback` lists the hooks, each a no-op; a callback overrides
the ones it needs. The loop (:class:`~roformer_dist.loop.trainer.Trainer`) calls every callback's hook in the
order of the table (``loop/callbacks/__init__.py``), each with the trainer; a callback reads and changes the
run only through the trainer's public names (``tr.state``, ``tr.runner``, ``tr.save()``, ``tr.progress()``...).

The moments, in a run's order::

    run_start
    pre_stage -> (the switch) -> stage_start                    at the first step and each stage boundary
    pre_step(StepRequest) -> (the runner's step) -> post_step(StepDone)
    step_read(StepDone) -> step_recorded(StepDone)              each step, in order, when its statistics are read
    step_end(step, stop)                                        evaluate, then save: after every step
    scalars(step, values), flush                                an eval's scalars; everything to disk
    pre_save -> save(payload) -> before_commit -> post_save     when ``tr.save()`` is called
    progress(point)                                             any long work moving on (a batch, a save)
    pre_rewind ... rewound(step, note)                          the run goes back to an older checkpoint
    on_stop(stop) ... run_end(stop)                             the loop ends
    close                                                       always, also after an error

A callback with state in the checkpoint returns it from :meth:`Callback.state_dict` (fields of
:class:`~roformer_dist.checkpoint.trainer_state.TrainerState`) and takes it back in
:meth:`Callback.load_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    from roformer_dist.checkpoint.trainer_state import TrainerState
    from roformer_dist.loop.policies import Stop
    from roformer_dist.loop.trainer import Trainer
    from roformer_dist.parallel.runner import StepStats
    from roformer_dist.plan.curriculum import StageAt

__all__ = ["Callback", "Callbacks", "StageRequest", "StepRequest", "StepDone"]


@dataclass
class StepRequest:
    """What the runner is asked for one step; ``pre_step`` hooks may set the extras."""
    step: int
    """The 1-based number of the step about to run."""
    stop: bool = False
    """This rank's stop flag."""
    spike_above: Optional[float] = None
    inject_nan: bool = False
    inject_spike: float = 1.0
    delay_s: float = 0.0

    def runner_kwargs(self) -> dict:
        return {"stop": self.stop, "spike_above": self.spike_above, "inject_nan": self.inject_nan,
                "inject_spike": self.inject_spike, "delay_s": self.delay_s}


@dataclass
class StageRequest:
    """A stage switch about to happen; a ``pre_stage`` hook may set ``choose_kernel`` (the rotary backend)."""
    index: int
    choose_kernel: Optional[Callable] = None


@dataclass
class StepDone:
    """A step run, whose device statistics may be unread until the next read (``StepStats.pending``)."""
    step: int
    stats: "StepStats"
    lr: float
    dt: float
    """The runner's share of the host's time for the step (seconds)."""
    at: "StageAt"
    tokens_seen: int
    ended: float
    """When the host finished the step (Unix seconds)."""
    notes: dict = field(default_factory=dict)
    """Fields for the step's record that callbacks add at ``post_step`` (a rotary measurement, a rollback)."""
    waited_s: float = 0.0
    """The read's wait for the device (on the first step of a read)."""
    record: dict = field(default_factory=dict)
    """The step's line in ``metrics.jsonl``, filled at ``step_read``."""
    scalars: Optional[dict] = None
    """At a log step: the scalars for the sinks, filled at ``step_read``; None elsewhere."""


class Callback:
    """One concern of a run; every hook is a no-op. See the module docstring for when each is called."""

    def run_start(self, tr: "Trainer") -> None: ...

    def pre_stage(self, tr: "Trainer", req: StageRequest) -> None: ...

    def stage_start(self, tr: "Trainer", index: int) -> None: ...

    def pre_step(self, tr: "Trainer", req: StepRequest) -> None: ...

    def post_step(self, tr: "Trainer", done: StepDone) -> None: ...

    def step_read(self, tr: "Trainer", done: StepDone) -> None: ...

    def step_recorded(self, tr: "Trainer", done: StepDone) -> None: ...

    def wants_stop(self, tr: "Trainer") -> bool:
        """True: the run cannot go on (``trainer.spike_max``); asked after each step."""
        return False

    def on_stop(self, tr: "Trainer", stop: "Stop") -> None: ...

    def step_end(self, tr: "Trainer", step: int, stop: Optional["Stop"]) -> None: ...

    def pre_save(self, tr: "Trainer") -> None: ...

    def save(self, tr: "Trainer", payload: "TrainerState") -> None: ...

    def before_commit(self, tr: "Trainer", stall_s: float) -> None: ...

    def post_save(self, tr: "Trainer") -> None: ...

    def progress(self, tr: "Trainer", point: str, first_step: bool = False) -> None: ...

    def scalars(self, tr: "Trainer", step: int, values: dict) -> None:
        """Scalars of step ``step`` from a concern other than the step's record (an eval's)."""

    def flush(self, tr: "Trainer") -> None:
        """Everything recorded so far to disk."""

    def pre_rewind(self, tr: "Trainer") -> None: ...

    def rewound(self, tr: "Trainer", step: int, note: dict) -> None: ...

    def run_end(self, tr: "Trainer", stop: "Stop") -> None: ...

    def on_error(self, tr: "Trainer") -> None: ...

    def close(self, tr: "Trainer") -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: "TrainerState") -> None: ...


HOOKS = tuple(name for name in vars(Callback) if not name.startswith("_") and name not in ("wants_stop", "state_dict"))


class Callbacks:
    """The run's callbacks by name, in the table's order; ``callbacks.HOOK(tr, ...)`` calls each one's hook."""

    def __init__(self, named: dict[str, Callback]):
        self.named = dict(named)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.named.values())

    def get(self, name: str) -> Optional[Callback]:
        return self.named.get(name)

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def call(*args, **kwargs) -> None:
            for cb in self.named.values():
                getattr(cb, hook)(*args, **kwargs)
        return call

    def wants_stop(self, tr: "Trainer") -> bool:
        return any(cb.wants_stop(tr) for cb in self.named.values())

    def state_dict(self) -> dict:
        out: dict = {}
        for cb in self.named.values():
            out.update(cb.state_dict())
        return out
