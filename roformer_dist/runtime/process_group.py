"""The torch.distributed bootstrap shared by training and fine-tuning, and the collectives the
checkpoint layer uses over it.

:class:`DistEnv` reads the rank environment (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR/PORT) set by
whoever started the process (``roformer-train``'s spawner, torchrun, SLURM through the launcher).
:func:`init_process_group` picks the backend (``auto``: nccl with CUDA, gloo without), binds the
local GPU and joins the default group once. :class:`TorchComm` implements the checkpoint layer's
``Comm`` protocol over that group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "free_port", "resolve_backend", "init_process_group", "TorchComm"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"this process needs the torch.distributed environment; missing {missing}")
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection was likely closed")
"""How gloo's collectives (and the rendezvous of the process group) fail when another rank has died."""


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective or the group's rendezvous failing because another rank died (that death
    is the news, not this)."""
    return isinstance(e, dist.DistNetworkError) or \
        isinstance(e, RuntimeError) and any(text in str(e) for text in _PEER_GONE)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_process_group(env: DistEnv, backend: str = "auto", timeout_s: float = 1800.0) -> str:
    """Join the default process group (once) as ``env``; returns the backend used."""
    backend = resolve_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return backend


class TorchComm:
    """The checkpoint layer's collectives (``checkpoint.store.Comm``) over the default process group;
    a no-op without one or with one rank."""

    @staticmethod
    def _multi() -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def barrier(self) -> None:
        if self._multi():
            dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        if not self._multi():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self._multi():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
