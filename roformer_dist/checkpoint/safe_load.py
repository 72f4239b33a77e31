"""Reading checkpoint files without running code stored in them.

A ``.pt`` file is a zip archive whose ``data.pkl`` is a pickle; a plain ``torch.load`` of it runs
whatever callables the pickle names, so resuming, converting or evaluating a downloaded checkpoint
could run its author's code. Every load of a checkpoint file in roformer-dist instead uses PyTorch's
restricted unpickler (``weights_only=True``), which builds tensors and plain containers only, plus
the few plain-data classes DeepSpeed 0.19 pickles into its own files (:data:`DEEPSPEED_TYPES`: the
loss scaler, the ZeRO stage enum, a parameter's fragment address):

- :func:`load`: one file, by us (trainer states, model states for ``to-hf``, eval and fine-tuning);
- :func:`weights_only_loads`: a block in which DeepSpeed's own loaders (``engine.load_checkpoint`` on
  resume, ``zero_to_fp32``, the universal-format conversion) load the same way: they call
  ``torch.load(..., weights_only=False)``, so ``torch.load`` is wrapped for the block;
- :func:`check_archive`: the resume check's look at a file: a readable zip archive with one
  ``data.pkl`` whose pickle opcodes parse to the end and name no global outside the allowed set;
  nothing is unpickled.

A file that names anything else is refused with a :class:`~roformer_dist.errors.CheckpointError`
naming the file and the global. What still has to be trusted: the values (a forged checkpoint can hold
any weights), and code that DeepSpeed or PyTorch would run on well-formed tensors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional

from roformer_dist.errors import CheckpointError

__all__ = ["DEEPSPEED_TYPES", "load", "weights_only_loads", "check_archive"]

DEEPSPEED_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Plain-data classes DeepSpeed pickles into its checkpoint files, allowed by name."""

# What torch.save's pickles name besides the allowed DeepSpeed classes (checked by check_archive;
# torch.load's restricted unpickler keeps its own, equivalent list).
_TORCH_GLOBALS = re.compile(r"(torch\._utils\._rebuild_\w+|torch\.\w*Storage|torch\.(float|bfloat|half|int|uint|"
                            r"bool|complex|double|long|short|cfloat|cdouble)\w*|torch\.Size|torch\.device|"
                            r"torch\.dtype|torch\._tensor\._rebuild_from_type_v2|torch\.Tensor|"
                            r"torch\.nn\.parameter\.Parameter|collections\.OrderedDict|collections\.defaultdict|"
                            r"builtins\.(set|frozenset|bytearray|complex|slice)|_codecs\.encode|"
                            r"torch\.serialization\._get_layout|torch\.(strided|sparse_\w+))")
_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # how torch names the global it refused


@functools.lru_cache(maxsize=1)
def _deepspeed_classes() -> list:
    import importlib

    out = []
    for dotted in DEEPSPEED_TYPES:
        module, name = dotted.rsplit(".", 1)
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed: that class is simply not allowed
            continue
    return out


def _refused(path: Any, error: Exception) -> CheckpointError:
    m = _WEIGHTS_ONLY_GLOBAL.search(str(error))
    what = f"it pickles {m.group(1)}" if m else str(error).splitlines()[0][:200]
    return CheckpointError(f"{path}: refused: {what}, which is not a tensor, a plain container or an allowed "
                           "DeepSpeed type; checkpoint files are loaded without running code stored in them")


def load(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file with the restricted unpickler; CheckpointError for a file that
    needs more (other errors propagate: the caller names the damage)."""
    import torch  # (in the functions: check_archive, which the launcher uses, needs no torch)

    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block every ``torch.load`` (DeepSpeed's included) uses the restricted unpickler and the
    allowed DeepSpeed types; a refused file is a CheckpointError naming it."""
    import torch

    real = torch.load

    def restricted(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise _refused(f, e) from None

    torch.load = restricted
    try:
        with torch.serialization.safe_globals(_deepspeed_classes()):
            yield
    finally:
        torch.load = real


def _globals(ops) -> Iterator[str]:
    """The ``module.name`` of every GLOBAL / STACK_GLOBAL in a pickle's opcodes."""
    strings: list[str] = []
    for op, arg, _ in ops:
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            yield f"{module}.{name}"
        elif op.name == "STACK_GLOBAL":
            yield ".".join(strings[-2:]) if len(strings) >= 2 else "?"
        if isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
            del strings[:-2]
        elif op.name.startswith(("BINGET", "LONG_BINGET", "GET")):
            strings.append("?")  # a memoised string: the global it forms cannot be told apart, refuse it
            del strings[:-2]


def check_archive(path: str | os.PathLike) -> Optional[str]:
    """Why ``path`` is not a loadable checkpoint archive (damaged, or naming a forbidden global), or None.
    Parses the pickle's opcodes; unpickles nothing."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pickles) != 1:
                return f"{path}: not a PyTorch archive (no data.pkl)"
            data = z.read(pickles[0])  # checks its CRC
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"{path}: unreadable ({type(e).__name__}: {e})"
    allowed = set(DEEPSPEED_TYPES)
    try:
        for name in _globals(pickletools.genops(data)):
            if name not in allowed and not _TORCH_GLOBALS.fullmatch(name):
                return f"{path}: refused: it pickles {name}, which is not a tensor type or an allowed DeepSpeed type"
    except (ValueError, KeyError, IndexError, EOFError) as e:
        return f"{path}: damaged pickle ({e})"
    return None
