"""``txt``: plain text, one document per line (``doc_boundary="line"``, the default), or documents
separated by blank lines (``doc_boundary="blank"``; the lines of a document are joined with a space, which
normalisation then keeps as a single space). ``auto`` takes a file for ``txt`` when no other format
recognises it.

A blank-line separated document whose lines add up to more than ``max_line_bytes`` is skipped and counted in
``long_lines`` (``strict``: a DataError naming its first line). Such files are never cut into byte ranges.
"""

from __future__ import annotations

from typing import Iterator

from ..errors import DataError
from ..lines import Lines
from .base import TEXT, ReadOptions

__all__ = ["PlainText", "READER"]


class PlainText:
    help = "plain text, a document per line or blank-line separated (--doc-boundary), what auto falls back to"
    suffixes = ()
    kind = TEXT

    def looks_like(self, line: str) -> bool:
        return False

    def splittable(self, options: ReadOptions) -> bool:
        return options.doc_boundary == "line"

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        if options.doc_boundary == "line":
            yield from lines.batches()                 # a line is a record, blank ones too (counted as empty)
            return
        for record in _blank_separated(lines, options):
            yield [record]


def _blank_separated(lines: Lines, options: ReadOptions) -> Iterator[str]:
    """Documents separated by blank lines (see the module docstring)."""
    max_bytes, stats = options.max_line_bytes, lines.stats
    buf: list[str] = []
    size, first, too_long = 0, "", False
    for at, line in lines.numbered():
        if line.strip():
            if not buf and not too_long:
                first = lines.where(at)                 # blank-line documents are never read in ranges
            size += len(line.encode("utf-8", "surrogatepass")) + 1     # and its newline
            if size > max_bytes and not too_long:
                if options.strict:
                    raise DataError(f"{first}: a document (up to the next blank line) longer than the limit of "
                                    f"{max_bytes} bytes (--max-line-bytes; without --strict it is skipped)")
                too_long, buf = True, []
                stats.long_lines += 1
            if not too_long:
                buf.append(line)
        else:
            if buf:
                yield " ".join(buf)
            buf, size, too_long = [], 0, False
    if buf:
        yield " ".join(buf)


READER = PlainText()
