"""Text normalisation: what every corpus document goes through, whatever its format.

:func:`normalize`, in this order:

1. Unicode NFKC. This also maps full-width ASCII (``Ａ１，``) to half-width
   (``A1,``) and the ideographic space U+3000 to a plain space.
2. Control and format characters (Unicode categories Cc, Cf: NUL, BEL, zero-width
   space/joiner, BOM, ...) are removed; tabs and newlines count as whitespace.
3. Runs of whitespace collapse to one ASCII space; leading and trailing
   whitespace is stripped.

:func:`normalize_words` applies the same rules to pre-segmented (gold) words, one by one. The batch
functions (:func:`normalize_batch`, :func:`normalize_words_batch`) give exactly the same results, faster:
the shard builder's hot path (see below). A format whose records carry gold words builds on them
(:mod:`.formats.pd`).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable, Optional

import numpy as np

__all__ = ["normalize", "normalize_words", "normalize_batch", "normalize_words_batch", "WORD_JOIN"]

_WS = re.compile(r"\s+")
_CONTROL: Optional[re.Pattern] = None


def _control_class() -> re.Pattern:
    """A regex class of Cc (controls) and Cf (format: zero-width, BOM, bidi marks), whitespace excluded;
    built once, on first use (it takes a pass over every code point: ``roformer-data --help`` needs none)."""
    global _CONTROL
    if _CONTROL is not None:
        return _CONTROL
    cps = [cp for cp in range(0x110000)
           if unicodedata.category(chr(cp)) in ("Cc", "Cf") and not chr(cp).isspace()]
    ranges, start, prev = [], cps[0], cps[0]
    for cp in cps[1:] + [-1]:
        if cp != prev + 1:
            ranges.append(re.escape(chr(start)) + ("-" + re.escape(chr(prev)) if prev > start else ""))
            start = cp
        prev = cp
    _CONTROL = re.compile("[" + "".join(ranges) + "]+")
    return _CONTROL


WORD_JOIN = "\ue000"
"""A private-use character (NFKC leaves it alone): joins words while normalising them in one call."""
_US = WORD_JOIN


def normalize(text: str) -> str:
    """NFKC, drop control/format characters, collapse whitespace (see the module docstring)."""
    text = _control_class().sub("", unicodedata.normalize("NFKC", text))
    return _WS.sub(" ", text).strip()


def normalize_words(words: Iterable[str]) -> list[str]:
    """Normalise pre-segmented words one by one (NFKC, controls removed, whitespace collapsed and
    stripped); words that become empty are dropped. The document text is ``"".join(words)``."""
    words = [w.replace(_US, "") for w in words]
    joined = _control_class().sub("", unicodedata.normalize("NFKC", _US.join(words)))
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
