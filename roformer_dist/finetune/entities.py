"""Entities as character spans: BIO tags to spans, pieces labelled from spans and decoded back, and
entity-level precision / recall / F1.

An entity is a :class:`Span` ``(start, end, label)`` over a sentence's characters, ``end`` exclusive.
Everything the token task measures is measured on these spans, in the characters of the original text:
a model predicts one BIO tag per SentencePiece piece, the predicted pieces are decoded into spans through
their character offsets (:func:`spans_from_pieces`), and a predicted entity counts only when its span and
label equal a gold one's. A gold entity whose first or last character falls inside a piece (a piece that
spans the entity's boundary) can then never be predicted exactly; :func:`label_pieces` counts such pieces
and entities instead of hiding them.

BIO decoding (:func:`spans_from_tags`, :func:`spans_from_pieces`) follows the CoNLL evaluation script and
seqeval's default mode: ``B-X`` starts an entity; ``I-X`` continues an entity of type X and starts one
when the previous tag is ``O`` or of another type; ``O`` ends it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["Span", "OUTSIDE", "split_tag", "bio_labels", "spans_from_tags", "entity_scores", "Alignment",
           "label_pieces", "spans_from_pieces"]

OUTSIDE = "O"


class Span(NamedTuple):
    start: int
    end: int
    label: str


def split_tag(tag: str) -> tuple[str, Optional[str]]:
    """``"B-PER"`` -> ``("B", "PER")``, ``"O"`` -> ``("O", None)``; ValueError for anything else (the
    caller names the file and line)."""
    if tag == OUTSIDE:
        return OUTSIDE, None
    prefix, sep, label = tag.partition("-")
    if not sep or prefix not in ("B", "I") or not label:
        raise ValueError(f"tag {tag!r} is not BIO: expected 'O', 'B-<type>' or 'I-<type>'")
    return prefix, label


def bio_labels(types: Sequence[str]) -> list[str]:
    """The tag set of entity ``types``: ``O`` first, then ``B-X``, ``I-X`` for each type in sorted order."""
    return [OUTSIDE] + [f"{p}-{t}" for t in sorted(set(types)) for p in ("B", "I")]


def _decode(tags: Sequence[str], bounds: Sequence[tuple[int, int]]) -> list[Span]:
    """Spans of BIO ``tags`` where tag i covers the characters ``bounds[i]``."""
    spans: list[Span] = []
    open_label, start, end = None, 0, 0
    for tag, (s, e) in zip(tags, bounds):
        prefix, label = split_tag(tag)
        if prefix == "I" and label == open_label:
            end = e
            continue
        if open_label is not None:
            spans.append(Span(start, end, open_label))
        open_label, start, end = (label, s, e) if prefix != OUTSIDE else (None, 0, 0)
    if open_label is not None:
        spans.append(Span(start, end, open_label))
    return spans


def spans_from_tags(tags: Sequence[str], offsets: Optional[Sequence[tuple[int, int]]] = None) -> list[Span]:
    """The entities of one sentence's BIO tags; ``offsets[i]``: the characters of token i (default: token
    i is position i, so spans count tokens)."""
    return _decode(tags, offsets if offsets is not None else [(i, i + 1) for i in range(len(tags))])


def entity_scores(gold: Sequence[Sequence[Span]], pred: Sequence[Sequence[Span]]) -> dict:
    """Micro-averaged entity precision, recall and F1 over sentences (exact span and label), and the same per
    label: ``{"precision", "recall", "f1", "gold", "predicted", "correct", "per_label": {label: {...}}}``.
    A score whose denominator is 0 is 0."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted")
    counts: dict[str, Counter] = {}
    for g, p in zip(gold, pred):
        g, p = set(g), set(p)
        for span in g:
            counts.setdefault(span.label, Counter())["gold"] += 1
        for span in p:
            counts.setdefault(span.label, Counter())["predicted"] += 1
        for span in g & p:
            counts[span.label]["correct"] += 1

    def prf(c: Counter) -> dict:
        precision = c["correct"] / c["predicted"] if c["predicted"] else 0.0
        recall = c["correct"] / c["gold"] if c["gold"] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f1, "gold": c["gold"],
                "predicted": c["predicted"], "correct": c["correct"]}

    total = sum(counts.values(), Counter())
    return {**prf(total), "per_label": {label: prf(counts[label]) for label in sorted(counts)}}


def _trim(text: str, s: int, e: int) -> tuple[int, int]:
    """A piece's characters without the whitespace at its edges (SentencePiece's word-start marker maps to
    the space before a word)."""
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return s, e


@dataclass
class Alignment:
    """One sentence's pieces against its entities."""
    tags: list[Optional[str]]
    """One BIO tag per piece; None for a piece that covers no character (special tokens, a lone
    word-start marker): it is not trained and not decoded."""
    bounds: list[tuple[int, int]]
    """Each piece's characters (trimmed of whitespace)."""
    crossing_pieces: int
    """Pieces that hold characters both inside and outside one entity."""
    unreachable: int
    """Entities whose first or last character lies inside a piece: no piece tagging gives their span
    (entities no piece reaches, those past a truncation, are not counted here)."""


def label_pieces(text: str, spans: Sequence[Span], offsets: Sequence[tuple[int, int]]) -> Alignment:
    """BIO tags of the pieces with character ``offsets`` (the tokenizer's offset mapping) for the entities
    ``spans`` of ``text``: the first piece that overlaps an entity is ``B-X``, the further pieces that
    overlap it ``I-X``, the rest ``O``. A piece overlapping two entities takes the first."""
    owner = np.full(len(text), -1, np.int64)
    for k, sp in enumerate(spans):
        owner[sp.start:sp.end] = k
    tags: list[Optional[str]] = []
    bounds: list[tuple[int, int]] = []
    begun: set[int] = set()
    reached: set[int] = set()
    crossing = 0
    starts: set[int] = set()
    ends: set[int] = set()
    for s, e in offsets:
        s, e = _trim(text, s, e)
        bounds.append((s, e))
        if s >= e:
            tags.append(None)
            continue
        starts.add(s)
        ends.add(e)
        inside = owner[s:e]
        hit = inside[inside >= 0]
        if hit.size == 0:
            tags.append(OUTSIDE)
            continue
        k = int(hit[0])
        reached.update(int(x) for x in np.unique(hit))
        crossing += int(np.unique(inside).size > 1)
        tags.append(("I-" if k in begun else "B-") + spans[k].label)
        begun.add(k)
    unreachable = sum(1 for k, sp in enumerate(spans) if k in reached and (sp.start not in starts or sp.end not in ends))
    return Alignment(tags, bounds, crossing, unreachable)


def spans_from_pieces(tags: Sequence[Optional[str]], bounds: Sequence[tuple[int, int]]) -> list[Span]:
    """The entities of predicted piece tags, in characters; pieces tagged None are skipped."""
    kept = [(t, b) for t, b in zip(tags, bounds) if t is not None]
    return _decode([t for t, _ in kept], [b for _, b in kept])
