"""Process layout for tensor x pipeline x data parallelism, and the ``mpu`` object DeepSpeed reads.

Rank order (the same as DeepSpeed's ``PipeModelDataParallelTopology``, axes pipe, data, model)::

    rank = pp * (dp_size * tp_size) + dp * tp_size + tp

The tensor rank varies fastest, so a tensor group sits on adjacent ranks (one node, NVLink); the
pipeline rank varies slowest, so pipeline stages can span nodes (only activations cross them).

Groups (every rank creates every group, in the same order, as ``torch.distributed`` requires):
    tensor    same (pp, dp): the Megatron all-reduces of the layers
    data      same (pp, tp): gradient averaging / ZeRO partitioning
    pipe      same (dp, tp): activations between stages
    model     same dp (all pp x tp): what DeepSpeed calls "model parallel" (grad norm, overflow)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

from roformer_dist.config import Config, validate_layout


class Coord(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Degrees of the three kinds of parallelism; ``tensor * pipeline * data`` = world size."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "Layout":
        """The layout of ``cfg.parallel`` at ``world_size`` (``config.validate_layout`` checks it)."""
        validate_layout(cfg, world_size)
        t, p = cfg.parallel.tensor, cfg.parallel.pipeline
        return cls(t, p, world_size // (t * p))

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    def coord(self, rank: int) -> Coord:
        """Global rank -> (pipeline, data, tensor) ranks."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Coord(rank // (self.data * self.tensor), (rank // self.tensor) % self.data, rank % self.tensor)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.data + dp) * self.tensor + tp

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (tensor | data | pipe | model), each a sorted rank list."""
        t, d, p = self.tensor, self.data, self.pipeline
        if axis == "tensor":
            return [[self.rank(a, b, c) for c in range(t)] for a in range(p) for b in range(d)]
        if axis == "data":
            return [[self.rank(a, b, c) for b in range(d)] for a in range(p) for c in range(t)]
        if axis == "pipe":
            return [[self.rank(a, b, c) for a in range(p)] for b in range(d) for c in range(t)]
        if axis == "model":
            return [sorted(self.rank(a, b, c) for a in range(p) for c in range(t)) for b in range(d)]
        raise ValueError(axis)


def check_layout(cfg: Config, world_size: int) -> Layout:
    """``config.validate_layout`` at this world size (every error names its key); returns the layout. The
    rest of the config was validated where the run was resolved."""
    validate_layout(cfg, world_size)
    t, p = cfg.parallel.tensor, cfg.parallel.pipeline
    return Layout(t, p, world_size // (t * p))


class ParallelDims:
    """This rank's coordinates and process groups; also DeepSpeed's ``mpu`` (model-parallel unit).

    Construct it on every rank after ``torch.distributed`` is initialised (it creates groups)."""

    def __init__(self, layout: Layout, rank: int | None = None):
        self.layout = layout
        self.rank = dist.get_rank() if rank is None else rank
        if dist.is_initialized() and dist.get_world_size() != layout.world_size:
            raise ValueError(f"dist.world_size: the job has {dist.get_world_size()} ranks but parallel.tensor x "
                             f"parallel.pipeline x data = {layout.world_size}")
        self.coord = layout.coord(self.rank)
        self.groups: dict[str, object] = {}
        self.group_members: dict[str, list[int]] = {}
        for axis in ("tensor", "data", "pipe", "model"):
            for ranks in layout.group_ranks(axis):
                group = dist.new_group(ranks=ranks) if dist.is_initialized() else None
                if self.rank in ranks:
                    self.groups[axis], self.group_members[axis] = group, ranks

    # ------------------------------------------------------------------ our names
    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def tp_group(self):
        return self.groups["tensor"]

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def dp_size(self) -> int:
        return self.layout.data

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pipeline - 1

    @property
    def replica_seed_offset(self) -> int:
        """Equal on the tensor ranks of one stage (their replicated activations must draw the same
        dropout masks), different across data replicas and stages."""
        return self.coord.dp * self.layout.pipeline + self.coord.pp

    # ------------------------------------------------------------------ DeepSpeed's mpu interface
    def get_data_parallel_rank(self) -> int:
        return self.coord.dp

    def get_data_parallel_world_size(self) -> int:
        return self.layout.data

    def get_data_parallel_group(self):
        return self.groups["data"]

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.group_members["data"]

    def get_model_parallel_rank(self) -> int:
        return self.group_members["model"].index(self.rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.group_members["model"])

    def get_model_parallel_group(self):
        return self.groups["model"]

    def get_tensor_model_parallel_rank(self) -> int:
        return self.coord.tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.layout.tensor

    def get_tensor_model_parallel_group(self):
        return self.groups["tensor"]

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.group_members["tensor"][0]

    def get_pipe_parallel_rank(self) -> int:
        return self.coord.pp

    def get_pipe_parallel_world_size(self) -> int:
        return self.layout.pipeline

    def get_pipe_parallel_group(self):
        return self.groups["pipe"]

    # DeepSpeed's older name for the tensor ("slice") axis
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def __repr__(self) -> str:
        c, lay = self.coord, self.layout
        return (f"ParallelDims(rank {self.rank}: pp {c.pp}/{lay.pipeline}, dp {c.dp}/{lay.data}, "
                f"tp {c.tp}/{lay.tensor})")
