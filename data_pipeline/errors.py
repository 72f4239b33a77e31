"""The data pipeline's error classes and the exit statuses of ``roformer-data``.

``DataError`` is raised for bad data: a corpus that cannot be read or yields nothing, a shard set
whose manifest, tokenizer or shards are missing, damaged or inconsistent, a URL that cannot be
read. The message names the file or URL (and field) and says what was expected. It subclasses
``ValueError`` so that callers written against plain ``ValueError`` keep working; ``roformer-train``
and ``roformer-data`` turn it into their data-error exit status (see :mod:`roformer_dist.errors`).

``UsageError`` is raised for bad arguments that are not about the data itself: an output that
already holds a shard set (without ``--force``) or cannot be written, an impossible tokenizer
setting, a cluster option that does not fit.

Exit statuses of ``roformer-data`` (the same numbers as :mod:`roformer_dist.errors`)::

    0  done (``inspect --verify``: the shard set is sound)
    1  a cluster task failed for a reason that is neither (killed, out of memory, a bug: traceback)
    2  usage: bad flags, an output that exists (use --force) or cannot be written
    4  data error: unreadable / empty corpus, damaged or inconsistent shard set, unreachable URL
   74  the disk filled up (or the filesystem became read-only) while writing; nothing is left half-written
  130  interrupted (Ctrl-C); an output being built is removed, nothing was written

Every error class of the project carries its exit status (``exit_status``); :func:`run_command` is the
one place that turns them into a one-line message and that status, for every command of the project.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable

__all__ = ["DataError", "UsageError", "TaskError", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_DATA",
           "EXIT_STORAGE", "EXIT_INTERRUPTED", "exit_status", "run_command"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # roformer_dist.errors.EXIT_CONFIG
EXIT_DATA = 4   # roformer_dist.errors.EXIT_DATA
EXIT_STORAGE = 74  # EX_IOERR
EXIT_INTERRUPTED = 130  # 128 + SIGINT

FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""OS errors that only a write can cause: reported as a storage failure (exit 74), never as a bug."""


class DataError(ValueError):
    """Bad input data: the message names the file (and field) and what was expected."""

    exit_status = EXIT_DATA


class UsageError(ValueError):
    """Bad arguments (not bad data): the message names the flag or path and what to do."""

    exit_status = EXIT_USAGE


class TaskError(RuntimeError):
    """A task of a cluster preparation failed (not with one of the errors above); the message holds
    the end of its log."""

    exit_status = EXIT_FAILED


def exit_status(error: BaseException) -> int | None:
    """The exit status of one of our errors (its class's ``exit_status``), of a full disk or a
    read-only filesystem (74); None for anything else (a bug: show the traceback)."""
    status = getattr(type(error), "exit_status", None)
    if isinstance(status, int):
        return status
    if isinstance(error, OSError) and error.errno in FULL_DISK_ERRNOS:
        return EXIT_STORAGE
    return None


def _message(error: BaseException) -> str:
    if isinstance(error, OSError) and getattr(type(error), "exit_status", None) is None:
        where = f" {error.filename}" if error.filename else ""
        return (f"cannot write{where}: {error.strerror or os.strerror(error.errno)} "
                f"({errno.errorcode.get(error.errno, error.errno)})")
    return str(error)


def run_command(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command's body; the command's exit status.

    One of our errors (see :func:`exit_status`) prints ``prog: error: <message>`` on one line and
    returns its status; Ctrl-C prints ``prog: <interrupted>`` and returns 130; anything else propagates
    with its traceback (Python exits 1)."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:
        status = exit_status(e)
        if status is None:
            raise
        print(f"{prog}: error: {_message(e)}", file=sys.stderr, flush=True)
        return status
