"""Atomic file writes: a reader sees the old file or the complete new one, never a part.

Every writer goes through :func:`atomic_write`: the content goes to a hidden temporary file in the
same directory (a name no one can guess, created with ``O_EXCL | O_NOFOLLOW``, so a file or symlink
planted in its place is never written through), which is flushed and ``fsync``-ed, then renamed over
the target with ``os.replace`` (atomic on POSIX filesystems), and the directory is ``fsync``-ed so the rename survives a crash. On
any error the temporary file is removed and the target is left as it was.

Whole directories (a shard set) go through :class:`StagedDir`: built beside their final place and
swapped in when complete.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_dir", "StagedDir", "remove_tree"]


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


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new hidden file beside ``path`` with an unpredictable name, created exclusively and without
    following a symlink. An OS error names ``path``."""
    while True:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from None


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(f)`` on a temporary binary file, then move it to ``path`` atomically."""
    path = Path(path)
    tmp, fd = _create_temporary(path)
    try:
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if (isinstance(e, OSError) and e.errno is not None and e.filename in (None, str(tmp))
                and not hasattr(type(e), "exit_status")):  # a plain OS error: name the target, not the temporary
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from None
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write(path, lambda f: f.write(text.encode(encoding)))


# --------------------------------------------------------------------------- directories


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


class StagedDir:
    """Build a directory beside its final place and swap it in only when it is complete.

    ``StagedDir(out)`` creates ``<parent>/.<name>.partial-<pid>-<n>`` (the same filesystem, so the
    final rename is atomic). :meth:`commit` moves it to ``out``: a missing or empty ``out`` is
    replaced by one rename; an existing one is exchanged with it in one step where the kernel
    can (``renameat2``), else renamed aside first; the old content is then deleted. :meth:`abort`
    removes the staging directory and any parent directories this object created, so a failed
    build leaves nothing behind. Used as a context manager it aborts on any exception (an OS error
    that names no file is re-raised naming ``out``); the caller commits.
    The one directory swap of the project: shard sets, HF exports, fine-tuned models, universal
    checkpoints.
    """

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.created_parents: list[Path] = []
        parent = self.out.parent
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for p in reversed(missing):
            os.mkdir(p)  # OSError (read-only, permission) goes to the caller
            self.created_parents.append(p)
        import itertools

        for n in itertools.count():
            path = self.out.parent / f".{self.out.name}.partial-{os.getpid()}-{n}"
            try:
                os.mkdir(path)
                break
            except FileExistsError:
                continue
            except OSError:
                self._remove_parents()
                raise
        self.path = path
        self.done = False

    def _remove_parents(self) -> None:
        for p in reversed(self.created_parents):
            try:
                p.rmdir()
            except OSError:
                break
        self.created_parents = []

    def commit(self) -> Path:
        """Put the staged directory in place of ``out`` (see the class docstring)."""
        out, stage = self.out, self.path
        for f in stage.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(stage)
        replaced = None
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.rename(stage, out)
        elif _exchange(stage, out):
            replaced = stage          # the old content now lives at the staging path
        else:
            aside = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, aside)
            os.rename(stage, out)
            replaced = aside
        fsync_dir(out.parent)
        if replaced is not None:
            remove_tree(replaced)
        self.done = True
        return out

    def abort(self) -> None:
        if not self.done:
            remove_tree(self.path)
            self._remove_parents()
            self.done = True

    def __enter__(self) -> "StagedDir":
        return self

    def __exit__(self, etype, value, tb) -> None:
        if etype is not None or not self.done:
            self.abort()
        if (isinstance(value, OSError) and value.errno is not None and not value.filename
                and not hasattr(type(value), "exit_status")):  # e.g. a full disk inside a library's writer
            raise OSError(value.errno, value.strerror or os.strerror(value.errno), str(self.out)) from None
