"""Accuracy and macro-F1 of label predictions."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["accuracy", "macro_f1"]


def accuracy(gold: Sequence[int], pred: Sequence[int]) -> float:
    gold, pred = np.asarray(gold), np.asarray(pred)
    return float((gold == pred).mean()) if gold.size else 0.0


def macro_f1(gold: Sequence[int], pred: Sequence[int]) -> float:
    """Unweighted mean of per-label F1 over the labels that occur in ``gold`` or ``pred``
    (F1 = 2 TP / (2 TP + FP + FN); a label predicted but never right scores 0)."""
    gold, pred = np.asarray(gold), np.asarray(pred)
    labels = np.union1d(gold, pred)
    if labels.size == 0:
        return 0.0
    f1 = []
    for c in labels:
        tp = np.sum((pred == c) & (gold == c))
        fp = np.sum((pred == c) & (gold != c))
        fn = np.sum((pred != c) & (gold == c))
        f1.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(f1))
