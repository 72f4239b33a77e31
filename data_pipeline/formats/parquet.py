"""``parquet``: Apache Parquet files, the text in a string column (``text_field``, default ``text``). ``auto``
takes ``.parquet`` files for it.

Read with pyarrow (:mod:`.columnar`), that column only, a row group at a time and :data:`~.columnar.BATCH_ROWS`
rows at a time within it: never the whole file in memory. Row groups are what ``--tasks`` cuts a large file
into: a byte range of a Parquet file (:class:`~data_pipeline.lines.InputRange`) holds the row groups whose first
byte (the start of their first column chunk) lies in ``[start, end)``, so consecutive ranges hold every group
once, in order, as consecutive ranges of a text file hold every line once. A ``.parquet.gz`` or
``.parquet.zst`` is refused: Parquet compresses its own pages, and a stream has no row groups to seek to.

A missing column, a value that is not a string (null, a number), a file that is not Parquet or is truncated
(its footer is gone) or damaged (a page) is a DataError naming the file and the row or row group.
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..errors import DataError
from ..lines import Lines, compressed
from .base import TEXT, ReadOptions
from .columnar import BATCH_ROWS, column_of, column_records, import_pyarrow, unreadable

__all__ = ["Parquet", "READER", "row_groups"]


class Parquet:
    help = "Apache Parquet, the text in a string column (--text-field), a row group at a time, auto for .parquet"
    suffixes = (".parquet",)
    kind = TEXT

    def looks_like(self, line: str) -> bool:
        return False

    def splittable(self, options: ReadOptions) -> bool:
        return True                                    # at row groups (the module docstring)

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        path, stats = lines.path, lines.stats
        if compressed(path):
            raise DataError(f"input {path}: a compressed Parquet file; Parquet compresses its own pages: give the "
                            f".parquet file itself")
        pa = import_pyarrow("Parquet", path)
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional, with pyarrow

        try:
            pf = pq.ParquetFile(path)                  # reads the footer (the metadata) only
        except (pa.ArrowException, OSError) as e:
            raise unreadable(path, "as Parquet", e) from None
        try:
            column_of(pf.schema_arrow, path, options)
            for group, first_row in row_groups(pf.metadata, lines.start, lines.end):
                columns = _group_batches(pa, pf, path, group, first_row, options.text_field)
                yield from column_records(pa, columns, path, first_row, options, stats)
        finally:
            pf.close()


def row_groups(meta, start: int = 0, end: Optional[int] = None) -> list[tuple[int, int]]:
    """(index, first row) of the row groups of a Parquet file (its ``FileMetaData``) that start at a byte in
    ``[start, end)`` (the module docstring), in file order."""
    out, first_row = [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        at = min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                 for c in (rg.column(i) for i in range(rg.num_columns)))
        if start <= at and (end is None or at < end):
            out.append((g, first_row))
        first_row += rg.num_rows
    return out


def _group_batches(pa, pf, path, group: int, first_row: int, field: str) -> Iterator:
    """The text column of one row group, BATCH_ROWS rows at a time; DataError naming the group when pyarrow
    cannot read it."""
    rows = pf.metadata.row_group(group).num_rows
    batches = pf.iter_batches(BATCH_ROWS, row_groups=[group], columns=[field], use_threads=False)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise unreadable(path, f"in row group {group} (rows {first_row}-{first_row + rows - 1})", e) from None
        yield batch.column(0)


READER = Parquet()
