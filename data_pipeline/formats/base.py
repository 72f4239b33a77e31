"""What a corpus format is: the :class:`Reader` protocol, the options a reader takes, the record kinds.

A reader turns the lines of one input file (:class:`~data_pipeline.lines.Lines`: valid UTF-8, over-long
lines already skipped, ``.gz`` / ``.zst`` already decompressed) into raw records, one per document, not yet
normalised, a batch at a time. A columnar format (``parquet``, ``arrow``) reads ``lines.path`` itself with its
library, counting into ``lines.stats``, and for a byte range (``lines.start``, ``lines.end``) the units of
its file that start there (Parquet's row groups). What the records are decides how they are normalised, by
their *kind*:

- :data:`TEXT`: plain text, normalised by :func:`~data_pipeline.normalization.normalize` (``txt``,
  ``jsonl``, ``parquet``, ``arrow``);
- any other kind: records that carry gold word boundaries (People's Daily's ``word/tag``); the reader of
  that kind parses them (:class:`WordReader`), and the words become whole-word-masking marks.

A reader counts what it skips (empty records, invalid JSON, over-long documents) in ``lines.stats``; with
``options.strict`` it raises a :class:`~data_pipeline.errors.DataError` naming the file and line
(``lines.where``) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol

from ..errors import UsageError
from ..lines import MAX_LINE_BYTES

if TYPE_CHECKING:
    import numpy as np

    from ..lines import Lines

__all__ = ["TEXT", "ReadOptions", "Reader", "WordReader"]

TEXT = "text"
"""The kind of records that are plain text."""


@dataclass(frozen=True)
class ReadOptions:
    """How to read the inputs (``roformer-data``'s corpus flags), handed whole to every format's reader."""
    doc_boundary: str = "line"
    """txt: ``line`` (a document per line) or ``blank`` (documents separated by blank lines)."""
    text_field: str = "text"
    """Where the text is: jsonl, the field holding it; parquet, arrow, the column holding it (``--text-field``)."""
    strict: bool = False
    """Stop at the first invalid line (a DataError naming it) instead of skipping and counting it."""
    max_line_bytes: int = MAX_LINE_BYTES
    """The longest line (or blank-line separated document) read, in bytes without the newline."""

    def __post_init__(self):
        if self.doc_boundary not in ("line", "blank"):
            raise UsageError(f"doc_boundary: expected 'line' or 'blank', got {self.doc_boundary!r}")
        if not isinstance(self.max_line_bytes, int) or self.max_line_bytes < 1:
            raise UsageError(f"max_line_bytes: expected a positive number of bytes, got {self.max_line_bytes!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise UsageError(f"text_field: expected the name of a field or column, got {self.text_field!r}")


class Reader(Protocol):
    """One corpus format."""

    help: str
    """One line for ``roformer-data --format``'s help: what it reads, and how ``auto`` recognises it."""
    suffixes: tuple[str, ...]
    """File name suffixes (lower case, before ``.gz`` / ``.zst``) that make ``auto`` take a file for this format."""
    kind: str
    """The kind of its records: :data:`TEXT`, or its own kind when they carry gold words (a WordReader)."""

    def looks_like(self, line: str) -> bool:
        """``auto``: whether a file whose first non-empty line is ``line`` is of this format (checked after
        the suffixes of every format; a file nothing recognises is ``txt``)."""

    def splittable(self, options: ReadOptions) -> bool:
        """Whether a file of this format can be read in byte ranges (one document per line, so a range of
        whole lines holds whole documents; Parquet: the row groups starting in the range; ``--tasks`` cuts
        large files so). Compressed files never are."""

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        """The raw records of one file (or range), in batches (a batch may be empty)."""


class WordReader(Reader, Protocol):
    """A format whose records carry gold word boundaries."""

    def words(self, record: str) -> list[str]:
        """The words of one raw record, not yet normalised (the document is ``"".join(words)``, once each
        word is normalised by :func:`~data_pipeline.normalization.normalize_words`)."""

    def documents(self, records: list[str]) -> list[tuple[str, list[str] | np.ndarray]]:
        """``(text, words)`` of each raw record, normalised: what ``words`` and ``normalize_words`` give, in
        one go for a batch (the shard builder's hot path); ``words`` may come as the words' lengths in
        characters (int64), which is all the word marks need."""
