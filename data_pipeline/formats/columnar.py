"""What the columnar formats (``parquet``, ``arrow``) share: pyarrow, imported when a file of theirs is read,
and the texts of one column of a batch of rows, checked the way ``jsonl`` checks its field.

The text is the column named by ``text_field`` (``--text-field``, default ``text``). A file without that
column, a column that does not hold strings (numbers, lists, binary), a null in it, or a file pyarrow cannot
read is a DataError naming the file, the column and the row (rows are counted from 0 in the file, as
``datasets`` and pyarrow index them). A text longer than ``max_line_bytes`` in UTF-8 is skipped and counted
in ``long_lines``, as an over-long line is (``strict``: a DataError naming its row).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import DataError, UsageError
from ..lines import CorpusStats
from .base import ReadOptions

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["BATCH_ROWS", "import_pyarrow", "column_of", "texts", "column_records", "unreadable"]

BATCH_ROWS = 1024
"""Rows read at a time where the format lets the reader choose (Parquet); Arrow streams come in the batches
they were written in (``datasets`` writes 1000 rows a batch)."""


def import_pyarrow(fmt: str, path: Path):
    """The pyarrow module; UsageError naming the format and the ``pip install`` line when it is missing."""
    try:
        import pyarrow as pa  # noqa: PLC0415 - optional: only columnar inputs need it
        import pyarrow.compute  # noqa: F401,PLC0415 - pa.compute, used below
    except ImportError:
        raise UsageError(f"input {path}: reading {fmt} files needs the pyarrow package: pip install pyarrow  "
                         "(or pip install 'roformer-dist[data]')") from None
    return pa


def column_of(schema: pa.Schema, path: Path, options: ReadOptions) -> int:
    """The index of the text column in ``schema``; DataError naming the file and the columns it has."""
    index = schema.get_field_index(options.text_field)
    if index < 0:
        names = schema.names
        raise DataError(f"{path}: no column {options.text_field!r} (set --text-field to the column holding the "
                        f"text); its columns: {names[:20]}{' ...' if len(names) > 20 else ''}")
    return index


def texts(pa, column: pa.Array | pa.ChunkedArray, path: Path, first_row: int, options: ReadOptions,
          stats: CorpusStats) -> list[str]:
    """The texts of ``column``, rows ``first_row ...`` of ``path``: strings, over-long ones left out (and
    counted); DataError naming the row for a value that is not a string (the module docstring)."""
    field = options.text_field
    kind = column.type
    if pa.types.is_dictionary(kind) and _is_string(pa, kind.value_type):
        column, kind = column.dictionary_decode(), kind.value_type
    if not _is_string(pa, kind):
        raise DataError(f"{path}: row {first_row}: column {field!r} holds {kind} values, expected strings (set "
                        "--text-field to the column holding the text)")
    if column.null_count:
        at = first_row + pa.compute.index(column.is_null(), True).as_py()
        raise DataError(f"{path}: row {at}: column {field!r} is null, expected a string")
    sizes = pa.compute.binary_length(column).to_numpy(zero_copy_only=False)
    long = (sizes > options.max_line_bytes).nonzero()[0]
    if len(long):
        if options.strict:
            raise DataError(f"{path}: row {first_row + int(long[0])}: a text of {int(sizes[long[0]])} bytes in "
                            f"column {field!r}, longer than the limit of {options.max_line_bytes} bytes "
                            "(--max-line-bytes; without --strict such texts are skipped)")
        stats.long_lines += len(long)
        stats.max_line_bytes = options.max_line_bytes
        column = column.filter(pa.array(sizes <= options.max_line_bytes))
    try:
        return column.to_pylist()
    except UnicodeDecodeError as e:                    # a writer that did not check its strings
        raise DataError(f"{path}: rows {first_row}-{first_row + len(sizes) - 1}: column {field!r} holds invalid "
                        f"UTF-8 ({e.reason})") from None


def column_records(pa, columns, path: Path, first_row: int, options: ReadOptions,
                   stats: CorpusStats) -> Iterator[list[str]]:
    """The texts of each column of ``columns`` (consecutive pieces of the text column, rows ``first_row ...`` of
    ``path``) as one record list each, every row counted in ``stats.lines``."""
    row = first_row
    for column in columns:
        records = texts(pa, column, path, row, options, stats)
        row += len(column)
        stats.lines += len(column)
        yield records


def unreadable(path: Path, where: str, e: BaseException) -> DataError:
    """The DataError for a file pyarrow failed to read (damaged, truncated, not of the format); ``where``: in
    which part of it (``"after row 99"``), or empty."""
    detail = " ".join(str(e).split()) or "no detail"          # pyarrow's messages may span lines
    return DataError(f"input {path}: cannot be read{' ' + where if where else ''} ({type(e).__name__}: {detail})")


def _is_string(pa, kind) -> bool:
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind))
