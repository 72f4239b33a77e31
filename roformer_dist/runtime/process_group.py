"""The torch.distributed bootstrap shared by training and fine-tuning, and the collectives the
checkpoint layer uses over it.

:class:`DistEnv` reads the rank environment (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR/PORT) set by
whoever started the process (``roformer-train``'s spawner, torchrun, SLURM through the launcher).
:func:`init_process_group` picks the backend (``auto``: nccl with CUDA, gloo without), binds the
local GPU and joins the default group once. :class:`TorchComm` implements the checkpoint layer's
``Comm`` protocol over that group.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from roformer_dist.errors import EnvironmentSetupError
from roformer_dist.runtime.ports import free_port

__all__ = ["DistEnv", "free_port", "resolve_backend", "init_process_group", "TorchComm", "gloo_interface"]

log = logging.getLogger(__name__)


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


def port_in_use(e: BaseException) -> bool:
    """Whether ``e`` is rank 0 failing to listen on MASTER_PORT because another process holds it (EADDRINUSE):
    the process group cannot form, and no other rank died."""
    return isinstance(e, RuntimeError) and "EADDRINUSE" in str(e)


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective or the group's rendezvous failing because another rank died (that death
    is the news, not this)."""
    if port_in_use(e):
        return False
    return isinstance(e, dist.DistNetworkError) or \
        isinstance(e, RuntimeError) and any(text in str(e) for text in _PEER_GONE)


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def gloo_interface(environ, interfaces: list[str]) -> tuple[Optional[str], str]:
    """The interface gloo should use, from ``NCCL_SOCKET_IFNAME`` where ``GLOO_SOCKET_IFNAME`` is unset, and why:
    (name, note) or (None, note; note empty when there is nothing to do). ``interfaces``: this host's, in order.

    Every job on NCCL also runs gloo (the runner's host-side sums, DeepSpeed's CPU collectives). Unset, gloo
    binds to the address the hostname resolves to, which on many SLURM nodes is 127.0.1.1: across nodes its
    group then hangs until the collective timeout. NCCL_SOCKET_IFNAME names prefixes (``ib``, ``eth0,eth1``) or,
    after ``=``, exact names; gloo takes one exact name: the first of this host's that matches. An exclusion
    list (``^docker,lo``) cannot be turned into one name and is left to the user."""
    if environ.get("GLOO_SOCKET_IFNAME") or not environ.get("NCCL_SOCKET_IFNAME"):
        return None, ""
    spec = environ["NCCL_SOCKET_IFNAME"].strip()
    if spec.startswith("^"):
        return None, (f"NCCL_SOCKET_IFNAME={spec} excludes interfaces; set GLOO_SOCKET_IFNAME to the one gloo "
                      "should use (its own group hangs across nodes where the hostname resolves to 127.0.1.1)")
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    matches = [i for i in interfaces if (i in wanted if exact else any(i.startswith(w) for w in wanted))]
    if not matches:
        return None, (f"NCCL_SOCKET_IFNAME={spec} matches none of this host's interfaces "
                      f"({', '.join(interfaces) or 'none'}); GLOO_SOCKET_IFNAME left unset")
    return matches[0], f"GLOO_SOCKET_IFNAME={matches[0]} (from NCCL_SOCKET_IFNAME={spec})"


def _host_interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def init_process_group(env: DistEnv, backend: str = "auto", timeout_s: float = 1800.0) -> str:
    """Join the default process group (once) as ``env``; returns the backend used. ``GLOO_SOCKET_IFNAME`` is set
    from ``NCCL_SOCKET_IFNAME`` where unset (:func:`gloo_interface`), and said."""
    name, note = gloo_interface(os.environ, _host_interfaces())
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    if note:
        (log.info if name is not None else log.warning)("%s", note)
    backend = resolve_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if not port_in_use(e):
                raise
            # (EADDRINUSE stays in the message: port_in_use still tells it from a lost peer)
            raise EnvironmentSetupError(
                f"rank {env.rank}: MASTER_PORT {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} is "
                "held by another process (EADDRINUSE): the process group cannot form. Run the same command again (a "
                "local launch draws another free port); under torchrun or SLURM, another MASTER_PORT") from None
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

    def sum_on(self, sums: torch.Tensor, device: torch.device) -> None:
        """Sum a CPU tensor over all ranks, in place, on ``device`` (NCCL reduces no CPU tensors)."""
        if not self._multi():
            return
        on_device = sums.to(device)
        dist.all_reduce(on_device)
        sums.copy_(on_device.cpu())
