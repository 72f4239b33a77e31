"""Corpus formats: one module per format, each a :class:`~.base.Reader`, and :data:`FORMATS`, the table
:mod:`data_pipeline.corpus` reads every input through and ``roformer-data --format`` offers (with ``auto``).

Start with :mod:`.base` (the protocol: what a reader recognises in ``auto`` mode, whether a file of it can be
cut into byte ranges for ``--tasks``, how its lines become records, and, for records with gold words, how
they are parsed), then one format: ``txt.py`` (plain text, a document per line or blank-line separated),
``jsonl.py`` (JSON lines), ``pd.py`` (People's Daily tagged text, vectorised); the columnar ones read their
files with pyarrow instead of as lines: ``parquet.py`` (a row group at a time, cut at row groups for
``--tasks``), ``arrow.py`` (Arrow IPC, Hugging Face ``datasets``' ``save_to_disk`` directories), sharing
``columnar.py`` (the text column of a batch of rows, checked).

Adding a format is a module here with a ``READER`` and one line in :data:`FORMATS`; the ``--format``
choices, ``auto`` detection, ``.gz`` and ``.zst`` (:mod:`data_pipeline.lines`), byte ranges, counts and
errors naming the file and line come with it. Its tests: a corpus of it read and prepared
(``tests/test_corpus.py`` registers a format of its own to show how; ``tests/test_columnar_inputs.py`` the
columnar ones). A tool that writes a dataset as a directory of files (``save_to_disk``) adds one line to
:data:`LAYOUTS`.

May import: :mod:`data_pipeline.lines`, :mod:`data_pipeline.normalization`, :mod:`data_pipeline.errors`;
numpy; pyarrow, only inside a columnar reader's functions (an optional package: ``roformer-dist[data]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from . import arrow, jsonl, parquet, pd, txt
from .base import TEXT, ReadOptions, Reader, WordReader

__all__ = ["FORMATS", "LAYOUTS", "AUTO", "FALLBACK", "TEXT", "ReadOptions", "Reader", "WordReader"]

FORMATS: dict[str, Reader] = {
    "txt": txt.READER,
    "jsonl": jsonl.READER,
    "pd": pd.READER,
    "parquet": parquet.READER,
    "arrow": arrow.READER,
}
"""Format name -> its reader; ``auto`` asks them in this order (suffixes first, then the first line)."""

LAYOUTS: tuple[Callable[[Path], Optional[list[Path]]], ...] = (
    arrow.saved_dataset_files,
)
"""Directories a tool writes whole (``datasets``' ``save_to_disk``): each function gives the data files of a
directory of its layout, in their order, or None for any other directory. An input directory of such a layout
(or one below an input directory) is read as those files only (:func:`data_pipeline.corpus.expand_inputs`)."""

AUTO = "auto"
"""The format that picks one of FORMATS per file (:func:`data_pipeline.corpus.detect_format`)."""
FALLBACK = "txt"
"""What ``auto`` takes a file for when no format recognises it."""
