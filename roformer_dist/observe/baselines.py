"""Context-free baselines for masked-LM evaluation: what a model that ignores context would score.

A pretrained model is only worth something if it beats these at the very positions it is asked to
predict, so they are computed on the same eval batches (same masks) as the model's eval:

- the **unigram model**: token frequencies counted on the *training* shards with add-one smoothing
  over the predictable vocabulary (every id except the special tokens, which are never labels):
  ``p(t) = (count(t) + 1) / (N + V')``. Its cross-entropy at the predicted positions is the loss a
  model reaches by learning nothing but token frequencies;
- the **most-frequent-token accuracy**: always predicting the training set's most frequent token.

A corpus mixture's unigram model weighs each source's frequencies by its share of the run's
tokens (:func:`count_mixture`). Counting reads the shards once. For big shard sets the cost is bounded by ``max_tokens``: whole
shards are read in a seeded random order until that many tokens were counted (the unigram
distribution of tens of millions of tokens is as good as that of billions for this purpose).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from data_pipeline.masking import IGNORE_INDEX

DEFAULT_MAX_TOKENS = 50_000_000
"""Cap on the training tokens counted for the unigram model (whole shards, seeded order)."""


@dataclass(frozen=True)
class UnigramModel:
    """Add-one smoothed token frequencies of a training shard set."""

    counts: np.ndarray
    """int64 [vocab_size]: occurrences of each id in the counted shards (0 for special ids)."""
    special_ids: tuple[int, ...]
    """Ids that are never predicted (excluded from the distribution)."""
    num_shards_counted: int
    """Shards read (all of them unless ``max_tokens`` cut the count short)."""
    num_shards: int
    """Shards in the set."""

    @property
    def vocab_size(self) -> int:
        return int(self.counts.size)

    @property
    def num_tokens(self) -> int:
        """Tokens counted (special ids excluded)."""
        return int(self.counts.sum())

    @property
    def log_probs(self) -> np.ndarray:
        """float64 [vocab_size]: smoothed log-probabilities; -inf at the special ids."""
        predictable = np.ones(self.vocab_size, bool)
        predictable[list(self.special_ids)] = False
        denom = float(self.counts.sum() + predictable.sum())
        with np.errstate(divide="ignore"):
            return np.where(predictable, np.log((self.counts + 1.0) / denom), -np.inf)

    @property
    def most_frequent(self) -> int:
        """The most frequent non-special id (the lowest id among ties)."""
        return int(self.counts.argmax())


def count_tokens(shards: str | os.PathLike, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0) -> UnigramModel:
    """Count token ids of a shard set, a directory or a URL prefix (at most ``max_tokens``: whole shards
    in a seeded order)."""
    from data_pipeline.shards import load_shard, read_manifest

    if max_tokens <= 0:
        raise ValueError(f"max_tokens: expected a positive integer, got {max_tokens}")
    m = read_manifest(shards)
    entries = m["shards"]
    order = np.arange(len(entries))
    if m["num_tokens"] > max_tokens:
        order = np.random.default_rng([seed, 0x0B16]).permutation(len(entries))
    counts = np.zeros(int(m["vocab_size"]), np.int64)
    read = 0
    for i in order:
        data = load_shard(shards, m, int(i))
        if data.num_docs:
            # token ids of every document (the shard buffer also holds tar headers between them)
            ids = np.concatenate([data.tokens[s:s + n] for s, n in zip(data.tok_start, data.lengths)])
            counts += np.bincount(ids.astype(np.int64), minlength=counts.size)[:counts.size]
        read += 1
        if counts.sum() >= max_tokens:
            break
    special = tuple(sorted(int(v) for v in m["special_ids"].values()))
    counts[list(special)] = 0
    return UnigramModel(counts, special, read, len(entries))


def count_mixture(sources: dict, max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0) -> UnigramModel:
    """The unigram model of a corpus mixture: ``sources`` maps a shard set to its share of the training
    tokens; each set is counted (at most ``max_tokens`` x its share) and its frequencies are weighed by
    its share, as the training stream mixes them. One set: :func:`count_tokens`."""
    if len(sources) == 1:
        return count_tokens(next(iter(sources)), max_tokens, seed)
    parts = [(count_tokens(shards, max(1, int(max_tokens * share)), seed), share)
             for shards, share in sources.items() if share > 0]
    total = sum(u.num_tokens for u, _ in parts)
    mixed = sum(u.counts / max(1, u.num_tokens) * share for u, share in parts)
    counts = np.rint(mixed / sum(share for _, share in parts) * total).astype(np.int64)
    first = parts[0][0]
    return UnigramModel(counts, first.special_ids, sum(u.num_shards_counted for u, _ in parts),
                        sum(u.num_shards for u, _ in parts))


class BaselineSums:
    """Running sums of the baselines over eval batches: call ``add(labels)`` per batch."""

    def __init__(self, model: UnigramModel):
        self.log_probs = model.log_probs
        self.top = model.most_frequent
        self.nll = 0.0
        self.hits = 0
        self.count = 0

    def add(self, labels) -> None:
        """``labels``: int array/tensor [B, S], -100 where nothing is predicted."""
        labels = np.asarray(labels).reshape(-1)
        target = labels[labels != IGNORE_INDEX]
        if target.size == 0:
            return
        if target.min() < 0 or target.max() >= self.log_probs.size:
            raise ValueError(f"labels: ids outside the vocabulary [0, {self.log_probs.size}) of the training "
                             "shards (eval shards of another tokenizer?)")
        self.nll -= float(self.log_probs[target].sum())
        self.hits += int((target == self.top).sum())
        self.count += int(target.size)

    @property
    def unigram_loss(self) -> float:
        """Mean cross-entropy (nats) of the unigram model at the predicted positions."""
        return self.nll / max(1, self.count)

    @property
    def most_frequent_acc(self) -> float:
        """Accuracy of always predicting the most frequent training token."""
        return self.hits / max(1, self.count)


__all__ = ["UnigramModel", "count_tokens", "count_mixture", "BaselineSums", "DEFAULT_MAX_TOKENS"]
