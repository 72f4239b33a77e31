"""``pd``: People's Daily tagged text (``word/tag  word/tag``), one document per line. The ``/tag`` suffixes
and the ``[...]nt`` compound brackets are stripped, a leading date id (``19980101-01-001-001/m``) is dropped,
and the words are kept as gold word boundaries (used for whole-word-masking marks). ``auto`` recognises it
by its first non-empty line (nearly every token of it ``word/tag``).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterator, Optional

import numpy as np

from ..lines import Lines
from ..normalization import WORD_JOIN as _US
from ..normalization import normalize_words
from .base import ReadOptions

__all__ = ["PeoplesDaily", "READER", "pd_documents_batch", "pd_words"]

_PD_DATE = re.compile(r"^\d{8}-\d{2}-\d{3}-\d{3}(/m)?$")
_PD_TAG = re.compile(r"/[A-Za-z]+(?:\][A-Za-z]*)?(?=\s|$)")   # word/tag, word/tag]nt
_PD_OPEN = re.compile(r"(?:(?<=\s)|^)\[(?=\S)")                 # [word/tag  (compound start)
_PD_LINE = re.compile(r"^\[?.+/[A-Za-z]+\]?[A-Za-z]*$")


class PeoplesDaily:
    help = "People's Daily tagged text (word/tag  word/tag), its words kept, recognised by auto from its lines"
    suffixes = ()
    kind = "pd"

    def looks_like(self, line: str) -> bool:
        toks = line.split()
        if len(toks) < 2:
            return False
        tagged = sum(1 for t in toks[:20] if _PD_LINE.match(t))
        return tagged >= 0.9 * min(len(toks), 20)

    def splittable(self, options: ReadOptions) -> bool:
        return True

    def records(self, lines: Lines, options: ReadOptions) -> Iterator[list[str]]:
        for batch in lines.batches():
            records = [line for line in batch if line and not line.isspace()]
            lines.stats.empty_docs += len(batch) - len(records)
            yield records

    def words(self, record: str) -> list[str]:
        return pd_words(record)

    def documents(self, records: list[str]) -> list[tuple[str, list[str] | np.ndarray]]:
        return pd_documents_batch(records)


def pd_words(line: str) -> list[str]:
    """The words of a tagged line, tags, brackets and date id removed (not yet normalised)."""
    return _PD_OPEN.sub("", _PD_TAG.sub("", _pd_strip(line))).split()


# --------------------------------------------------------------------------- People's Daily, vectorised
#
# pd_words + normalize_words for a whole batch of lines with a few numpy passes over their code points
# (the regular expressions cost a Python-level substitution per word): the same tags and brackets are
# removed (a '/' + ASCII letters [+ ']' + letters] before whitespace or the line's end; a '[' after
# whitespace or the line's start and before a character that stays and is not whitespace), words are the
# runs of what is left between whitespace (str.isspace, as split() and the patterns' \s), full-width
# forms are mapped as normalization._halfwidth does, and each line's words come out joined by _US. A removed part always
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
    """The line without surrounding whitespace and without a leading date id (what pd_words splits)."""
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
    normalize_words(pd_words(r))``, faster (see above); ``words`` comes as its word lengths (int64) where
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
        words = normalize_words(pd_words(raw))
        out.append(("".join(words), words))
    return out


READER = PeoplesDaily()
