"""The bag-of-character-n-grams baseline: multinomial naive Bayes on character unigrams and bigrams with
add-one (Laplace) smoothing, in numpy.

Texts are normalised like the pretraining corpus (:func:`data_pipeline.corpus.normalize`). A pair
contributes the n-grams of both sentences (no bigram across them). Features never seen in training are
ignored at prediction time.

    log P(c | x) ∝ log P(c) + sum_f n_f(x) log P(f | c),   P(f | c) = (count(f, c) + 1) / (count(c) + |V|)
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from data_pipeline.corpus import normalize

__all__ = ["char_ngrams", "NaiveBayes"]


def char_ngrams(text: str) -> list[str]:
    """Character unigrams and bigrams of the normalised text."""
    t = normalize(text)
    return list(t) + [t[i:i + 2] for i in range(len(t) - 1)]


def _features(a: str, b: Optional[str]) -> list[str]:
    return char_ngrams(a) + (char_ngrams(b) if b is not None else [])


class NaiveBayes:
    """Multinomial naive Bayes with add-one smoothing over a string feature vocabulary."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.log_prior: Optional[np.ndarray] = None     # (C,)
        self.log_prob: Optional[np.ndarray] = None      # (C, V)

    def _index(self, docs: Sequence[list[str]], grow: bool) -> tuple[np.ndarray, np.ndarray]:
        """Flat feature indices of all documents and the document each belongs to (unknown ones dropped)."""
        idx, owner = [], []
        for d, feats in enumerate(docs):
            for f in feats:
                i = self.vocab.get(f)
                if i is None and grow:
                    i = self.vocab[f] = len(self.vocab)
                if i is not None:
                    idx.append(i)
                    owner.append(d)
        return np.asarray(idx, np.int64), np.asarray(owner, np.int64)

    def fit(self, texts: Sequence[tuple[str, Optional[str]]], labels: Sequence[int], num_labels: int) -> "NaiveBayes":
        docs = [_features(a, b) for a, b in texts]
        y = np.asarray(labels, np.int64)
        idx, owner = self._index(docs, grow=True)
        V = len(self.vocab)
        counts = np.bincount(y[owner] * V + idx, minlength=num_labels * V).reshape(num_labels, V).astype(np.float64)
        self.log_prob = np.log(counts + 1.0) - np.log(counts.sum(1, keepdims=True) + V)
        prior = np.bincount(y, minlength=num_labels).astype(np.float64)
        with np.errstate(divide="ignore"):  # a label absent from training gets log 0 = -inf: never predicted
            self.log_prior = np.log(prior / prior.sum())
        return self

    def scores(self, texts: Sequence[tuple[str, Optional[str]]]) -> np.ndarray:
        """(N, C) unnormalised log posteriors."""
        idx, owner = self._index([_features(a, b) for a, b in texts], grow=False)
        n = len(texts)
        out = np.tile(self.log_prior, (n, 1))
        for c in range(self.log_prob.shape[0]):
            out[:, c] += np.bincount(owner, weights=self.log_prob[c, idx], minlength=n)
        return out

    def predict(self, texts) -> np.ndarray:
        return self.scores(texts).argmax(1)

    def mean_nll(self, texts, labels: Sequence[int]) -> float:
        """Mean negative log posterior of the true labels (the baseline's 'training loss')."""
        s = self.scores(texts)
        m = s.max(1, keepdims=True)
        log_z = (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]
        return float(np.mean(log_z - s[np.arange(len(s)), np.asarray(labels)]))
