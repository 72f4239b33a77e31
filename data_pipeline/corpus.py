"""The corpus: input files -> raw records -> normalised :class:`Document` s.

Inputs may be files, directories (every file below them, sorted; a directory written by ``datasets``'
``save_to_disk``, :data:`~data_pipeline.formats.LAYOUTS`, is its data files, in its order) or glob patterns
(:func:`expand_inputs`), and :class:`~data_pipeline.lines.InputRange` s (part of a file, for ``--tasks``).
Each file is read by the reader of its format, from the table :data:`~data_pipeline.formats.FORMATS`
(``txt``: a document per line or blank-line separated; ``jsonl``: JSON lines; ``pd``: People's Daily tagged
text, with gold words; ``parquet``, ``arrow``: a text column, read with pyarrow), chosen per file in ``auto``
mode (:func:`detect_format`: a format's suffixes, then the first non-empty line; else ``txt``). Every
line-based format may be compressed (``.gz``, ``.zst``); a format adds nothing here (see :mod:`.formats`).

Reading (:mod:`.lines`): lines that are not valid UTF-8, and lines longer than ``max_line_bytes`` (default
``MAX_LINE_BYTES``, 1 MiB; ``--max-line-bytes``), are skipped and counted, never read whole (``strict=True``:
a :class:`~data_pipeline.errors.DataError` naming the file and line instead); so is a blank-line separated
document whose lines add up to more. A JSON line nested too deeply for the parser counts as invalid JSON.
:class:`CorpusStats` holds the counts and the warnings: a file that looks binary (NUL bytes, or more than
10% of its lines not UTF-8) and a corpus of which more than 1% of the lines were skipped. A file that
cannot be read (a truncated or damaged ``.gz`` / ``.zst`` / Parquet / Arrow file, an I/O error) is a DataError
naming it; :func:`check_inputs` opens every input before any expensive work.

Normalisation (:mod:`.normalization`), applied to every document: NFKC (full-width ASCII to half-width, the
ideographic space to a space), control and format characters removed, whitespace collapsed to one space and
stripped. Documents that are empty after normalisation are skipped and counted.

Two ways through: :func:`read_documents` (one :class:`Document` at a time: tokenizer training, tests) and
:func:`iter_record_chunks` + :func:`normalize_records` (chunks of raw records normalised in one go, in the
shard builder's workers). Both give the same documents.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

from .errors import DataError, UsageError
from .formats import AUTO, FALLBACK, FORMATS, LAYOUTS, TEXT, ReadOptions, WordReader
from .formats.pd import pd_documents_batch
from .formats.pd import pd_words as _pd_words  # noqa: F401 - tests and bench/shards.py import it from here
from .lines import (BLOCK_BYTES, MAX_LINE_BYTES, READ_ERRORS, CorpusStats, InputRange, Lines, base_suffix,
                    bounded_lines, compressed, open_input, read_line, reason)
from .normalization import _normalize_joined  # noqa: F401 - tests import it from here
from .normalization import normalize, normalize_batch, normalize_words, normalize_words_batch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Document", "CorpusStats", "InputRange", "normalize", "normalize_words", "expand_inputs", "check_inputs",
           "splittable",
           "read_documents", "iter_records", "iter_record_chunks", "CHUNK_RECORDS", "to_document",
           "normalize_records", "normalize_batch",
           "normalize_words_batch", "pd_documents_batch", "detect_format", "FORMATS", "MAX_LINE_BYTES", "read_line"]

_BLOCK_BYTES = BLOCK_BYTES
"""The block size files are read in (:class:`~data_pipeline.lines.Lines`); tests make it small."""
CHUNK_RECORDS = 1024
"""Records per chunk of :func:`iter_record_chunks` (the shard builder's unit of work) by default."""


@dataclass
class Document:
    text: str
    """Normalised text."""
    words: "Optional[list[str] | np.ndarray]" = None
    """Gold word segmentation (``"".join(words) == text``) when the source has it. (The shard builder's batches,
    :func:`normalize_records`, carry gold words possibly as their lengths in characters (int64 array), which is
    all the word marks need: no string per word.)"""


def expand_inputs(inputs: Iterable[str | os.PathLike] | str | os.PathLike) -> list[Path]:
    """Files named by paths, directories (recursively, sorted: :func:`_files_below`) and glob patterns
    (InputRange s as they are)."""
    if isinstance(inputs, (str, os.PathLike, InputRange)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        if isinstance(item, InputRange):
            files.append(item)
            continue
        s = str(item)
        p = Path(s)
        if p.is_dir():
            files.extend(_files_below(p))
        elif p.is_file():
            files.append(p)
        elif any(ch in s for ch in "*?["):
            matched = sorted(Path(m) for m in glob.glob(s, recursive=True) if Path(m).is_file())
            if not matched:
                raise DataError(f"input {s!r}: the glob pattern matches no file")
            files.extend(matched)
        else:
            raise DataError(f"input {s!r}: no such file or directory")
    if not files:
        raise DataError(f"input {[str(i) for i in inputs]!r}: no files found")
    return files


def _files_below(top: Path) -> list[Path]:
    """The files below ``top`` (not hidden), sorted; but a directory of one of :data:`~.formats.LAYOUTS` (``top``
    itself or one below it) is its layout's data files, in the layout's order, where its first file sorts."""
    layouts: dict[Path, Optional[list[Path]]] = {}

    def layout(d: Path) -> Optional[list[Path]]:
        if d not in layouts:
            layouts[d] = next((files for files in (find(d) for find in LAYOUTS) if files is not None), None)
        return layouts[d]

    out: list[Path] = []
    done: set[Path] = set()
    for f in sorted(f for f in top.rglob("*") if f.is_file() and not f.name.startswith(".")):
        root = next((top / d for d in reversed(f.relative_to(top).parents) if layout(top / d) is not None), None)
        if root is None:
            out.append(f)
        elif root not in done:
            done.add(root)
            out.extend(layouts[root])
    return out


def check_inputs(inputs) -> list[Path]:
    """The input files, each opened and its first block read (decompressed for ``.gz`` / ``.zst``), so that a
    missing, unreadable or wrongly compressed input fails before any expensive work; DataError naming it."""
    files = expand_inputs(inputs)
    for path in files:
        path = path.path if isinstance(path, InputRange) else path
        try:
            with open_input(path) as f:
                f.read(512)
        except READ_ERRORS as e:
            raise DataError(f"input {path}: cannot be read ({reason(e)})") from None
    return files


def detect_format(path: Path) -> str:
    """The format of a file in ``auto`` mode: the first of FORMATS that claims its suffix (``.gz`` aside), else
    the first that recognises its first non-empty line, else ``txt``."""
    suffix = base_suffix(path)
    for name, reader in FORMATS.items():
        if suffix in reader.suffixes:
            return name
    try:
        with open_input(path) as f:
            for raw in bounded_lines(f, MAX_LINE_BYTES):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    continue
                if line:
                    return next((name for name, reader in FORMATS.items() if reader.looks_like(line)), FALLBACK)
    except READ_ERRORS as e:
        raise DataError(f"input {path}: cannot be read ({reason(e)})") from None
    return FALLBACK


def splittable(path: Path, fmt: str, doc_boundary: str) -> bool:
    """Whether a file can be read in byte ranges (InputRange): uncompressed, one document per line (or Parquet:
    at row groups)."""
    return not compressed(path) and FORMATS[fmt].splittable(ReadOptions(doc_boundary=doc_boundary))


def _word_reader(kind: str) -> WordReader:
    """The reader whose records are of ``kind`` (not TEXT): it parses them."""
    for reader in FORMATS.values():
        if reader.kind == kind:
            return reader
    raise ValueError(f"records of kind {kind!r}: no format of FORMATS reads them")


def to_document(record: tuple[str, str], stats: Optional[CorpusStats] = None) -> Optional[Document]:
    """Parse and normalise one raw record from :func:`iter_records`; None (counted) when empty."""
    kind, raw = record
    stats = stats if stats is not None else CorpusStats()
    if kind == TEXT:
        words, text = None, normalize(raw)
    else:
        words = normalize_words(_word_reader(kind).words(raw))
        text = "".join(words)
    if not text:
        stats.empty_docs += 1
        return None
    stats.docs += 1
    stats.chars += len(text)
    stats.bytes += len(text.encode("utf-8"))
    return Document(text, words)


def normalize_records(kind: str, records: list[str], stats: Optional[CorpusStats] = None, utf8: bool = False
                      ) -> tuple[Sequence[int], list, Optional[list]]:
    """Records of one kind (a chunk of :func:`iter_record_chunks`) normalised in one go: (the indices of those
    that are documents, their texts, their gold words or None). Empty ones are counted in ``stats``; gold words
    may come as their lengths (:meth:`~data_pipeline.formats.WordReader.documents`). ``utf8``: the texts as
    UTF-8 bytes (encoded in one pass: what SentencePiece reads without converting each str), where they have no
    lone surrogate (else as str)."""
    stats = stats if stats is not None else CorpusStats()
    if kind == TEXT:
        texts, words = normalize_batch(records), None
        if "" in texts:
            keep = [i for i, t in enumerate(texts) if t]
            texts = [texts[i] for i in keep]
        else:
            keep = range(len(texts))
    else:
        pairs = _word_reader(kind).documents(records)
        keep = [i for i, (t, _) in enumerate(pairs) if t]
        texts, words = [pairs[i][0] for i in keep], [pairs[i][1] for i in keep]
    stats.empty_docs += len(records) - len(keep)
    stats.docs += len(keep)
    joined = "\n".join(texts)                        # normalised texts hold no newline
    stats.chars += len(joined) - max(len(texts) - 1, 0)
    data = None
    if utf8:
        try:
            data = joined.encode("utf-8")
        except UnicodeEncodeError:
            pass
    if data is None:
        data = joined.encode("utf-8", "surrogatepass")
    elif texts:
        texts = data.split(b"\n")
    stats.bytes += len(data) - max(len(texts) - 1, 0)
    return keep, texts, words


def _file_batches(path: Path | InputRange, fmt: str = "auto", options: ReadOptions = ReadOptions(),
                  stats: Optional[CorpusStats] = None) -> Iterator[tuple[str, list[str]]]:
    """The raw records of one file (or InputRange) in batches ``(kind, records)`` (one kind a file: its reader's),
    records not yet normalised; plain lines come a read block at a time (no per-line work)."""
    stats = stats if stats is not None else CorpusStats()
    start, end = 0, None
    if isinstance(path, InputRange):
        path, start, end = path.path, path.start, path.end
    if fmt != AUTO and fmt not in FORMATS:
        raise UsageError(f"format: expected one of {', '.join((AUTO, *FORMATS))}, got {fmt!r}")
    if fmt == AUTO:
        fmt = detect_format(path)
    if end is not None and not splittable(path, fmt, options.doc_boundary):
        raise UsageError(f"input {path}: a byte range of a compressed file or of blank-line separated documents")
    stats.files += start == 0
    reader = FORMATS[fmt]
    lines = Lines(path, stats, options.strict, start, end, options.max_line_bytes, _BLOCK_BYTES)
    for records in reader.records(lines, options):
        yield reader.kind, records


def read_file(path: Path | InputRange, fmt: str = "auto", options: ReadOptions = ReadOptions(),
              stats: Optional[CorpusStats] = None) -> Iterator[tuple[str, str]]:
    """Raw records ``(kind, text)`` of one file (or InputRange), kind ``text`` or a format's; not yet normalised
    (a line comes without its newline). Lines (and blank-line separated documents) over
    ``options.max_line_bytes`` are skipped (module docstring)."""
    for kind, records in _file_batches(path, fmt, options, stats):
        for record in records:
            yield kind, record


def iter_records(inputs, fmt: str = "auto", options: ReadOptions = ReadOptions(),
                 stats: Optional[CorpusStats] = None) -> Iterator[tuple[str, str]]:
    """Raw records of all inputs in sorted file order; :func:`to_document` finishes them."""
    stats = stats if stats is not None else CorpusStats()
    for path in expand_inputs(inputs):
        yield from read_file(path, fmt, options, stats)


def iter_record_chunks(inputs, fmt: str = "auto", options: ReadOptions = ReadOptions(),
                       stats: Optional[CorpusStats] = None,
                       size: int = CHUNK_RECORDS) -> Iterator[tuple[int, str, list[str]]]:
    """The records of :func:`iter_records` in chunks ``(index of the chunk's first record, kind, records)`` of
    ``size`` records, all of one file (a file's last chunk may be shorter); :func:`normalize_records` finishes
    them (in the shard builder's workers)."""
    stats = stats if stats is not None else CorpusStats()
    first = 0
    for path in expand_inputs(inputs):
        buf: list[str] = []
        for kind, records in _file_batches(path, fmt, options, stats):
            buf += records
            while len(buf) >= size:
                yield first, kind, buf[:size]
                first += size
                del buf[:size]
        if buf:
            yield first, kind, buf
            first += len(buf)


def read_documents(inputs, fmt: str = "auto", options: ReadOptions = ReadOptions(),
                   stats: Optional[CorpusStats] = None, limit: Optional[int] = None) -> Iterator[Document]:
    """Normalised documents from files / directories / globs (see the module docstring)."""
    stats = stats if stats is not None else CorpusStats()
    n = 0
    for record in iter_records(inputs, fmt, options, stats):
        doc = to_document(record, stats)
        if doc is None:
            continue
        yield doc
        n += 1
        if limit is not None and n >= limit:
            return
