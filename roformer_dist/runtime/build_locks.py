"""Stale locks of torch's JIT extension builds.

DeepSpeed compiles some of its ops on first use (on CPU, the shared-memory collectives when the process
group starts) under ``TORCH_EXTENSIONS_DIR`` (torch's default: ``~/.cache/torch_extensions/...``). torch
guards each build with a ``lock`` file in the op's directory and *every* later load waits for that file
to go, even when the op is built. A process killed during the build (a SIGKILL, a node lost, a time
limit during the first start-up) leaves the file behind, and every later launch of any run on that
machine then waits forever, silently. :func:`clear_stale_build_locks` removes such a file once nothing
in its directory has changed for :data:`STALE_AFTER_S` (a build in progress keeps writing its objects
and its log there), and says so.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

STALE_AFTER_S = 15 * 60.0
"""A lock counts as stale when nothing in its build directory changed for this long."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR`` or torch's default."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def clear_stale_build_locks(root: Optional[Path] = None, stale_after_s: float = STALE_AFTER_S,
                            now: Optional[float] = None) -> list[Path]:
    """Remove the ``lock`` files under ``root`` (one level of op directories, or the versioned level below)
    whose build directory has not changed for ``stale_after_s``; returns the ones removed."""
    root = extensions_root() if root is None else Path(root)
    now = time.time() if now is None else now
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            newest = max(p.stat().st_mtime for p in lock.parent.iterdir())
        except (OSError, ValueError):
            continue
        if now - newest < stale_after_s:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue  # another rank removed it first
        except OSError as e:
            log.warning("%s: a stale JIT build lock (nothing changed for %.0f min) that cannot be removed (%s); "
                        "loads of that op wait for it: remove it by hand", lock, (now - newest) / 60, e.strerror)
            continue
        log.warning("removed %s: a JIT build lock left by a build that ended without releasing it (nothing "
                    "changed there for %.0f min); the op is built again if it needs to be", lock, (now - newest) / 60)
        removed.append(lock)
    return removed
