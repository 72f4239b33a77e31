"""The rotary backend of each curriculum stage, chosen once on rank 0 and taken by every rank; with
``model.rotary_backend: auto`` measured at the stage's switch, and the measurement written into the stage's
first step record (``rotary_backend``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from roformer_dist.config import Config
from roformer_dist.errors import StorageError
from roformer_dist.loop.callback import Callback, StageRequest, StepDone
from roformer_dist.nn.rotary_tune import RotaryChoices, timings_to_json

if TYPE_CHECKING:
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.trainer import Trainer

__all__ = ["RotaryChoice", "choose_rotary_backend"]


class RotaryChoice(Callback):
    def __init__(self, ctx: "BuildContext"):
        self.cfg, self.rank, self.comm = ctx.run.cfg, ctx.env.rank, ctx.comm
        self.path = ctx.run.run_dir.rotary_choices
        self.choices = RotaryChoices.load(self.path) if self.rank == 0 else None
        self.measured: Optional[dict] = None
        """The last stage switch's measurement, for the next step's record (rank 0)."""

    def pre_stage(self, tr: "Trainer", req: StageRequest) -> None:
        def choose(shape: tuple[int, int, int, int], device: torch.device, compiled: bool) -> str:
            backend, self.measured = choose_rotary_backend(self.cfg, self.choices, self.rank, self.comm, self.path,
                                                           shape, device, compiled)
            return backend
        req.choose_kernel = choose

    def post_step(self, tr: "Trainer", done: StepDone) -> None:
        if self.measured is not None:
            done.notes["rotary_backend"], self.measured = self.measured, None  # measured for this stage (auto)


def build(ctx: "BuildContext") -> RotaryChoice:
    return RotaryChoice(ctx)


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
