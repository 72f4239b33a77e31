"""Torch's JIT extension builds: the directory they go to, and the locks that killed builds leave.

DeepSpeed compiles some of its ops on first use (on CPU, the shared-memory collectives when the process
group starts) under ``TORCH_EXTENSIONS_DIR``.

*The directory.* torch's default (``~/.cache/torch_extensions/py311_cpu``) is shared by every Python
environment of a user, but a build is not: its ninja file names the environment's include directories,
and ninja of another version does not read the other's logs. Two environments (two checkouts, a
virtualenv and the system Python, a job whose ``PATH`` finds another ninja) then rebuild the op in turn,
each a minute or more of start-up. :func:`use_environment_extensions_dir` gives each environment its own
directory under torch's default when ``TORCH_EXTENSIONS_DIR`` is not set; a set one is used as it is.

*The locks.* torch guards each build with a ``lock`` file in the op's directory, created exclusively and
held open by the building process until it removes it; *every* other load waits for that file to go,
silently, deaf to stop signals, with no end. A process killed during the build (a SIGKILL, a node lost,
a time limit during the first start-up) leaves the file behind. A lock is stale when

- it lies on a filesystem of this machine, belongs to this user, and no process of this machine holds
  it open (its builder is gone); or
- nothing in its build directory changed for :data:`STALE_AFTER_S` (a filesystem shared between
  machines, where a builder elsewhere cannot be seen; a build in progress keeps writing its objects and
  its log there).

:func:`wait_for_build_locks`, called before DeepSpeed loads its ops, removes stale locks (saying so) and
waits for live ones, logging what it waits for, and gives up when the process is asked to stop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

STALE_AFTER_S = 15 * 60.0
"""A lock that cannot be seen to be held counts as stale when nothing in its build directory changed
for this long."""

LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "zfs", "f2fs",
                               "overlay", "bcachefs", "jfs", "reiserfs", "nilfs2"})
"""Filesystem types that no other machine writes to; on any other type (nfs, lustre, gpfs, cifs, fuse,
virtiofs, ...) a lock may belong to a builder on another machine."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR`` or torch's default."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def environment_key() -> str:
    """What a build depends on besides its sources: this Python environment, ninja and the compiler."""
    cxx = os.environ.get("CXX", "c++")
    parts = [sys.prefix, sys.base_prefix, shutil.which("ninja") or "", cxx, shutil.which(cxx) or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def use_environment_extensions_dir() -> Path:
    """``TORCH_EXTENSIONS_DIR`` for this process and its children: the one set, or else a directory of
    this environment's own under torch's default (see the module docstring). Call it before DeepSpeed
    loads an op."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        from torch.utils.cpp_extension import get_default_build_root

        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(get_default_build_root()) / f"roformer-dist-{environment_key()}")
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def _locks(root: Path) -> list[Path]:
    """The ``lock`` files of the op directories under ``root`` (and of the versioned level below)."""
    return [*root.glob("*/lock"), *root.glob("*/*/lock")]


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` lies on (Linux ``/proc/mounts``; "" where unknown)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def lock_holders(lock: Path) -> Optional[list[int]]:
    """The processes of this machine that hold ``lock`` open, or None when that cannot be known (no
    ``/proc``; a process of the lock's owner whose descriptors cannot be read)."""
    try:
        target, owner = os.path.realpath(lock), lock.stat().st_uid
    except OSError:
        return []
    if not Path("/proc/self/fd").is_dir():
        return None
    holders = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != owner:
                continue  # the builder ran as the lock's owner
            fds = list((proc / "fd").iterdir())
        except FileNotFoundError:
            continue  # ended meanwhile
        except PermissionError:
            return None
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(proc.name))
                    break
            except OSError:
                continue
    return holders


def stale_reason(lock: Path, stale_after_s: float = STALE_AFTER_S, now: Optional[float] = None) -> Optional[str]:
    """Why ``lock`` is stale (see the module docstring), or None while it may belong to a live build."""
    now = time.time() if now is None else now
    try:
        owner = lock.stat().st_uid
        newest = max(p.stat().st_mtime for p in lock.parent.iterdir())
    except (OSError, ValueError):
        return None
    if owner == os.getuid() and filesystem_type(lock) in LOCAL_FILESYSTEMS and lock_holders(lock) == []:
        return "no process of this machine holds it: its build ended without releasing it"
    if now - newest >= stale_after_s:
        return f"nothing changed in its build directory for {(now - newest) / 60:.0f} min"
    return None


def clear_stale_build_locks(root: Optional[Path] = None, stale_after_s: float = STALE_AFTER_S,
                            now: Optional[float] = None) -> list[Path]:
    """Remove the stale ``lock`` files under ``root``; returns the ones removed."""
    root = extensions_root() if root is None else Path(root)
    removed = []
    for lock in _locks(root):
        why = stale_reason(lock, stale_after_s, now)
        if why is None:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue  # another rank removed it first, or its builder released it
        except OSError as e:
            log.warning("%s: a stale JIT build lock (%s) that cannot be removed (%s); loads of that op wait for "
                        "it: remove it by hand", lock, why, e.strerror)
            continue
        log.warning("removed %s, a JIT build lock left behind (%s); the op is built again if it needs to be",
                    lock, why)
        removed.append(lock)
    return removed


def wait_for_build_locks(root: Optional[Path] = None, should_stop: Callable[[], bool] = lambda: False,
                         poll_s: float = 0.5, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Remove stale locks under ``root`` and wait until no lock is left; False when ``should_stop()``
    turned true first (the caller ends the launch: torch's own wait would not)."""
    root = extensions_root() if root is None else Path(root)
    announced: set[Path] = set()
    while True:
        clear_stale_build_locks(root, stale_after_s)
        live = [lock for lock in _locks(root) if lock.exists()]
        if not live:
            return True
        if should_stop():
            return False
        for lock in live:
            if lock not in announced:
                announced.add(lock)
                holders = lock_holders(lock)
                log.warning("waiting for %s: a JIT build of that op is in progress (%s); it counts as abandoned "
                            "once nothing changes there for %.0f min", lock,
                            f"process {', '.join(map(str, holders))}" if holders else "on another machine, or by "
                            "a process this one cannot see", stale_after_s / 60)
        time.sleep(poll_s)
