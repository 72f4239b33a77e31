"""Named entities from the tags of People's Daily 1998 (``word/tag  word/tag``), the source of the classic
People's Daily NER sets: ``nr`` (person names) -> PER, ``ns`` (place names) -> LOC, ``nt`` (organisation
names) -> ORG. The corpus tags a Chinese name as surname and given name (``江/nr  泽民/nr``): consecutive
``nr`` words are one person. A line (a paragraph) is split into sentences after ``。``, ``！`` and ``？``.
Words are normalised as the shard builder normalises them (:func:`~data_pipeline.normalization.normalize`) and
joined without spaces; entities are character spans of that text, ``end`` exclusive.

    from data_pipeline.pd_ner import ner_sentences
    ner_sentences("中共中央/nt  总书记/n  江/nr  泽民/nr  。/w")
    # [("中共中央总书记江泽民。", [(0, 4, "ORG"), (7, 10, "PER")])]
"""

from __future__ import annotations

import re

from .normalization import normalize

__all__ = ["ENTITY_TAGS", "ner_sentences"]

ENTITY_TAGS = {"nr": "PER", "ns": "LOC", "nt": "ORG"}
SENTENCE_END = frozenset("。！？")
_WORD = re.compile(r"^\[?(.+)/([A-Za-z]+)(?:\][A-Za-z]*)?$")   # [word/tag  word/tag  word/tag]nt


def ner_sentences(line: str) -> list[tuple[str, list[tuple[int, int, str]]]]:
    """(text, entities) of each sentence of one tagged line; a token that is not ``word/tag`` is kept as
    a word outside any entity."""
    out: list[tuple[str, list[tuple[int, int, str]]]] = []
    parts: list[str] = []
    spans: list[tuple[int, int, str]] = []
    pos, prev = 0, None

    def close() -> None:
        nonlocal parts, spans, pos, prev
        if parts:
            out.append(("".join(parts), spans))
        parts, spans, pos, prev = [], [], 0, None

    for token in line.split():
        m = _WORD.match(token)
        word, tag = (m.group(1), m.group(2)) if m else (token, "")
        word = normalize(word)
        if not word:
            continue
        label = ENTITY_TAGS.get(tag)
        if label == "PER" and prev == "nr" and spans and spans[-1][1] == pos:
            spans[-1] = (spans[-1][0], pos + len(word), label)
        elif label is not None:
            spans.append((pos, pos + len(word), label))
        parts.append(word)
        pos += len(word)
        prev = tag
        if word in SENTENCE_END:
            close()
    close()
    return out
