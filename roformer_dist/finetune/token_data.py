"""Token-classification data for ``roformer-finetune --task token``: sentences with entities.

Three formats, each read into one form, a sentence's text and its entities as character spans
(:class:`~roformer_dist.finetune.entities.Span`):

- jsonl (``.jsonl`` / ``.json``), one object per line, either
  ``{"tokens": ["江泽民", "在", "北京"], "tags": ["B-PER", "O", "B-LOC"]}`` (BIO tags, one per token) or
  ``{"text": "江泽民在北京", "entities": [{"start": 0, "end": 3, "label": "PER"}, ...]}`` (character offsets,
  ``end`` exclusive, no two entities overlapping); other keys are ignored, blank lines skipped;
- CoNLL columns (any other file name): one token per line, the token in the first column and its BIO tag
  in the last, separated by whitespace; a blank line ends a sentence; ``-DOCSTART-`` lines are skipped.

Tokens are joined into the sentence's text: without a space where either side is a CJK character or
full-width form (Chinese and Japanese write no spaces), with one space elsewhere. Whitespace at an
entity's edges is not part of it. The entity types are the training file's, sorted.

Every problem is a :class:`~data_pipeline.errors.DataError` naming the file and line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data_pipeline.errors import DataError
from roformer_dist.finetune.data import jsonl_objects, numbered_lines
from roformer_dist.finetune.entities import Span, split_tag, spans_from_tags

__all__ = ["TokenExample", "TokenDataset", "read_token_examples", "entity_types", "join_tokens"]

DOCSTART = "-DOCSTART-"


@dataclass
class TokenExample:
    text: str
    spans: list[Span]
    line: int
    """1-based line number of the sentence (its first line in a CoNLL file)."""


@dataclass
class TokenDataset:
    path: Path
    examples: list[TokenExample]
    task: str = "token"

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_entities(self) -> int:
        return sum(len(e.spans) for e in self.examples)


def _no_space(ch: str) -> bool:
    """CJK ideographs, kana, CJK punctuation and full-width forms: scripts written without spaces."""
    o = ord(ch)
    return 0x2E80 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF or 0xFE30 <= o <= 0xFE4F or 0xFF00 <= o <= 0xFFEF \
        or 0x20000 <= o <= 0x3FFFF


def join_tokens(tokens: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """(text, each token's characters in it): see the module docstring for where a space goes."""
    parts, offsets, pos = [], [], 0
    for i, tok in enumerate(tokens):
        if i and not (_no_space(tokens[i - 1][-1]) or _no_space(tok[0])):
            parts.append(" ")
            pos += 1
        parts.append(tok)
        offsets.append((pos, pos + len(tok)))
        pos += len(tok)
    return "".join(parts), offsets


def _from_tokens(tokens, tags, where: str) -> tuple[str, list[Span]]:
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise DataError(f"{where}: field 'tokens' must be a list of strings")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise DataError(f"{where}: field 'tags' must be a list of strings")
    if len(tokens) != len(tags):
        raise DataError(f"{where}: {len(tokens)} tokens but {len(tags)} tags")
    for i, (tok, tag) in enumerate(zip(tokens, tags)):
        if not tok.strip():
            raise DataError(f"{where}: token {i + 1} is empty or whitespace")
        try:
            split_tag(tag)
        except ValueError as e:
            raise DataError(f"{where}: token {i + 1} ({tok!r}): {e}") from None
    text, offsets = join_tokens(tokens)
    return text, spans_from_tags(tags, offsets)


def _from_entities(text, entities, where: str) -> tuple[str, list[Span]]:
    if not isinstance(text, str):
        raise DataError(f"{where}: field 'text' must be a string, got {type(text).__name__}")
    if not isinstance(entities, list):
        raise DataError(f"{where}: field 'entities' must be a list of {{start, end, label}} objects")
    spans = []
    for i, ent in enumerate(entities):
        what = f"{where}: entities[{i}]"
        if not isinstance(ent, dict) or not {"start", "end", "label"} <= set(ent):
            raise DataError(f"{what}: expected an object with 'start', 'end' and 'label', got {json.dumps(ent)[:80]}")
        s, e, label = ent["start"], ent["end"], ent["label"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (s, e)) or not 0 <= s < e <= len(text):
            raise DataError(f"{what}: start {s!r} and end {e!r} must be integers with 0 <= start < end <= "
                            f"{len(text)} (the text's length in characters)")
        if not isinstance(label, str) or not label or any(c.isspace() for c in label) or label == "O":
            raise DataError(f"{what}: label {label!r} must be a non-empty string without whitespace, not 'O'")
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if s == e:
            raise DataError(f"{what}: the entity covers only whitespace")
        spans.append(Span(s, e, label))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise DataError(f"{where}: entities {text[a.start:a.end]!r} ({a.start}-{a.end}) and "
                            f"{text[b.start:b.end]!r} ({b.start}-{b.end}) overlap; BIO tags cannot express that")
    return text, spans


def _read_jsonl(path: Path) -> list[TokenExample]:
    out = []
    for lineno, where, obj in jsonl_objects(path):
        if "tokens" in obj or "tags" in obj:
            if not {"tokens", "tags"} <= set(obj):
                raise DataError(f"{where}: 'tokens' and 'tags' go together; found only "
                                f"{'tokens' if 'tokens' in obj else 'tags'}")
            text, spans = _from_tokens(obj["tokens"], obj["tags"], where)
        elif "text" in obj:
            text, spans = _from_entities(obj["text"], obj.get("entities", []), where)
        else:
            raise DataError(f"{where}: expected fields 'tokens' and 'tags', or 'text' and 'entities', "
                            f"found {sorted(obj)}")
        out.append(TokenExample(text, spans, lineno))
    return out


def _conll_sentences(path: Path) -> Iterator[tuple[int, list[str], list[str]]]:
    """(first line, tokens, tags) of each sentence of a CoNLL column file."""
    tokens: list[str] = []
    tags: list[str] = []
    first = 0
    with open(path, "rb") as f:
        for lineno, raw in numbered_lines(f, path):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start})") from None
            fields = line.split()
            if not fields or fields[0] == DOCSTART:
                if tokens:
                    yield first, tokens, tags
                tokens, tags = [], []
                continue
            if len(fields) < 2:
                raise DataError(f"{path}:{lineno}: expected a token and its tag separated by whitespace, got "
                                f"{line.strip()[:60]!r}")
            if not tokens:
                first = lineno
            tokens.append(fields[0])
            tags.append(fields[-1])
    if tokens:
        yield first, tokens, tags


def _read_conll(path: Path) -> list[TokenExample]:
    out = []
    for first, tokens, tags in _conll_sentences(path):
        for i, tag in enumerate(tags):
            try:
                split_tag(tag)
            except ValueError as e:
                raise DataError(f"{path}:{first + i}: {e}") from None
        text, offsets = join_tokens(tokens)
        out.append(TokenExample(text, spans_from_tags(tags, offsets), first))
    return out


def read_token_examples(path: str | os.PathLike) -> TokenDataset:
    """Read a jsonl (``.jsonl``/``.json``) or CoNLL column file (anything else)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    examples = (_read_jsonl if jsonl else _read_conll)(path)
    if not examples:
        raise DataError(f"{path}: no sentences (the file is empty)")
    return TokenDataset(path, examples)


def entity_types(train: TokenDataset, dev: TokenDataset) -> tuple[list[str], dict[str, int]]:
    """(the training file's entity types, sorted; {a dev type not among them: its first dev line}). A dev
    entity of an unseen type cannot be predicted: it is scored as missed (the caller says so)."""
    types = sorted({s.label for e in train.examples for s in e.spans})
    if not types:
        raise DataError(f"{train.path}: no entities in {len(train)} sentences; token classification needs "
                        "tagged entities")
    known, unseen = set(types), {}
    for e in dev.examples:
        for s in e.spans:
            if s.label not in known:
                unseen.setdefault(s.label, e.line)
    return types, unseen
