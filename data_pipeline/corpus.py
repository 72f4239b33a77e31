"""Corpus readers and text normalisation.

Readers turn files into a stream of :class:`Document` (normalised text, plus gold
word boundaries when the source has them). Supported inputs, each optionally
gzip-compressed (``.gz``):

- ``.txt``: one document per line (``doc_boundary="line"``, default) or documents
  separated by blank lines (``doc_boundary="blank"``; the lines of a document are
  joined with a space, which normalisation then keeps as a single space).
- ``.jsonl``: one JSON object per line, text in field ``text`` (``jsonl_field``).
- People's Daily tagged text (``word/tag  word/tag``; format ``pd``, detected
  automatically in ``auto`` mode from the first non-empty line): the ``/tag``
  suffixes and the ``[...]nt`` compound brackets are stripped, a leading date id
  (``19980101-01-001-001/m``) is dropped, and the words are kept as gold word
  boundaries (used for whole-word-masking marks).

Inputs may be files, directories (every file below them, sorted) or glob patterns.

Normalisation (:func:`normalize`), applied to every document, in this order:

1. Unicode NFKC. This also maps full-width ASCII (``Ａ１，``) to half-width
   (``A1,``) and the ideographic space U+3000 to a plain space.
2. Control and format characters (Unicode categories Cc, Cf: NUL, BEL, zero-width
   space/joiner, BOM, ...) are removed; tabs and newlines count as whitespace.
3. Runs of whitespace collapse to one ASCII space; leading and trailing
   whitespace is stripped.

Lines that are not valid UTF-8 are skipped and counted (``strict=True``: a
:class:`~data_pipeline.errors.DataError` naming the file and line instead); documents that are
empty after normalisation are skipped and counted. A line is never read whole when it is longer
than ``max_line_bytes`` (default ``MAX_LINE_BYTES``, 1 MiB, newline excluded; ``--max-line-bytes``):
at most that many bytes of it (plus one read block, ``_BLOCK_BYTES``: 1 MiB) are held in memory, the
rest is read past in pieces, and the line
is skipped and counted (``long_lines``) with a warning that always shows, or, with
``strict=True``, is a DataError naming the file and line. So is a blank-line separated document
whose lines add up to more. Such a line is most likely not text (a minified dump, a binary
file, a missing newline conversion); when it is a real document, raise the limit. A JSON line
nested too deeply for the parser counts as invalid JSON. :class:`CorpusStats` holds the counts and
the warnings: a file that looks binary (NUL bytes, or more than 10% of its lines not UTF-8) and
a corpus of which more than 1% of the lines were skipped. A file that cannot be read (a
truncated or damaged ``.gz``, an I/O error) is a DataError naming it; :func:`check_inputs`
opens every input before any expensive work.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from .errors import DataError, UsageError

__all__ = ["Document", "CorpusStats", "InputRange", "normalize", "normalize_words", "expand_inputs", "check_inputs",
           "splittable",
           "read_documents", "iter_records", "iter_record_chunks", "CHUNK_RECORDS", "to_document",
           "normalize_records", "normalize_batch",
           "normalize_words_batch", "pd_documents_batch", "detect_format", "FORMATS", "MAX_LINE_BYTES", "read_line"]

FORMATS = ("auto", "txt", "jsonl", "pd")
BINARY_LINE_FRACTION = 0.10
"""A file with more than this share of lines that are not UTF-8 (or with NUL bytes) looks binary."""
SKIPPED_WARN_FRACTION = 0.01
"""Warn when more than this share of all lines was skipped as invalid."""
MAX_LINE_BYTES = 1 << 20
"""The longest line (or blank-line separated document) read, in bytes without the newline; longer ones are
skipped and counted (``strict``: a DataError). ``max_line_bytes`` / ``--max-line-bytes`` change it."""
_SKIP_CHUNK = 1 << 20

_WS = re.compile(r"\s+")
_PD_DATE = re.compile(r"^\d{8}-\d{2}-\d{3}-\d{3}(/m)?$")


def _control_class() -> re.Pattern:
    """A regex class of Cc (controls) and Cf (format: zero-width, BOM, bidi marks), whitespace excluded."""
    cps = [cp for cp in range(0x110000)
           if unicodedata.category(chr(cp)) in ("Cc", "Cf") and not chr(cp).isspace()]
    ranges, start, prev = [], cps[0], cps[0]
    for cp in cps[1:] + [-1]:
        if cp != prev + 1:
            ranges.append(re.escape(chr(start)) + ("-" + re.escape(chr(prev)) if prev > start else ""))
            start = cp
        prev = cp
    return re.compile("[" + "".join(ranges) + "]+")


_CONTROL = _control_class()
_US = "\ue000"  # private-use char (NFKC leaves it alone): joins words while normalising them in one call
_PD_TAG = re.compile(r"/[A-Za-z]+(?:\][A-Za-z]*)?(?=\s|$)")   # word/tag, word/tag]nt
_PD_OPEN = re.compile(r"(?:(?<=\s)|^)\[(?=\S)")                 # [word/tag  (compound start)


@dataclass(frozen=True)
class InputRange:
    """Part of an uncompressed, line-based input file: the lines that *start* at a byte in
    ``[start, end)`` (so consecutive ranges of a file split it at line boundaries, each line once).
    How cluster preparation spreads one large file over several tasks; accepted wherever inputs are."""
    path: Path
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.path}[bytes {self.start}-{self.end})"


@dataclass
class Document:
    text: str
    """Normalised text."""
    words: "Optional[list[str] | np.ndarray]" = None
    """Gold word segmentation (``"".join(words) == text``) when the source has it. (The shard builder's batches,
    :func:`normalize_records`, carry gold words possibly as their lengths in characters (int64 array), which is
    all the word marks need: no string per word.)"""


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
    """Raw lines read (all files)."""
    long_lines: int = 0
    """Lines (and blank-line separated documents) skipped for being longer than ``max_line_bytes``."""
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


def normalize(text: str) -> str:
    """NFKC, drop control/format characters, collapse whitespace (see the module docstring)."""
    text = _CONTROL.sub("", unicodedata.normalize("NFKC", text))
    return _WS.sub(" ", text).strip()


def normalize_words(words: Iterable[str]) -> list[str]:
    """Normalise pre-segmented words one by one (NFKC, controls removed, whitespace collapsed and
    stripped); words that become empty are dropped. The document text is ``"".join(words)``."""
    words = [w.replace(_US, "") for w in words]
    joined = _CONTROL.sub("", unicodedata.normalize("NFKC", _US.join(words)))
    if _WS.search(joined):
        return [w for w in (_WS.sub(" ", w).strip() for w in joined.split(_US)) if w]
    return [w for w in joined.split(_US) if w]


# --------------------------------------------------------------------------- batch normalisation (the hot path)
#
# The same results as normalize / normalize_words, several times faster on typical Chinese text:
# full-width ASCII (U+FF01-U+FF5E) and U+3000 are mapped to their NFKC forms for a whole batch in
# one numpy pass (the mapping is character for character, and NFKC of the mapped text equals NFKC
# of the original: those characters' compatibility decomposition is exactly that ASCII character);
# NFKC itself then runs only on texts that its quick check does not already accept (in a chunk joined by newlines,
# after "…" -> "..." (its NFKC form; a starter that composes with nothing) on halves that it refuses); and a text that
# is printable (no control, format or odd whitespace characters) without double spaces needs only
# ``strip``. Anything else takes the general path.


def _halfwidth(texts: list[str]) -> list[str]:
    joined = "".join(texts)
    if joined.isascii():
        return texts
    try:                                # UTF-16 code units: the mapped ones are never surrogates
        units = np.frombuffer(joined.encode("utf-16-le"), np.uint16)
    except UnicodeEncodeError:          # lone surrogates (JSON escapes): the general path copes
        return texts
    full = (units >= 0xFF01) & (units <= 0xFF5E)
    space = units == 0x3000
    if not (full.any() or space.any()):
        return texts
    units = units.copy()
    units[full] -= 0xFEE0
    units[space] = 0x20
    joined = units.tobytes().decode("utf-16-le")
    out, pos = [], 0
    for t in texts:
        out.append(joined[pos:pos + len(t)])
        pos += len(t)
    return out


def _nfkc_lines(text: str) -> str:
    """NFKC of newline-separated lines (which is NFKC of each line, see _normalize_joined), computed only for the
    lines of the halves, quarters, ... that its quick check refuses (most text needs none: one fast pass)."""
    if unicodedata.is_normalized("NFKC", text):
        return text
    cut = text.find("\n", len(text) // 2)
    cut = text.rfind("\n") if cut < 0 else cut
    if cut < 0:
        return unicodedata.normalize("NFKC", text)
    return _nfkc_lines(text[:cut]) + "\n" + _nfkc_lines(text[cut + 1:])


def _nfkc(text: str) -> str:
    return text if unicodedata.is_normalized("NFKC", text) else unicodedata.normalize("NFKC", text)


def normalize_batch(texts: list[str]) -> list[str]:
    """``[normalize(t) for t in texts]``, faster (see above)."""
    fast = _normalize_joined(texts)
    if fast is not None:
        return fast
    out = []
    for t in _halfwidth(texts):
        t = _nfkc(t)
        s = t.strip()
        out.append(s if s.isprintable() and "  " not in s else normalize(t))
    return out


def _normalize_joined(texts: list[str]) -> Optional[list[str]]:
    """:func:`normalize_batch` of texts without a newline, done on all of them joined by newlines at once (a
    newline is a starter that NFKC neither makes, removes nor composes with, so NFKC of the joined text is the
    NFKC of each joined); None when a text holds a newline or, once mapped and stripped, anything besides
    printable characters and single inner spaces (the general path then takes each text)."""
    for attempt in (texts, None):
        if attempt is None:                            # then stripped: trailing spaces, CRLF, blank lines
            attempt = [t.strip() for t in texts]
        nonempty = [t for t in attempt if t] if "" in attempt else attempt
        done = _nfkc_joined(nonempty) if nonempty else []
        if done is not None:
            if nonempty is attempt:
                return done
            it = iter(done)
            return [next(it) if t else t for t in attempt]
    return None


def _nfkc_joined(texts: list[str]) -> Optional[list[str]]:
    """NFKC of non-empty texts joined by newlines, split again; None unless each comes out printable, with no
    leading, trailing or double spaces (and no newline in any)."""
    joined = "\n".join(texts)
    if joined.count("\n") != len(texts) - 1:
        return None
    joined = _nfkc_lines(_halfwidth([joined])[0].replace("\u2026", "..."))
    flat = joined.replace("\n", " ")
    if not flat.isprintable() or "  " in flat or flat[0] == " " or flat[-1] == " " or \
            joined.count("\n") != len(texts) - 1:
        return None
    return joined.split("\n")


def normalize_words_batch(docs: list[list[str]]) -> list[list[str]]:
    """``[normalize_words(words) for words in docs]``, faster (see above)."""
    joined = [_US.join(words) for words in docs]
    out = []
    for words, raw, t in zip(docs, joined, _halfwidth(joined)):
        t = _nfkc(t)
        if raw.count(_US) == len(words) - 1 and " " not in t and t.replace(_US, "").isprintable():
            parts = t.split(_US)
            out.append([w for w in parts if w] if "" in parts else parts)
        else:
            out.append(normalize_words(words))
    return out


# --------------------------------------------------------------------------- People's Daily, vectorised
#
# _pd_words + normalize_words for a whole batch of lines with a few numpy passes over their code points
# (the regular expressions cost a Python-level substitution per word): the same tags and brackets are
# removed (a '/' + ASCII letters [+ ']' + letters] before whitespace or the line's end; a '[' after
# whitespace or the line's start and before a character that stays and is not whitespace), words are the
# runs of what is left between whitespace (str.isspace, as split() and the patterns' \s), full-width
# forms are mapped as _halfwidth does, and each line's words come out joined by _US. A removed part always
# touches whitespace or a line's edge, so removing it never joins or splits a word. The words then take
# normalize_words_batch's rules: NFKC of the joined words (a document NFKC leaves alone keeps its word
# lengths from numpy, no string per word), and normalize_words itself where a space, control or format
# character is left.

_WS_MAX = 0x3000
_OTHER, _LETTER, _SLASH, _OPEN, _CLOSE, _SPACE, _NEWLINE = range(7)
_CLASSES: Optional[np.ndarray] = None


def _classes() -> np.ndarray:
    """uint8 class of each code point up to U+3000 (the last whitespace: tests/test_corpus.py checks) + 1
    (everything above): _LETTER (ASCII), _SLASH, _OPEN '[', _CLOSE ']', _SPACE (str.isspace), _NEWLINE;
    else _OTHER."""
    global _CLASSES
    if _CLASSES is None:
        cls = np.array([_SPACE if chr(cp).isspace() else _OTHER for cp in range(_WS_MAX + 2)], np.uint8)
        cls[[ord(ch) for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"]] = _LETTER
        cls[[ord("/"), ord("["), ord("]"), ord("\n")]] = _SLASH, _OPEN, _CLOSE, _NEWLINE
        _CLASSES = cls
    return _CLASSES


def _pd_strip(line: str) -> str:
    """The line without surrounding whitespace and without a leading date id (what _pd_words splits)."""
    line = line.strip()
    first, _, rest = line.partition(" ")
    return rest if _PD_DATE.match(first) else line


def _pd_fast(lines: list[str]) -> Optional[tuple[list[str], list[str], list[np.ndarray]]]:
    """Of each line: its words (People's Daily tags and brackets removed, full-width forms mapped) joined by
    _US, its text (the words concatenated) and its word lengths (characters, int64); None when the batch
    holds a character the fast path does not take (a lone surrogate, _US itself)."""
    joined = "\n".join(lines) + "\n"
    try:
        cps = np.frombuffer(joined.encode("utf-32-le"), np.uint32)
    except UnicodeEncodeError:
        return None
    if (cps == ord(_US)).any():
        return None
    n = len(cps)
    cls = _classes()[np.minimum(cps, _WS_MAX + 1)]
    ws = cls >= _SPACE
    letter = cls == _LETTER
    p = np.flatnonzero(cls == _SLASH)                              # '/': a tag starts here when ...
    q = p + 1                                                      # ... letters follow, up to q, and then
    run = np.flatnonzero(letter[q])                                # (the last character is a newline)
    while len(run):
        q[run] += 1
        run = run[letter[q[run]]]
    r = q + 1                                                      # after a ']': letters up to r
    r[q == n - 1] = n - 1
    run = np.flatnonzero(cls[q] == _CLOSE)
    while len(run):
        run = run[letter[r[run]]]
        r[run] += 1
    plain = (q > p + 1) & ws[q]                                    # whitespace, or
    bracket = (q > p + 1) & (cls[q] == _CLOSE) & ws[r]             # ']' + letters + whitespace
    tag = plain | bracket
    starts, ends = p[tag], np.where(plain, q, r)[tag]              # tags never overlap
    edge = np.zeros(n + 1, np.int8)
    edge[starts], edge[ends] = 1, -1
    gone = np.cumsum(edge[:n], dtype=np.int8) > 0
    tag_start = np.zeros(n, bool)
    tag_start[starts] = True
    b = np.flatnonzero(cls == _OPEN)                               # '[' opening a compound
    before = np.ones(len(b), bool)
    before[b > 0] = ws[b[b > 0] - 1]
    gone[b[before & ~ws[b + 1] & ~tag_start[b + 1]]] = True
    sel = np.flatnonzero(~gone & ~ws)                              # the characters of words
    line_of = np.cumsum(cls == _NEWLINE, dtype=np.int32)[sel]      # newlines: the line boundaries (lines hold none)
    first_of_word = np.ones(len(sel), bool)
    first_of_word[1:] = sel[1:] - sel[:-1] > 1                     # a removed part always touches whitespace
    first_of_line = np.ones(len(sel), bool)
    first_of_line[1:] = line_of[1:] != line_of[:-1]
    sep = first_of_word & ~first_of_line                           # a _US before this character
    chars = cps[sel]
    full = (chars >= 0xFF01) & (chars <= 0xFF5E)
    chars = np.where(full, chars - 0xFEE0, chars)
    num_lines = len(lines)
    per_line = np.bincount(line_of, minlength=num_lines)
    k = np.arange(len(sel))
    text = np.full(len(sel) + num_lines, 0x0A, np.uint32)
    text[k + line_of] = chars
    with_sep = np.full(len(sel) + int(sep.sum()) + num_lines, ord(_US), np.uint32)
    with_sep[k + np.cumsum(sep) + line_of] = chars
    with_sep[np.cumsum(per_line + np.bincount(line_of[sep], minlength=num_lines)) + np.arange(num_lines)] = 0x0A
    word_starts = np.flatnonzero(first_of_word)
    lengths = np.diff(np.append(word_starts, len(sel)))
    bounds = np.zeros(num_lines + 1, np.int64)
    np.cumsum(np.bincount(line_of[word_starts], minlength=num_lines), out=bounds[1:])
    bounds = bounds.tolist()
    return (with_sep.tobytes().decode("utf-32-le").split("\n")[:-1],
            text.tobytes().decode("utf-32-le").split("\n")[:-1],
            [lengths[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def pd_documents_batch(records: list[str]) -> list[tuple[str, list[str] | np.ndarray]]:
    """(text, words) of raw People's Daily lines: ``text, words = "".join(w), w`` for ``w =
    normalize_words(_pd_words(r))``, faster (see above); ``words`` comes as its word lengths (int64) where
    the fast path made it, else as the list of words."""
    fast = _pd_fast([_pd_strip(r) for r in records])
    out: list[tuple[str, list[str] | np.ndarray]] = []
    for i, raw in enumerate(records):
        if fast is not None:
            joined, text = fast[0][i], fast[1][i]
            if unicodedata.is_normalized("NFKC", joined):
                if " " not in text and text.isprintable():
                    out.append((text, fast[2][i]))
                    continue
            else:                                      # as normalize_words_batch: NFKC of the joined words
                joined = unicodedata.normalize("NFKC", joined)
                if " " not in joined and joined.replace(_US, "").isprintable():
                    parts = joined.split(_US)
                    words = [w for w in parts if w] if "" in parts else parts
                    out.append(("".join(words), words))
                    continue
        words = normalize_words(_pd_words(raw))
        out.append(("".join(words), words))
    return out


def expand_inputs(inputs: Iterable[str | os.PathLike] | str | os.PathLike) -> list[Path]:
    """Files named by paths, directories (recursively, sorted) and glob patterns (InputRange s as they are)."""
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
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")))
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


def check_inputs(inputs) -> list[Path]:
    """The input files, each opened and its first block read (decompressed for ``.gz``), so that a
    missing, unreadable or non-gzip input fails before any expensive work; DataError naming it."""
    files = expand_inputs(inputs)
    for path in files:
        path = path.path if isinstance(path, InputRange) else path
        try:
            with _open_binary(path) as f:
                f.read(512)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"input {path}: cannot be read ({_reason(e)})") from None
    return files


def _reason(e: BaseException) -> str:
    if isinstance(e, EOFError) or "end-of-stream" in str(e):
        return "the compressed file ends early: truncated .gz?"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _base_suffix(path: Path) -> str:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return Path(name).suffix.lower()


def _is_pd_line(line: str) -> bool:
    toks = line.split()
    if len(toks) < 2:
        return False
    tagged = sum(1 for t in toks[:20] if re.match(r"^\[?.+/[A-Za-z]+\]?[A-Za-z]*$", t))
    return tagged >= 0.9 * min(len(toks), 20)


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


def _bounded_lines(f, limit: int) -> Iterator[bytes]:
    """The lines of ``f`` of at most ``limit`` bytes (longer ones passed over unread)."""
    while True:
        raw, size = read_line(f, limit)
        if not size:
            return
        if raw is not None:
            yield raw


def detect_format(path: Path) -> str:
    """txt | jsonl | pd, from the extension and (for text files) the first non-empty line."""
    if _base_suffix(path) in (".jsonl", ".json"):
        return "jsonl"
    try:
        with _open_binary(path) as f:
            for raw in _bounded_lines(f, MAX_LINE_BYTES):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    continue
                if line:
                    return "pd" if _is_pd_line(line) else "txt"
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"input {path}: cannot be read ({_reason(e)})") from None
    return "txt"


CHUNK_RECORDS = 1024
"""Records per chunk of :func:`iter_record_chunks` (the shard builder's unit of work) by default."""

_BLOCK_BYTES = 1 << 20
"""Lines are read in blocks of this many bytes (1 MiB), decoded and split a block at a time."""


def _where(path: Path, ranged: bool, lineno: int, line_start: int) -> str:
    """A line for messages: ``path:N``, or ``path: the line at byte B`` in a range (InputRange)."""
    return f"{path}: the line at byte {line_start}" if ranged else f"{path}:{lineno}"


def _blocks(f, pos: int, end: Optional[int], limit: int) -> Iterator[tuple[Optional[bytes], int]]:
    """(whole lines of ``f``, the file offset where they start) from ``pos``, up to the first line starting at or
    after ``end``; a line longer than ``limit`` bytes (newline excluded) that does not end in the block it
    starts in comes as (None, its size), read past in pieces, never held whole."""
    carry: list[bytes] = []             # the start of a line that goes on in the next block
    held = 0
    while end is None or pos < end:
        data = f.read(_BLOCK_BYTES)
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


def _line_batches(path: Path, stats: CorpusStats, strict: bool, start: int = 0, end: Optional[int] = None,
                  max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, Optional[list[int]], list[str]]]:
    """The valid UTF-8 lines of a file, or of the lines starting in [start, end), without their newline, in
    batches: (the line number of the batch's first line, each line's byte offset when reading a range (for
    messages, :func:`_where`; else None), the lines). Lines over ``max_line_bytes`` are skipped and counted,
    unread (``strict``: DataError). Read in blocks (:data:`_BLOCK_BYTES`): a block that decodes whole, holds no
    NUL and no over-long line is one batch, split at once; any other goes line by line, a batch of one each."""
    lineno = invalid = nul = long = 0
    stats.max_line_bytes = max_line_bytes
    ranged = bool(start)
    try:
        with _open_binary(path) as f:
            pos = 0
            if start:
                f.seek(start - 1)
                pos = start - 1 + read_line(f, max_line_bytes)[1]   # the first line that starts at or after `start`
            for block, at in _blocks(f, pos, end, max_line_bytes):
                if block is None:                              # one over-long line, already read past
                    lineno += 1
                    if strict:
                        raise _too_long(_where(path, ranged, lineno, pos), at, max_line_bytes)
                    long += 1
                    pos += at
                    continue
                pos = at
                text = None
                if b"\0" not in block and (len(block) <= max_line_bytes + 1 or _longest_line(block) <= max_line_bytes):
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
                            raise DataError(f"{_where(path, ranged, lineno, line_start)}: invalid UTF-8 ({e.reason} "
                                            f"at byte {e.start}); expected UTF-8 text (without --strict such lines "
                                            "are skipped)") from None
                        invalid += 1
                        continue
                    yield lineno, [line_start] if ranged else None, [line[:-1] if line.endswith("\n") else line]
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"input {path}: cannot be read after line {lineno} ({_reason(e)})") from None
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


def _lines(path: Path, stats: CorpusStats, strict: bool, start: int = 0, end: Optional[int] = None,
           max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[tuple[int, int], str]]:
    """((line number, byte offset), line) of :func:`_line_batches`, a line at a time."""
    for first, starts, lines in _line_batches(path, stats, strict, start, end, max_line_bytes):
        for i, line in enumerate(lines):
            yield (first + i, starts[i] if starts is not None else 0), line


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


def _pd_words(line: str) -> list[str]:
    return _PD_OPEN.sub("", _PD_TAG.sub("", _pd_strip(line))).split()


def to_document(record: tuple[str, str], stats: Optional[CorpusStats] = None) -> Optional[Document]:
    """Parse and normalise one raw record from :func:`iter_records`; None (counted) when empty."""
    kind, raw = record
    stats = stats if stats is not None else CorpusStats()
    if kind == "pd":
        words = normalize_words(_pd_words(raw))
        text = "".join(words)
    else:
        words, text = None, normalize(raw)
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
    (People's Daily) may come as their lengths (:func:`pd_documents_batch`). ``utf8``: the texts as UTF-8 bytes
    (encoded in one pass: what SentencePiece reads without converting each str), where they have no lone
    surrogate (else as str)."""
    stats = stats if stats is not None else CorpusStats()
    if kind == "pd":
        pairs = pd_documents_batch(records)
        keep = [i for i, (t, _) in enumerate(pairs) if t]
        texts, words = [pairs[i][0] for i in keep], [pairs[i][1] for i in keep]
    else:
        texts, words = normalize_batch(records), None
        if "" in texts:
            keep = [i for i, t in enumerate(texts) if t]
            texts = [texts[i] for i in keep]
        else:
            keep = range(len(texts))
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


def _file_batches(path: Path | InputRange, fmt: str = "auto", doc_boundary: str = "line", jsonl_field: str = "text",
                  strict: bool = False, stats: Optional[CorpusStats] = None,
                  max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, list[str]]]:
    """The raw records of one file (or InputRange) in batches ``(kind, records)``: kind ``text`` or ``pd``
    (one kind a file), records not yet normalised; plain lines come a read block at a time (no per-line work)."""
    stats = stats if stats is not None else CorpusStats()
    start, end = 0, None
    if isinstance(path, InputRange):
        path, start, end = path.path, path.start, path.end
    if fmt not in FORMATS:
        raise UsageError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if doc_boundary not in ("line", "blank"):
        raise UsageError(f"doc_boundary: expected 'line' or 'blank', got {doc_boundary!r}")
    if not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise UsageError(f"max_line_bytes: expected a positive number of bytes, got {max_line_bytes!r}")
    if fmt == "auto":
        fmt = detect_format(path)
    if end is not None and not splittable(path, fmt, doc_boundary):
        raise UsageError(f"input {path}: a byte range of a compressed file or of blank-line separated documents")
    stats.files += start == 0
    if fmt == "pd":
        for _, _, lines in _line_batches(path, stats, strict, start, end, max_line_bytes):
            records = [line for line in lines if line and not line.isspace()]
            stats.empty_docs += len(lines) - len(records)
            yield "pd", records
    elif fmt == "txt" and doc_boundary == "line":
        for _, _, lines in _line_batches(path, stats, strict, start, end, max_line_bytes):
            yield "text", lines
    else:
        lines = _lines(path, stats, strict, start, end, max_line_bytes)
        records = (_jsonl_records(lines, jsonl_field, strict, stats, path, bool(start)) if fmt == "jsonl" else
                   _blank_separated(lines, strict, stats, max_line_bytes, path))
        for record in records:
            yield "text", [record]


def read_file(path: Path | InputRange, fmt: str = "auto", doc_boundary: str = "line", jsonl_field: str = "text",
              strict: bool = False, stats: Optional[CorpusStats] = None,
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, str]]:
    """Raw records ``(kind, text)`` of one file (or InputRange), kind ``text`` or ``pd``; not yet normalised
    (a line comes without its newline). Lines (and blank-line separated documents) over ``max_line_bytes`` are
    skipped (module docstring)."""
    for kind, records in _file_batches(path, fmt, doc_boundary, jsonl_field, strict, stats, max_line_bytes):
        for record in records:
            yield kind, record


def _jsonl_records(lines, jsonl_field: str, strict: bool, stats: CorpusStats, path: Path,
                   ranged: bool) -> Iterator[str]:
    for at, line in lines:
        if not line.strip():
            stats.empty_docs += 1
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:       # also: nested too deeply, an integer of too many digits
            if strict:
                why = e.msg if isinstance(e, json.JSONDecodeError) else \
                    "nested too deeply" if isinstance(e, RecursionError) else str(e)
                raise DataError(f"{_where(path, ranged, *at)}: invalid JSON ({why})") from None
            stats.invalid_json_lines += 1
            continue
        if not isinstance(obj, dict) or jsonl_field not in obj:
            raise DataError(f"{_where(path, ranged, *at)}: expected a JSON object with a string field "
                            f"{jsonl_field!r} (set --jsonl-field), got "
                            f"{'keys ' + str(sorted(obj)[:20]) if isinstance(obj, dict) else type(obj).__name__}")
        value = obj[jsonl_field]
        if not isinstance(value, str):
            raise DataError(f"{_where(path, ranged, *at)}: field {jsonl_field!r} must be a string, got "
                            f"{type(value).__name__}")
        yield value


def _blank_separated(lines, strict: bool, stats: CorpusStats, max_bytes: int, path: Path) -> Iterator[str]:
    """Documents separated by blank lines; one whose lines add up to more than ``max_bytes`` is skipped and
    counted in ``long_lines`` (``strict``: DataError naming its first line)."""
    buf: list[str] = []
    size, first, too_long = 0, "", False
    for at, line in lines:
        if line.strip():
            if not buf and not too_long:
                first = _where(path, False, *at)          # blank-line documents are never read in ranges
            size += len(line.encode("utf-8", "surrogatepass")) + 1     # and its newline
            if size > max_bytes and not too_long:
                if strict:
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


def splittable(path: Path, fmt: str, doc_boundary: str) -> bool:
    """Whether a file can be read in byte ranges (InputRange): uncompressed, one document per line."""
    return not path.name.endswith(".gz") and (fmt in ("jsonl", "pd") or doc_boundary == "line")


def iter_records(inputs, fmt: str = "auto", doc_boundary: str = "line", jsonl_field: str = "text",
                 strict: bool = False, stats: Optional[CorpusStats] = None,
                 max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, str]]:
    """Raw records of all inputs in sorted file order; :func:`to_document` finishes them."""
    stats = stats if stats is not None else CorpusStats()
    for path in expand_inputs(inputs):
        yield from read_file(path, fmt, doc_boundary, jsonl_field, strict, stats, max_line_bytes)


def iter_record_chunks(inputs, fmt: str = "auto", doc_boundary: str = "line", jsonl_field: str = "text",
                       strict: bool = False, stats: Optional[CorpusStats] = None, max_line_bytes: int = MAX_LINE_BYTES,
                       size: int = CHUNK_RECORDS) -> Iterator[tuple[int, str, list[str]]]:
    """The records of :func:`iter_records` in chunks ``(index of the chunk's first record, kind, records)`` of
    ``size`` records, all of one file (a file's last chunk may be shorter); :func:`normalize_records` finishes
    them (in the shard builder's workers)."""
    stats = stats if stats is not None else CorpusStats()
    first = 0
    for path in expand_inputs(inputs):
        buf: list[str] = []
        for kind, records in _file_batches(path, fmt, doc_boundary, jsonl_field, strict, stats, max_line_bytes):
            buf += records
            while len(buf) >= size:
                yield first, kind, buf[:size]
                first += size
                del buf[:size]
        if buf:
            yield first, kind, buf
            first += len(buf)


def read_documents(inputs, fmt: str = "auto", doc_boundary: str = "line", jsonl_field: str = "text",
                   strict: bool = False, stats: Optional[CorpusStats] = None,
                   limit: Optional[int] = None, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Document]:
    """Normalised documents from files / directories / globs (see the module docstring)."""
    stats = stats if stats is not None else CorpusStats()
    n = 0
    for record in iter_records(inputs, fmt, doc_boundary, jsonl_field, strict, stats, max_line_bytes):
        doc = to_document(record, stats)
        if doc is None:
            continue
        yield doc
        n += 1
        if limit is not None and n >= limit:
            return
