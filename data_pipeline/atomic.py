"""Atomic file writes: a reader sees the old file or the complete new one, never a part.

Every writer goes through :func:`atomic_write`: the content goes to a hidden temporary file in the
same directory, which is flushed and ``fsync``-ed, then renamed over the target with ``os.replace``
(atomic on POSIX filesystems), and the directory is ``fsync``-ed so the rename survives a crash. On
any error the temporary file is removed and the target is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or a new file) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(f)`` on a temporary binary file, then move it to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write(path, lambda f: f.write(text.encode(encoding)))
