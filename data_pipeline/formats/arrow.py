"""``arrow``: Arrow IPC files, as Hugging Face ``datasets`` writes them, the text in a string column
(``text_field``, default ``text``). ``auto`` takes ``.arrow`` files for it, and a directory written by
``Dataset.save_to_disk`` is read as its data files (:func:`saved_dataset_files`: ``state.json`` lists them,
``dataset_info.json`` lies beside it).

Read with pyarrow directly (``datasets`` itself is not needed), a record batch at a time, the batches the file was
written in (``datasets`` writes 1000 rows a batch): never the whole file in memory. Both IPC layouts are read:
the stream (what ``datasets`` writes) and the file (``ARROW1`` magic). Never cut into byte ranges (a stream has
no index of its batches); a dataset saved in several shards (``save_to_disk(num_shards=N)``, or by its
``max_shard_size``) is N files, spread over ``--tasks`` as any files are. A compressed ``.arrow.gz`` /
``.arrow.zst`` is refused.

A missing column, a value that is not a string (null, a number), a file that is not Arrow IPC, truncated or
damaged is a DataError naming the file and the row (:mod:`.columnar`); so is a ``state.json`` that does not
list the dataset's files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

from ..errors import DataError
from ..lines import Lines, compressed
from .base import TEXT, ReadOptions
from .columnar import column_of, column_records, import_pyarrow, unreadable

__all__ = ["ArrowIpc", "READER", "saved_dataset_files"]

STATE, INFO, DATASET_DICT = "state.json", "dataset_info.json", "dataset_dict.json"
"""The files ``save_to_disk`` writes beside the data of a Dataset, and the one of a DatasetDict (its splits)."""
_FILE_MAGIC = b"ARROW1"


class ArrowIpc:
    help = ("Arrow IPC (Hugging Face datasets' save_to_disk directories), the text in a string column "
            "(--text-field), auto for .arrow files and save_to_disk directories")
    suffixes = (".arrow",)
    kind = TEXT

    def looks_like(self, line: str) -> bool:
        return False

    def splittable(self, options: ReadOptions) -> bool:
        return False

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        path, stats = lines.path, lines.stats
        if compressed(path):
            raise DataError(f"input {path}: a compressed Arrow file is not read: give the .arrow file itself")
        pa = import_pyarrow("Arrow", path)
        try:
            source = pa.OSFile(str(path))
        except (pa.ArrowException, OSError) as e:
            raise unreadable(path, "as Arrow IPC", e) from None
        try:
            columns = (b.column(column_of(b.schema, path, options)) for b in _batches(pa, source, path))
            yield from column_records(pa, columns, path, 0, options, stats)
        finally:
            source.close()


def _batches(pa, source, path: Path) -> Iterator:
    """The record batches of an IPC stream or file, one at a time; DataError naming the file and the rows read
    before pyarrow failed."""
    row = 0
    try:
        magic = source.read(len(_FILE_MAGIC))
        source.seek(0)
        if magic == _FILE_MAGIC:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(pa.ipc.open_stream(source))
    except (pa.ArrowException, OSError) as e:
        raise unreadable(path, "as Arrow IPC", e) from None
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise unreadable(path, f"after row {row - 1}" if row else "", e) from None
        row += batch.num_rows
        yield batch


def saved_dataset_files(directory: Path) -> Optional[list[Path]]:
    """The data files of a directory written by ``datasets``' ``Dataset.save_to_disk`` (``state.json``'s
    ``_data_files``, beside ``dataset_info.json``), in their order; None for any other directory. A DatasetDict's
    directory (``dataset_dict.json``, a directory per split) is a DataError asking for one split's."""
    if (directory / DATASET_DICT).is_file():
        try:
            splits = json.loads((directory / DATASET_DICT).read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            splits = []
        example = f", e.g. {directory / str(splits[0])}" if splits else ""
        raise DataError(f"input {directory}: a DatasetDict saved by datasets (splits {splits}): give one split's "
                        f"directory as the input{example}")
    state = directory / STATE
    if not (state.is_file() and (directory / INFO).is_file()):
        return None
    try:
        names = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise DataError(f"{state}: expected the state of a dataset saved by datasets' save_to_disk, with "
                        "'_data_files': [{'filename': ...}, ...]") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            raise DataError(f"{state}: lists {name!r}, which is not a file of {directory}")
    return [directory / name for name in names]


READER = ArrowIpc()
