"""What differs between a sentence task and the token task, for the one fine-tuning loop (``train.fit``):
how examples become token ids and targets, the loss, the predictions and the dev scores.

- :class:`SequenceTask`: one label per example (``[CLS] a [SEP] (b [SEP])``); cross-entropy of the
  example's logits; dev accuracy and macro-F1 (the best epoch: accuracy, then macro-F1).
- :class:`TokenTask`: one BIO tag per SentencePiece piece, derived from the entities' character spans
  through the tokenizer's offsets (:func:`~roformer_dist.finetune.entities.label_pieces`); cross-entropy
  over the pieces that cover a character (special tokens and lone word-start markers are ignored); dev
  entity precision, recall and F1, exact spans in the original characters, against every gold entity
  (those cut off by ``--max-length`` and those no piece boundary can express count as missed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline.masking import IGNORE_INDEX
from roformer_dist.finetune.entities import entity_scores, label_pieces, spans_from_pieces
from roformer_dist.finetune.metrics import accuracy, macro_f1

__all__ = ["Encoded", "encode", "SequenceTask", "TokenTask", "encode_token_examples"]


@dataclass
class Encoded:
    ids: list[list[int]]
    type_ids: list[list[int]]
    labels: Any
    """Sequence task: int64 array (N,); token task: one int64 array per example, a tag id per piece
    (IGNORE_INDEX where a piece is not trained)."""
    num_truncated: int

    def __len__(self) -> int:
        return len(self.ids)


def encode(tokenizer, examples, labels: list[int], max_length: int) -> Encoded:
    """Token ids ([CLS] a [SEP] (b [SEP])) truncated to ``max_length``; counts what was truncated."""
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    full = tokenizer(a, b, add_special_tokens=True, truncation=False, return_attention_mask=False,
                     return_token_type_ids=False, verbose=False)["input_ids"]
    enc = tokenizer(a, b, add_special_tokens=True, truncation=True, max_length=max_length,
                    return_attention_mask=False, return_token_type_ids=True)
    num_truncated = sum(len(x) > max_length for x in full)
    return Encoded(enc["input_ids"], enc["token_type_ids"], np.asarray(labels, np.int64), num_truncated)


class SequenceTask:
    """One label per example."""

    selects = ("dev_accuracy", "dev_macro_f1")
    """The dev scores that choose the best epoch, in order."""

    def __init__(self, dev: Encoded):
        self.dev = dev

    @staticmethod
    def targets(data: Encoded, idx: np.ndarray, width: int) -> torch.Tensor:
        return torch.as_tensor(data.labels[idx])

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), y)

    @staticmethod
    def predictions(logits: torch.Tensor, data: Encoded, idx: np.ndarray) -> list:
        return logits.argmax(-1).cpu().tolist()

    def scores(self, pred: list) -> dict:
        return {"dev_accuracy": accuracy(self.dev.labels, pred), "dev_macro_f1": macro_f1(self.dev.labels, pred)}

    @staticmethod
    def describe(rec: dict) -> str:
        return f"dev accuracy {rec['dev_accuracy']:.4f}  macro-F1 {rec['dev_macro_f1']:.4f}"


@dataclass
class TokenAlignment:
    """The pieces of one encoded example against its sentence (what decoding a prediction needs)."""
    tagged: np.ndarray
    """bool per piece: the piece covers a character (it has a tag)."""
    bounds: list[tuple[int, int]]
    crossing_pieces: int
    unreachable: int
    truncated_entities: int


def encode_token_examples(tokenizer, examples, tags: Sequence[str], max_length: int
                          ) -> tuple[Encoded, list[TokenAlignment]]:
    """Pieces of each sentence ([CLS] text [SEP], truncated to ``max_length``) with their tag ids."""
    tag_id = {t: i for i, t in enumerate(tags)}
    texts = [e.text for e in examples]
    enc = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length,
                    return_offsets_mapping=True, return_attention_mask=False, return_token_type_ids=True)
    full = tokenizer(texts, add_special_tokens=True, truncation=False, return_attention_mask=False,
                     return_token_type_ids=False, verbose=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    labels, aligned = [], []
    for ex, ids, offsets in zip(examples, enc["input_ids"], enc["offset_mapping"]):
        offsets = [(0, 0) if i in special else tuple(o) for i, o in zip(ids, offsets)]
        al = label_pieces(ex.text, ex.spans, offsets)
        # a tag of a type outside ``tags`` (a dev entity of a type training never saw) is O: never predicted
        labels.append(np.asarray([IGNORE_INDEX if t is None else tag_id.get(t, 0) for t in al.tags], np.int64))
        covered = max((e for s, e in al.bounds if e > s), default=0)
        aligned.append(TokenAlignment(np.asarray([t is not None for t in al.tags]), al.bounds, al.crossing_pieces,
                                      al.unreachable, sum(1 for sp in ex.spans if sp.end > covered)))
    num_truncated = sum(len(x) > max_length for x in full)
    return Encoded(enc["input_ids"], enc["token_type_ids"], labels, num_truncated), aligned


class TokenTask:
    """One BIO tag per piece; scored as entities."""

    selects = ("dev_f1", "dev_precision")

    def __init__(self, alignments: list[TokenAlignment], gold: list, tags: Sequence[str]):
        """``alignments``: the dev examples' (encode_token_examples); ``gold``: their entity spans."""
        self.alignments, self.gold, self.tags = alignments, gold, list(tags)

    @staticmethod
    def targets(data: Encoded, idx: np.ndarray, width: int) -> torch.Tensor:
        y = torch.full((len(idx), width), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(idx):
            y[row, :len(data.labels[i])] = torch.as_tensor(data.labels[i])
        return y

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)

    @staticmethod
    def predictions(logits: torch.Tensor, data: Encoded, idx: np.ndarray) -> list:
        best = logits.argmax(-1).cpu().numpy()
        return [best[row, :len(data.ids[i])] for row, i in enumerate(idx)]

    def spans(self, pred: list) -> list:
        """Each dev sentence's predicted entities (character spans)."""
        out = []
        for p, al in zip(pred, self.alignments):
            tags: list[Optional[str]] = [self.tags[k] if ok else None for k, ok in zip(p, al.tagged)]
            out.append(spans_from_pieces(tags, al.bounds))
        return out

    def scores(self, pred: list) -> dict:
        s = entity_scores(self.gold, self.spans(pred))
        return {"dev_f1": s["f1"], "dev_precision": s["precision"], "dev_recall": s["recall"],
                "dev_per_label": s["per_label"]}

    @staticmethod
    def describe(rec: dict) -> str:
        return (f"dev entity F1 {rec['dev_f1']:.4f}  precision {rec['dev_precision']:.4f}  "
                f"recall {rec['dev_recall']:.4f}")
