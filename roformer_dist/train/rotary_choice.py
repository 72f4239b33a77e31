"""The rotary backend of a curriculum stage, chosen once on rank 0 and taken by every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from roformer_dist.config import Config
from roformer_dist.errors import StorageError
from roformer_dist.nn.rotary_tune import RotaryChoices, timings_to_json

__all__ = ["choose_rotary_backend"]


def choose_rotary_backend(cfg: Config, choices: Optional[RotaryChoices], rank: int, comm, path: Path,
                          shape: tuple[int, int, int, int], device: torch.device,
                          compiled: bool) -> tuple[str, Optional[dict]]:
    """``model.rotary_backend``, or with ``auto`` the fastest measured on rank 0 at ``shape`` (``nn.rotary_tune``;
    ``choices`` is rank 0's table, kept in ``path`` for a resumed run), timed compiled or eagerly as the stage's
    steps run it (``compiled``: ``parallel.compiled.rotary_runs_compiled``). Every rank takes rank 0's choice
    (collective). Returns the backend and, when it was measured now, the measurement for the stage's first
    step record."""
    m = cfg.model
    backend, table = None, None
    if rank == 0:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.deepspeed.precision, torch.float32)
        choice = choices.choose(m.rotary_backend, shape, dtype, device, rotary_value=m.rotary_value,
                                compiled=compiled)
        backend = choice.backend
        if choice.measured:
            table = {"backend": backend, "key": choice.key.to_json(), "timings": timings_to_json(choice.rows)}
            try:
                choices.save(path)
            except OSError as e:
                raise StorageError.from_os_error(e, "recording the rotary backend's measurement") from None
    return comm.broadcast(backend), table
