"""Reading a run's TensorBoard events back (the writer is :mod:`roformer_dist.observe.metrics`): for model
cards, the demo's summary, benches and tests, which must not depend on the trainer."""

from __future__ import annotations

import os


def read_scalars(tb_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """All scalar events under ``tb_dir``: tag -> [(step, value)], as TensorBoard would show them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
