"""The dictionary baseline of the token task (``roformer-finetune --task token --baseline dict``): the
training entities, matched longest first.

The dictionary holds every entity string of the training sentences with its most frequent type (ties: the
type first in sorted order). Tagging a sentence scans it left to right: at each character the longest
dictionary string that starts there is an entity, and the scan goes on after it; where none starts, the
scan moves one character. It needs no tokenizer and no training beyond counting, and it is what a model
must beat to show it learned more than a gazetteer.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from roformer_dist.finetune.entities import Span

__all__ = ["Dictionary"]


class Dictionary:
    def __init__(self) -> None:
        self.types: dict[str, str] = {}
        self.lengths: list[int] = []
        """The entity lengths in characters, longest first."""

    def fit(self, sentences: Iterable[tuple[str, Iterable[Span]]]) -> "Dictionary":
        counts: dict[str, Counter] = {}
        for text, spans in sentences:
            for sp in spans:
                counts.setdefault(text[sp.start:sp.end], Counter())[sp.label] += 1
        self.types = {s: min(c, key=lambda t: (-c[t], t)) for s, c in counts.items()}
        self.lengths = sorted({len(s) for s in self.types}, reverse=True)
        return self

    def __len__(self) -> int:
        return len(self.types)

    def tag(self, text: str) -> list[Span]:
        spans, i = [], 0
        while i < len(text):
            for n in self.lengths:
                label = self.types.get(text[i:i + n]) if i + n <= len(text) else None
                if label is not None:
                    spans.append(Span(i, i + n, label))
                    i += n
                    break
            else:
                i += 1
        return spans
