"""A DeepSpeed save into host memory: the bytes of every file, written later by someone else.

DeepSpeed writes a checkpoint through its engine's ``checkpoint_engine`` (``save(state_dict, path)``
for the model, optimizer and pipeline-layer files). :func:`capture` swaps in one that serialises each
state dict with ``torch.save`` into memory, with the serialisation the engine's own would use, so the
bytes are those a synchronous save would have written; directories are still created and DeepSpeed's
collectives still run, in the caller's thread. The snapshot is taken when ``save`` is called: the
training step after it may change every parameter without changing what is written.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["capture"]


class _InMemory:
    """Stands in for the engine's checkpoint engine during one save; collects ``(path, bytes)``."""

    def __init__(self, inner):
        self.inner = inner
        self.files: list[tuple[Path, bytes]] = []
        self.name = "roformer_dist.in_memory"
        self._zipfile = getattr(inner, "zipfile_serialization", True)

    def save(self, state_dict, path: str) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf, _use_new_zipfile_serialization=self._zipfile)
        self.files.append((Path(path), buf.getvalue()))

    def makedirs(self, path, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def __getattr__(self, name):  # create, commit, load, is_decoupled, ...: the engine's own
        return getattr(self.inner, name)


@contextmanager
def capture(engine) -> Iterator[list[tuple[Path, bytes]]]:
    """``with capture(engine) as files: engine.save_checkpoint(...)`` -> ``files``: what it would have
    written, in order. The engine's own checkpoint engine is back in place afterwards, also on error."""
    inner = engine.checkpoint_engine
    if inner.is_decoupled():
        raise RuntimeError("an in-memory snapshot needs DeepSpeed's synchronous checkpoint engine")
    stand_in = _InMemory(inner)
    engine.checkpoint_engine = stand_in
    try:
        yield stand_in.files
    finally:
        engine.checkpoint_engine = inner
