"""Corpus files as lines: which bytes of which file (:class:`InputRange`), read as valid UTF-8 lines in
blocks (:class:`Lines`), and the counts kept while reading (:class:`CorpusStats`).

Every format reads its files through :class:`Lines` (:mod:`.formats`). A file ending in ``.gz`` is read
through gzip, one ending in ``.zst`` through zstandard (:func:`open_input`, the one place compression is
handled; :data:`COMPRESSIONS`): every line-based format takes them, and they are never cut into byte ranges.
Columnar formats (Parquet, Arrow) read ``Lines.path`` themselves, with pyarrow, and count rows as lines.
Lines that are not valid UTF-8 are skipped and counted (``strict``: a
:class:`~data_pipeline.errors.DataError` naming the file and line instead). A line is never read whole
when it is longer than ``max_line_bytes`` (default :data:`MAX_LINE_BYTES`, 1 MiB, newline excluded): at
most that many bytes of it (plus one read block, :data:`BLOCK_BYTES`: 1 MiB) are held in memory, the
rest is read past in pieces, and the line is skipped and counted (``long_lines``), or, with ``strict``,
is a DataError naming the file and line. A file that looks binary (NUL bytes, or more than 10% of its
lines not UTF-8) gets a warning in :class:`CorpusStats`. A file that cannot be read (a truncated or
damaged ``.gz`` or ``.zst``, an I/O error) is a DataError naming it.
"""

from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .errors import DataError, UsageError

__all__ = ["InputRange", "CorpusStats", "Lines", "LineAt", "MAX_LINE_BYTES", "BLOCK_BYTES", "READ_ERRORS",
           "COMPRESSIONS", "read_line", "bounded_lines", "open_input", "base_suffix", "compressed", "reason"]

BINARY_LINE_FRACTION = 0.10
"""A file with more than this share of lines that are not UTF-8 (or with NUL bytes) looks binary."""
SKIPPED_WARN_FRACTION = 0.01
"""Warn when more than this share of all lines was skipped as invalid."""
MAX_LINE_BYTES = 1 << 20
"""The longest line (or blank-line separated document) read, in bytes without the newline; longer ones are
skipped and counted (``strict``: a DataError). ``max_line_bytes`` / ``--max-line-bytes`` change it."""
_SKIP_CHUNK = 1 << 20
BLOCK_BYTES = 1 << 20
"""Lines are read in blocks of this many bytes (1 MiB), decoded and split a block at a time."""
READ_ERRORS = (OSError, EOFError, zlib.error)
"""What reading a (possibly compressed) input raises when it cannot be read: named as a DataError (damaged
``.zst`` data comes as an OSError, a truncated ``.zst`` as an EOFError: :class:`_ZstdReader`)."""
COMPRESSIONS = (".gz", ".zst")
"""The suffixes of compressed inputs (gzip, zstandard): read decompressed, as a stream, never in byte ranges; the
suffix before them names the format (``a.jsonl.zst`` is JSON lines)."""
ZSTD_PIECE_BYTES = 1 << 12
"""Compressed bytes decompressed at a time from a ``.zst``: 4 KiB, which zstandard's largest ratio (a 4-byte
block of 128 KiB) turns into at most 128 MiB, whatever the file holds."""

LineAt = tuple[int, int]
"""Where a line is, for messages (:meth:`Lines.where`): (its line number, its byte offset in a range)."""


@dataclass(frozen=True)
class InputRange:
    """Part of an uncompressed, line-based input file: the lines that *start* at a byte in
    ``[start, end)`` (so consecutive ranges of a file split it at line boundaries, each line once); of a
    Parquet file, the row groups that start there (:mod:`.formats.parquet`). How cluster preparation
    spreads one large file over several tasks; accepted wherever inputs are."""
    path: Path
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.path}[bytes {self.start}-{self.end})"


@dataclass
class CorpusStats:
    files: int = 0
    docs: int = 0
    chars: int = 0
    bytes: int = 0
    invalid_utf8_lines: int = 0
    empty_docs: int = 0
    invalid_json_lines: int = 0
    lines: int = 0
    """Raw lines (and rows of columnar files) read (all files)."""
    long_lines: int = 0
    """Lines (blank-line separated documents, texts of columnar rows) skipped for being longer than
    ``max_line_bytes``."""
    max_line_bytes: int = MAX_LINE_BYTES
    """The limit they were over (for the warning)."""
    file_warnings: list = field(default_factory=list)
    """One message per file that looks binary."""

    _COUNTS = ("files", "docs", "chars", "bytes", "invalid_utf8_lines", "empty_docs", "invalid_json_lines", "lines",
               "long_lines")

    def add_counts(self, other: "CorpusStats") -> None:
        """Add another's counts and warnings (per-chunk or per-task stats into a total)."""
        for k in self._COUNTS:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.file_warnings += other.file_warnings
        if other.long_lines:
            self.max_line_bytes = other.max_line_bytes

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self._COUNTS}, "max_line_bytes": self.max_line_bytes,
                "file_warnings": list(self.file_warnings)}

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusStats":
        """The stats of :meth:`to_dict` (a count missing from an older file is 0); ValueError when a count is
        not a non-negative integer or a warning not a string."""
        counts = {k: d.get(k, 0) for k in (*cls._COUNTS, "max_line_bytes")}
        counts["max_line_bytes"] = d.get("max_line_bytes", MAX_LINE_BYTES)
        bad = [k for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        warnings = d.get("file_warnings", [])
        if bad or not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
            raise ValueError(f"corpus stats: expected non-negative integer counts and string warnings "
                             f"({', '.join(bad) or 'file_warnings'})")
        return cls(**counts, file_warnings=list(warnings))

    def summary(self) -> str:
        long = f", {self.long_lines} lines over {self.max_line_bytes} bytes" if self.long_lines else ""
        return (f"{self.files} files, {self.docs} documents, {self.chars} characters "
                f"({self.bytes / 1e6:.1f} MB UTF-8); skipped: {self.invalid_utf8_lines} invalid UTF-8 lines, "
                f"{self.empty_docs} empty documents, {self.invalid_json_lines} invalid JSON lines{long}")

    def warnings(self) -> list[str]:
        """Binary-looking files, lines skipped for their length (any), and the share of skipped lines when it
        is over SKIPPED_WARN_FRACTION."""
        out = list(self.file_warnings)
        if self.long_lines:
            out.append(f"{self.long_lines} lines (or blank-line separated documents) longer than "
                       f"{self.max_line_bytes} bytes were skipped, unread (--max-line-bytes raises the limit, "
                       "--strict stops at the first)")
        skipped = self.invalid_utf8_lines + self.invalid_json_lines
        if self.lines and skipped > SKIPPED_WARN_FRACTION * self.lines:
            out.append(f"{skipped} of {self.lines} lines ({100 * skipped / self.lines:.1f}%) were skipped "
                       f"({self.invalid_utf8_lines} not UTF-8, {self.invalid_json_lines} not JSON): is the input "
                       "really text of this format? (--strict stops at the first one)")
        return out



def reason(e: BaseException) -> str:
    """Why an input could not be read, in a few words (one of :data:`READ_ERRORS`)."""
    if "end-of-stream" in str(e):                      # gzip's EOFError
        return "the compressed file ends early: truncated .gz?"
    if isinstance(e, EOFError):
        return str(e) or "the compressed file ends early"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def compressed(path: Path) -> bool:
    """Whether ``path`` is read decompressed (its suffix is one of :data:`COMPRESSIONS`)."""
    return path.suffix in COMPRESSIONS


def open_input(path: Path):
    """``path`` opened for binary reading, decompressed when it is :func:`compressed`; UsageError naming the
    ``pip install`` line when a ``.zst`` input meets an environment without zstandard."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard  # noqa: PLC0415 - optional: only .zst inputs need it
        except ImportError:
            raise UsageError(f"input {path}: reading .zst (zstandard-compressed) files needs the zstandard "
                             "package: pip install zstandard  (or pip install 'roformer-dist[data]')") from None
        return io.BufferedReader(_ZstdReader(path, zstandard), BLOCK_BYTES)
    return open(path, "rb")


def base_suffix(path: Path) -> str:
    """The suffix of ``path`` without a compression suffix, lower case (``a.JSONL.gz`` -> ``.jsonl``)."""
    name = path.stem if compressed(path) else path.name
    return Path(name).suffix.lower()


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file of any number of frames, :data:`ZSTD_PIECE_BYTES` of input at a
    time. zstandard's own ``stream_reader`` takes a file that ends inside a frame for a complete one; this
    reader raises an EOFError there (and an OSError for damaged data), as gzip does."""

    def __init__(self, path: Path, zstandard):
        self._file = open(path, "rb")
        self._zstd = zstandard
        self._frame = None                 # the decompressor of the current frame
        self._next = b""                   # input after the end of a frame: the next frame's start
        self._out, self._at = b"", 0       # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._at == len(self._out):             # a piece may decompress to nothing (a frame's header)
            if not self._decompress():
                return 0
        k = min(len(buf), len(self._out) - self._at)
        buf[:k] = self._out[self._at:self._at + k]
        self._at += k
        return k

    def _decompress(self) -> bool:
        """The next piece of input decompressed into ``_out``; False at the end of the file."""
        data = self._next or self._file.read(ZSTD_PIECE_BYTES)
        self._next = b""
        if not data:
            if self._frame is not None and not self._frame.eof:
                raise EOFError("the compressed file ends inside a zstd frame: truncated .zst?")
            return False
        if self._frame is None or self._frame.eof:
            self._frame = self._zstd.ZstdDecompressor().decompressobj()
        try:
            self._out, self._at = self._frame.decompress(data), 0
        except self._zstd.ZstdError as e:
            raise OSError(f"damaged .zst data ({e})") from None
        if self._frame.eof:
            self._next = self._frame.unused_data
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


def read_line(f, limit: int) -> tuple[Optional[bytes], int]:
    """(the next line of binary file ``f``, its size in bytes); (b"", 0) at the end. A line longer than
    ``limit`` bytes (newline excluded) is read past in pieces, never held whole: (None, its size)."""
    raw = f.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw, len(raw)
    size = len(raw)
    while True:
        piece = f.readline(_SKIP_CHUNK)
        size += len(piece)
        if not piece or piece.endswith(b"\n"):
            return None, size


def bounded_lines(f, limit: int) -> Iterator[bytes]:
    """The lines of ``f`` of at most ``limit`` bytes (longer ones passed over unread)."""
    while True:
        raw, size = read_line(f, limit)
        if not size:
            return
        if raw is not None:
            yield raw


class Lines:
    """The valid UTF-8 lines of one input file, or of the lines that start in ``[start, end)`` (an
    :class:`InputRange`), without their newline; what a format reads its records from (:mod:`.formats`).

    Lines over ``max_line_bytes`` are skipped and counted, unread (``strict``: DataError); lines that are
    not UTF-8 likewise. Read in blocks of ``block_bytes``: a block that decodes whole, holds no NUL and no
    over-long line is one batch, split at once; any other goes line by line, a batch of one each. Counts go
    to ``stats`` as the lines are read."""

    def __init__(self, path: Path, stats: CorpusStats, strict: bool = False, start: int = 0,
                 end: Optional[int] = None, max_line_bytes: int = MAX_LINE_BYTES, block_bytes: int = BLOCK_BYTES):
        self.path, self.stats, self.strict = path, stats, strict
        self.start, self.end, self.limit, self.block_bytes = start, end, max_line_bytes, block_bytes
        self.ranged = bool(start)

    def batches(self) -> Iterator[list[str]]:
        """The lines a read block at a time (no per-line work)."""
        for _, _, lines in self._batches():
            yield lines

    def numbered(self) -> Iterator[tuple[LineAt, str]]:
        """(where, line) one line at a time; ``where`` is for :meth:`where`."""
        for first, starts, lines in self._batches():
            for i, line in enumerate(lines):
                yield (first + i, starts[i] if starts is not None else 0), line

    def where(self, at: LineAt) -> str:
        """A line for messages: ``path:N``, or ``path: the line at byte B`` in a range."""
        return _where(self.path, self.ranged, *at)

    def _batches(self) -> Iterator[tuple[int, Optional[list[int]], list[str]]]:
        """(the line number of the batch's first line, each line's byte offset when reading a range (else
        None), the lines)."""
        path, stats, strict, start, end = self.path, self.stats, self.strict, self.start, self.end
        max_line_bytes, ranged = self.limit, self.ranged
        lineno = invalid = nul = long = 0
        stats.max_line_bytes = max_line_bytes
        try:
            with open_input(path) as f:
                pos = 0
                if start:
                    f.seek(start - 1)
                    pos = start - 1 + read_line(f, max_line_bytes)[1]   # the first line that starts at or after `start`
                for block, at in _blocks(f, pos, end, max_line_bytes, self.block_bytes):
                    if block is None:                              # one over-long line, already read past
                        lineno += 1
                        if strict:
                            raise _too_long(_where(path, ranged, lineno, pos), at, max_line_bytes)
                        long += 1
                        pos += at
                        continue
                    pos = at
                    text = None
                    if b"\0" not in block and (len(block) <= max_line_bytes + 1
                                                or _longest_line(block) <= max_line_bytes):
                        try:
                            text = block.decode("utf-8")
                        except UnicodeDecodeError:
                            pass
                    if text is not None:                           # the common case: every line valid
                        lines = text.split("\n")
                        if not lines[-1]:                          # the block ends with a newline
                            lines.pop()
                        starts = None
                        if ranged:
                            starts = (np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + 1 + pos).tolist()
                            starts.insert(0, pos)
                        yield lineno + 1, starts, lines
                        lineno += len(lines)
                        pos += len(block)
                        continue
                    for raw in _split_nl(block):
                        size = len(raw)
                        lineno += 1
                        line_start, pos = pos, pos + size
                        if size - raw.endswith(b"\n") > max_line_bytes:
                            if strict:
                                raise _too_long(_where(path, ranged, lineno, line_start), size, max_line_bytes)
                            long += 1
                            continue
                        if b"\0" in raw:
                            nul += 1
                        try:
                            line = raw.decode("utf-8")
                        except UnicodeDecodeError as e:
                            if strict:
                                raise DataError(f"{_where(path, ranged, lineno, line_start)}: invalid UTF-8 "
                                                f"({e.reason} at byte {e.start}); expected UTF-8 text (without "
                                                "--strict such lines are skipped)") from None
                            invalid += 1
                            continue
                        yield lineno, [line_start] if ranged else None, [line[:-1] if line.endswith("\n") else line]
        except READ_ERRORS as e:
            raise DataError(f"input {path}: cannot be read after line {lineno} ({reason(e)})") from None
        finally:
            stats.lines += lineno
            stats.invalid_utf8_lines += invalid
            stats.long_lines += long
            if lineno and (nul or invalid > BINARY_LINE_FRACTION * lineno):
                why = [f"{invalid} of {lineno} lines are not UTF-8"] if invalid else []
                why += [f"{nul} lines hold NUL bytes"] if nul else []
                part = f" (bytes {start}-{end})" if start or end is not None else ""
                stats.file_warnings.append(f"input {path}{part} looks binary, not text ({', '.join(why)}); only its "
                                           "valid lines were used")


def _where(path: Path, ranged: bool, lineno: int, line_start: int) -> str:
    """A line for messages: ``path:N``, or ``path: the line at byte B`` in a range (InputRange)."""
    return f"{path}: the line at byte {line_start}" if ranged else f"{path}:{lineno}"



def _blocks(f, pos: int, end: Optional[int], limit: int, block_bytes: int) -> Iterator[tuple[Optional[bytes], int]]:
    """(whole lines of ``f``, the file offset where they start) from ``pos``, up to the first line starting at or
    after ``end``; a line longer than ``limit`` bytes (newline excluded) that does not end in the block it
    starts in comes as (None, its size), read past in pieces, never held whole."""
    carry: list[bytes] = []             # the start of a line that goes on in the next block
    held = 0
    while end is None or pos < end:
        data = f.read(block_bytes)
        if not data:
            if carry:
                yield b"".join(carry), pos
            return
        cut = data.rfind(b"\n") + 1
        if not cut:
            carry.append(data)
            held += len(data)
        else:
            if carry:
                data, cut = b"".join(carry) + data, cut + held
                carry, held = [], 0
            if end is not None and pos + cut > end:        # stop after the line holding byte end - 1
                cut = data.index(b"\n", end - 1 - pos) + 1
                yield data[:cut], pos
                return
            yield data[:cut], pos
            pos += cut
            if cut < len(data):
                carry, held = [data[cut:]], len(data) - cut
        if held > limit and (end is None or pos < end):   # a line longer than the limit: never held whole
            size = held
            while True:
                piece = f.readline(_SKIP_CHUNK)
                size += len(piece)
                if not piece or piece.endswith(b"\n"):
                    break
            yield None, size
            pos, carry, held = pos + size, [], 0


def _too_long(where: str, size: int, limit: int) -> DataError:
    return DataError(f"{where}: a line of {size} bytes (newline included), longer than the limit of {limit} bytes "
                     "(--max-line-bytes; without --strict such lines are skipped)")


def _split_nl(block: bytes) -> list[bytes]:
    """The lines of ``block`` split at b"\\n" only, newlines kept (``bytes.splitlines`` also splits at \\r)."""
    parts = block.split(b"\n")
    last = parts.pop()
    return [p + b"\n" for p in parts] + ([last] if last else [])


def _longest_line(block: bytes) -> int:
    """The longest line of ``block`` in bytes, newline excluded."""
    nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
    edges = np.concatenate(([-1], nl, [len(block)]))
    return int((np.diff(edges) - 1).max())
