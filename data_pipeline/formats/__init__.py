"""Corpus formats: one module per format, each a :class:`~.base.Reader`, and :data:`FORMATS`, the table
:mod:`data_pipeline.corpus` reads every input through and ``roformer-data --format`` offers (with ``auto``).

Start with :mod:`.base` (the protocol: what a reader recognises in ``auto`` mode, whether a file of it can be
cut into byte ranges for ``--tasks``, how its lines become records, and, for records with gold words, how
they are parsed), then one format: ``txt.py`` (plain text, a document per line or blank-line separated),
``jsonl.py`` (JSON lines), ``pd.py`` (People's Daily tagged text, vectorised).

Adding a format is a module here with a ``READER`` and one line in :data:`FORMATS`; the ``--format``
choices, ``auto`` detection, ``.gz`` (:mod:`data_pipeline.lines`), byte ranges, counts and errors naming
the file and line come with it. Its tests: a corpus of it read and prepared (``tests/test_corpus.py``
registers a format of its own to show how).

May import: :mod:`data_pipeline.lines`, :mod:`data_pipeline.normalization`, :mod:`data_pipeline.errors`;
numpy.
"""

from __future__ import annotations

from . import jsonl, pd, txt
from .base import TEXT, ReadOptions, Reader, WordReader

__all__ = ["FORMATS", "AUTO", "FALLBACK", "TEXT", "ReadOptions", "Reader", "WordReader"]

FORMATS: dict[str, Reader] = {
    "txt": txt.READER,
    "jsonl": jsonl.READER,
    "pd": pd.READER,
}
"""Format name -> its reader; ``auto`` asks them in this order (suffixes first, then the first line)."""

AUTO = "auto"
"""The format that picks one of FORMATS per file (:func:`data_pipeline.corpus.detect_format`)."""
FALLBACK = "txt"
"""What ``auto`` takes a file for when no format recognises it."""
