"""Find what a piece of code reads back from the device: the ops that make a GPU's host wait.

On a GPU, the host queues kernels and runs ahead; any op whose result the host must see (a value, or
a shape that depends on values) waits until every kernel queued before it has run. One such op per
training step keeps the GPU idle while the host catches up. On a CPU nothing waits, so such ops go
unnoticed there: this recorder finds them on any device.

    with HostReadRecorder() as rec:
        rec.taint(*model.parameters(), *batch_on_device.values())
        ...one training step...
    rec.ours          # [(op, "roformer_dist/nn/model.py:229 in select_predicted"), ...]

What counts: an op that reads a value back to the host (``aten._local_scalar_dense`` -- ``.item()``,
``int()``, ``float()``, ``bool()`` of a tensor --, ``aten.is_nonzero``, ``aten.equal``), an op whose
output shape depends on values (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` by a
tensor, indexing by a boolean mask), and ``Tensor.tolist`` / ``Tensor.numpy`` (no dispatcher op on a CPU tensor, so they are wrapped
while recording) -- each only on a *tainted* tensor: one given to :meth:`HostReadRecorder.taint` (what
lives on the device in a GPU run: the parameters, the batch after its copy to the device) or computed
from one. A value the host made itself (a seed drawn from the CPU generator, a count the loader's
workers shipped) is no wait on a GPU and is not reported.

Each read is attributed to the innermost frame outside torch: :attr:`HostReadRecorder.ours` holds those
in this project (``roformer_dist``, ``data_pipeline``, ``launcher``), :attr:`HostReadRecorder.others`
the rest (DeepSpeed's own, for example).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostReadRecorder", "DeviceSyncRecorder", "HOST_READ_OPS"]

_aten = torch.ops.aten
HOST_READ_OPS = frozenset({
    _aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
    _aten.nonzero.default, _aten.masked_select.default, _aten.unique_consecutive.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.repeat_interleave.Tensor,
})
"""Ops whose result (a value, or an output shape) the host must wait for."""
_INDEXING = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                       _aten._index_put_impl_.default})
"""Indexing ops that wait for the host when an index is a boolean mask (a ``nonzero`` inside the op,
below the dispatcher's view): ``x[mask]``, ``x[mask] = v``."""


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))), pkg) + os.sep
              for pkg in ("roformer_dist", "data_pipeline", "launcher"))


def _caller() -> str:
    """The innermost frame outside torch and this module, as 'path:line in function'."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class HostReadRecorder(TorchDispatchMode):
    """See the module docstring. Records while entered, in this thread."""

    def __init__(self):
        super().__init__()
        self._tainted: set[int] = set()
        """ids of the tainted tensors that are alive (a finalizer drops each id when its tensor goes)."""
        self.reads: list[tuple[str, str]] = []
        """Every host read seen: (op, where)."""
        self._saved: dict = {}

    def taint(self, *tensors: torch.Tensor) -> None:
        """Mark tensors as the device's (their reads, and those of anything computed from them, count)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in self._tainted:
                self._tainted.add(id(t))
                weakref.finalize(t, self._tainted.discard, id(t))

    def taint_all(self, values: Iterable) -> None:
        """:meth:`taint` every tensor in a nested structure (a batch dict, a plan's fields)."""
        leaves, _ = tree_flatten(values)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.taint(leaf)
            elif hasattr(leaf, "__dict__"):
                self.taint_all(list(vars(leaf).values()))

    def _is_tainted(self, values) -> bool:
        leaves, _ = tree_flatten(values)
        return any(isinstance(x, torch.Tensor) and id(x) in self._tainted for x in leaves)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._is_tainted((args, kwargs)):
            if func in HOST_READ_OPS or (func in _INDEXING and _bool_index(args)):
                self.reads.append((str(func), _caller()))
            self.taint(*tree_flatten(out)[0])
        return out

    # Tensor.tolist / Tensor.numpy read a CPU tensor's memory without an op: wrapped while recording
    def _wrap(self, name: str):
        real = getattr(torch.Tensor, name)
        recorder = self

        def wrapper(tensor, *args, **kwargs):
            if id(tensor) in recorder._tainted:
                recorder.reads.append((f"Tensor.{name}", _caller()))
            return real(tensor, *args, **kwargs)

        self._saved[name] = real
        setattr(torch.Tensor, name, wrapper)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        self._saved.clear()
        return super().__exit__(*exc)

    @property
    def ours(self) -> list[tuple[str, str]]:
        """The reads whose innermost caller outside torch is this project's code."""
        return [r for r in self.reads if r[1].startswith(_OURS)]

    @property
    def others(self) -> list[tuple[str, str]]:
        return [r for r in self.reads if not r[1].startswith(_OURS)]


class DeviceSyncRecorder:
    """Records every explicit wait for the device while entered (any thread): ``torch.cuda.synchronize``,
    ``torch.cuda.Stream.synchronize``, ``torch.cuda.Event.synchronize``, ``torch.accelerator.synchronize`` and
    DeepSpeed's ``get_accelerator().synchronize`` (a no-op on its CPU accelerator, so the calls DeepSpeed would
    make on a GPU are seen on any machine). Each call is recorded as (what, where) like
    :class:`HostReadRecorder`'s reads, then made as usual. DeepSpeed's accelerator is patched only when
    DeepSpeed is imported already."""

    _MISSING = object()

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._undo: list = []

    def _patch(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return
        calls = self.calls

        def counted(*args, **kwargs):
            calls.append((label, _caller()))
            return real(*args, **kwargs)

        self._undo.append((owner, name, vars(owner).get(name, self._MISSING)))
        setattr(owner, name, counted)

    def __enter__(self):
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._patch(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
        self._patch(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize")
        if hasattr(torch, "accelerator"):
            self._patch(torch.accelerator, "synchronize", "torch.accelerator.synchronize")
        accelerator = sys.modules.get("deepspeed.accelerator")
        if accelerator is not None:
            self._patch(accelerator.get_accelerator(), "synchronize", "deepspeed get_accelerator().synchronize")
        return self

    def __exit__(self, *exc):
        for owner, name, before in reversed(self._undo):
            if before is self._MISSING:
                delattr(owner, name)  # an instance's attribute: its class's method shows again
            else:
                setattr(owner, name, before)
        self._undo.clear()
        return False

    @property
    def ours(self) -> list[tuple[str, str]]:
        """The waits whose innermost caller outside torch is this project's code."""
        return [c for c in self.calls if c[1].startswith(_OURS)]

    @property
    def others(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if not c[1].startswith(_OURS)]
