"""The data pipeline's error class.

``DataError`` is raised for bad data: a corpus that cannot be read or yields nothing, a shard set
whose manifest, tokenizer or shards are missing, damaged or inconsistent. The message names the
file (and field) and says what was expected. It subclasses ``ValueError`` so that callers written
against plain ``ValueError`` keep working; ``roformer-train`` and ``roformer-data`` turn it into
their data-error exit status (see :mod:`roformer_dist.errors`).
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad input data: the message names the file (and field) and what was expected."""
