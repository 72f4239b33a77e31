"""Where a run's metrics and text go: a small protocol (:class:`Sink`) and the table of sinks (:data:`SINKS`).

    sinks = open_sinks(("jsonl", "tensorboard"), SinkContext(run_dir, resume_step))
    for s in sinks: s.log_record({"step": 7, "loss": 5.2, ...}); s.log_scalars(7, {"train/loss": 5.2})
    for s in sinks: s.flush()        # before a checkpoint commits: every event so far on disk
    for s in sinks: s.close()

The trainer (``observe.metrics.MetricsWriter``, rank 0) and fine-tuning write through it; ``logging.sinks``
chooses them (``jsonl`` is always on: ``metrics.jsonl`` is the run's record; ``config.effective_sinks``). What each call means:

``log_record(record)``   one optimizer step's record (``step``, ``loss``, ... ; ``metrics.jsonl``'s line)
``log_scalars(step, values)``   named values at a step (``train/loss``, ``eval/loss_512``, ``perf/mfu``...);
                         None values are left out before a sink sees them
``log_text(tag, text, step)``   text (the resolved config, the mixture's table)
``flush()``              everything so far durable: the trainer calls it before a checkpoint commits, so a
                         resume from that checkpoint never lacks an event of its steps
``close()``

A resumed run opens its sinks with the checkpoint's step (``SinkContext.resume_step``): each drops what it
holds after that step (a fresh start, 0, drops everything), so its view equals an uninterrupted run's.

A new sink is one module here with a class taking a :class:`SinkContext` (and a ``read(dir)`` class method
giving back what it wrote, for the tests), plus its name in :data:`SINKS`. A sink whose package is missing
raises ``ConfigError`` naming ``logging.sinks`` and the ``pip install`` line when the config is checked
(:func:`check_sinks`, before any rank trains) and when it is opened.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from roformer_dist.config import LoggingConfig
from roformer_dist.errors import ConfigError
from roformer_dist.observe.sinks.jsonl import JsonlSink
from roformer_dist.observe.sinks.mlflow_sink import MlflowSink
from roformer_dist.observe.sinks.tensorboard import TensorBoardSink
from roformer_dist.observe.sinks.wandb_sink import WandbSink

__all__ = ["Sink", "SinkContext", "SINKS", "check_sinks", "open_sinks"]


@dataclass(frozen=True)
class SinkContext:
    """What a sink is opened with."""

    dir: Path
    """The directory it writes in or under (a run directory; a fine-tuning output directory)."""
    resume_step: int = 0
    """Drop what is held after this step (0: a fresh start, drop everything held)."""
    logging: LoggingConfig = LoggingConfig()
    """The config's logging section: the sinks' own settings (``logging.wandb``, ``logging.mlflow``)."""


class Sink(Protocol):
    def log_record(self, record: dict) -> None: ...

    def log_scalars(self, step: int, values: dict[str, float]) -> None: ...

    def log_text(self, tag: str, text: str, step: int = 0) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


SINKS: dict[str, Callable[[SinkContext], Sink]] = {
    "jsonl": JsonlSink,
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
}
"""``logging.sinks`` name -> the sink's class. A class needing an optional package names it (``package``,
imported in its ``__init__``) and the extra that installs it (``extra``): :func:`check_sinks` looks for it."""

def check_sinks(names: Iterable[str], key: str = "logging.sinks") -> tuple[str, ...]:
    """The names, without repeats; ConfigError naming ``key`` for a name not in :data:`SINKS` or one whose
    package is not installed (looked up, not imported: this runs when the config is read)."""
    names = tuple(dict.fromkeys(names))
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ConfigError(f"{key}: unknown sink(s) {', '.join(map(repr, unknown))}; known: {', '.join(SINKS)}")
    for n in names:
        package = getattr(SINKS[n], "package", None)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}: the {n!r} sink needs the {package} package, which is not installed: "
                              f"pip install 'roformer-dist[{SINKS[n].extra}]'")
    return names


def open_sinks(names: Iterable[str], ctx: SinkContext) -> list[Sink]:
    """One sink per name (checked by :func:`check_sinks`), opened on ``ctx``."""
    return [SINKS[n](ctx) for n in check_sinks(names)]
