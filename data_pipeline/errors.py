"""The data pipeline's error classes and the exit statuses of ``roformer-data``.

``DataError`` is raised for bad data: a corpus that cannot be read or yields nothing, a shard set
whose manifest, tokenizer or shards are missing, damaged or inconsistent, a URL that cannot be
read. The message names the file or URL (and field) and says what was expected. It subclasses
``ValueError`` so that callers written against plain ``ValueError`` keep working; ``roformer-train``
and ``roformer-data`` turn it into their data-error exit status (see :mod:`roformer_dist.errors`).

``UsageError`` is raised for bad arguments that are not about the data itself: an output that
already holds a shard set (without ``--force``) or cannot be written, an impossible tokenizer
setting, a cluster option that does not fit.

Which input or argument: a function that takes several (the training set and the eval set, the model's
vocabulary size, a tokenizer given by its caller) says which one an error is about in a structured
field, a role (:data:`TRAINING_SET`, ...), never in the caller's words: ``DataError(message,
input=TRAINING_SET, field="vocab_size")``, ``UsageError(message, argument=TOKENIZER)``. ``str(error)``
is ``"<role>: <message>"``; a caller that has its own name for the role renders it with
:meth:`DataError.naming` (``roformer_dist.plan.data``: ``data.shards``, ``data.sources[0] (news)``,
``model.vocab_size``; ``roformer-data``: ``--tokenizer``, ``--out``). ``field`` is the manifest field
that is wrong, where there is one (also named in the message).

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
from typing import Callable, Optional

__all__ = ["DataError", "UsageError", "TaskError", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_DATA",
           "EXIT_STORAGE", "EXIT_INTERRUPTED", "exit_status", "run_command", "TRAINING_SET", "EVAL_SET",
           "MODEL_VOCAB_SIZE", "TOKENIZER", "OUTPUT"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # roformer_dist.errors.EXIT_CONFIG
EXIT_DATA = 4   # roformer_dist.errors.EXIT_DATA
EXIT_STORAGE = 74  # EX_IOERR
EXIT_INTERRUPTED = 130  # 128 + SIGINT

FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""OS errors that only a write can cause: reported as a storage failure (exit 74), never as a bug."""


# The roles an error may name (``DataError.input``, ``UsageError.argument``); callers render them in their words.
TRAINING_SET = "training set"
"""The shard set a model trains on (:func:`~data_pipeline.manifest.check_training_data`)."""
EVAL_SET = "eval set"
"""The held-out shard set, checked against the training set."""
MODEL_VOCAB_SIZE = "model vocab size"
"""The vocabulary size a model expects, checked against the training set's manifest."""
TOKENIZER = "tokenizer"
"""A tokenizer file (or directory) given by the caller, to be used or imported."""
OUTPUT = "output"
"""Where a new shard set goes."""


def _named(about: Optional[str], message: str) -> str:
    return f"{about}: {message}" if about else message


class DataError(ValueError):
    """Bad input data: the message names the file (and field) and what was expected; ``input``, the role of
    the input it is about when a function takes several; ``field``, the manifest field that is wrong."""

    exit_status = EXIT_DATA

    def __init__(self, message: str = "", *, input: Optional[str] = None, field: Optional[str] = None):  # noqa: A002
        super().__init__(message)
        self.message, self.input, self.field = message, input, field

    def __str__(self) -> str:
        return _named(self.input, self.message)

    def naming(self, input: str) -> "DataError":  # noqa: A002
        """The same error (class, message, field) about ``input``: the caller's name for its role."""
        return _renamed(self, "input", input)


class UsageError(ValueError):
    """Bad arguments (not bad data): the message names the flag or path and what to do; ``argument``, the role
    of the argument it is about where the caller has its own name for it."""

    exit_status = EXIT_USAGE

    def __init__(self, message: str = "", *, argument: Optional[str] = None):
        super().__init__(message)
        self.message, self.argument = message, argument

    def __str__(self) -> str:
        return _named(self.argument, self.message)

    def naming(self, argument: str) -> "UsageError":
        """The same error about ``argument``: the caller's name for its role (a config key, a flag)."""
        return _renamed(self, "argument", argument)


def _renamed(error: BaseException, attribute: str, name: str):
    """A copy of ``error`` (any subclass: no constructor called) with ``attribute`` set to ``name``."""
    out = type(error).__new__(type(error), *error.args)
    out.__dict__.update(error.__dict__)
    setattr(out, attribute, name)
    return out


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
