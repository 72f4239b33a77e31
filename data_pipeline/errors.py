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
    1  a cluster task failed for a reason that is neither (killed, out of memory, a bug)
    2  usage: bad flags, an output that exists (use --force) or cannot be written
    4  data error: unreadable / empty corpus, damaged or inconsistent shard set, unreachable URL
"""

from __future__ import annotations

__all__ = ["DataError", "UsageError", "TaskError", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_DATA"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # roformer_dist.errors.EXIT_CONFIG
EXIT_DATA = 4   # roformer_dist.errors.EXIT_DATA


class DataError(ValueError):
    """Bad input data: the message names the file (and field) and what was expected."""


class UsageError(ValueError):
    """Bad arguments (not bad data): the message names the flag or path and what to do."""


class TaskError(RuntimeError):
    """A task of a cluster preparation failed (not with one of the errors above); the message holds
    the end of its log."""
