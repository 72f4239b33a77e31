"""``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder reads, for the duration of a DeepSpeed op build.

The variable lists the GPU architectures a CUDA build compiles for. torch reads ``9.0a`` (Hopper's
arch-specific features), ``10.0f`` (a family), ``+PTX`` entries and ``;`` or space separators. DeepSpeed
0.19.8 reads less (``op_builder/builder.py``, ``CUDAOpBuilder.compute_capability_args``): it splits on ``;``
(spaces count as ``;``), sorts the entries by ``int()`` of each dot-separated part before ``+`` and then
keeps ``MAJOR.MINOR`` with an optional ``+PTX`` only, writing that list back for torch. So ``9.0a`` stops a
build with ``ValueError: invalid literal for int() with base 10: '0a'``, on every rank, although the build
it would make is the one for ``9.0``.

:func:`normalize_arch_list` rewrites a value into what DeepSpeed would have built from it had it read it:
the ``a``/``f`` suffix dropped (DeepSpeed's rewrite drops it anyway), ``+PTX`` kept, an architecture listed
twice kept once (with ``+PTX`` if any of its entries had it), one ``;`` between entries. An entry it cannot read
either (``sm_90``, ``Hopper``, ``9``) is left as it is: the build then fails, and the error names the
variable (``parallel.engine.load_op``). :func:`prepare_for_deepspeed` applies it around a DeepSpeed build
and restores the value afterwards, so that anything else this process compiles (an extension that does
need ``9.0a``) reads the value the user set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Iterator, MutableMapping, Optional

__all__ = ["VARIABLE", "normalize_arch_list", "unreadable_entries", "prepare_for_deepspeed"]

log = logging.getLogger(__name__)

VARIABLE = "TORCH_CUDA_ARCH_LIST"

_ENTRY = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?")
"""An entry torch reads as a compute capability: MAJOR.MINOR, an optional arch (a) or family (f) suffix, +PTX."""


def _entries(value: str) -> list[str]:
    """The entries of ``value``: separated by ``;`` or whitespace (torch and DeepSpeed take a space for a ``;``)."""
    return [e for e in re.split(r"[;\s]+", value) if e]


def _parse(entry: str) -> Optional[tuple[int, int, str, bool]]:
    """(major, minor, suffix, +PTX) of an entry, or None where it is no compute capability."""
    m = _ENTRY.fullmatch(entry)
    return None if m is None else (int(m[1]), int(m[2]), m[3], bool(m[4]))


def unreadable_entries(value: str) -> list[str]:
    """The entries of ``value`` that are no compute capability (neither torch's form nor DeepSpeed's)."""
    return [e for e in _entries(value) if _parse(e) is None]


def normalize_arch_list(value: str) -> tuple[str, list[str]]:
    """``(value as DeepSpeed reads it, what changed)``; ``(value, [])`` when DeepSpeed reads it already.

    >>> normalize_arch_list("8.0;8.6;9.0a")
    ('8.0;8.6;9.0', ['9.0a -> 9.0'])
    >>> normalize_arch_list("9.0 9.0+PTX")
    ('9.0+PTX', ['9.0+PTX merged into the earlier 9.0'])
    """
    tokens: list[str] = []       # the new entries, in their order
    kept: dict[tuple[int, int], int] = {}  # (major, minor) -> index into tokens
    changes: list[str] = []
    for entry in _entries(value):
        parsed = _parse(entry)
        if parsed is None:
            tokens.append(entry)  # not ours to guess: the build names the variable when it fails
            continue
        major, minor, suffix, ptx = parsed
        token = f"{major}.{minor}" + ("+PTX" if ptx else "")
        if (major, minor) in kept:
            i = kept[(major, minor)]
            if ptx and not tokens[i].endswith("+PTX"):
                tokens[i] += "+PTX"
            changes.append(f"{entry} merged into the earlier {major}.{minor}")
            continue
        if suffix:
            changes.append(f"{entry} -> {token}")
        kept[(major, minor)] = len(tokens)
        tokens.append(token)
    new = ";".join(tokens)
    if new == value:
        return value, []
    if not changes:  # DeepSpeed's JIT builds read spaces; its other builds and tabs or newlines do not
        changes.append("entries separated by ';'")
    return new, changes


@contextlib.contextmanager
def prepare_for_deepspeed(environ: MutableMapping[str, str] = os.environ) -> Iterator[list[str]]:
    """``TORCH_CUDA_ARCH_LIST`` normalised (:func:`normalize_arch_list`) in ``environ`` for the block, a
    DeepSpeed op build, and logged in one line; as it was afterwards. Yields the changes ([]: none)."""
    value = environ.get(VARIABLE)
    new, changes = normalize_arch_list(value) if value is not None else (value, [])
    if not changes:
        yield []
        return
    log.info("%s=%r read as %r for DeepSpeed's op build (%s): DeepSpeed reads MAJOR.MINOR[+PTX] entries only",
             VARIABLE, value, new, "; ".join(changes))
    environ[VARIABLE] = new
    try:
        yield changes
    finally:
        environ[VARIABLE] = value
