"""Preparation split over tasks (data_pipeline.cluster, launcher.prepare): local processes and, with
the localhost SLURM cluster, a real job array; the merged set equals the single-process build document
for document, and a failing task leaves nothing behind."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher import prepare as cli
from data_pipeline.errors import EXIT_DATA
from data_pipeline.manifest import read_manifest
from data_pipeline.shards import load_shard, verify_shard_set

ROOT = Path(__file__).resolve().parent.parent


def documents(d: Path) -> list[tuple[bytes, bytes]]:
    """(ids, word marks) of every document of a set, in manifest order."""
    m = read_manifest(d)
    out = []
    for i in range(len(m["shards"])):
        sd = load_shard(d, m, i)
        for s, n, w in zip(sd.tok_start.tolist(), sd.lengths.tolist(), sd.wwm_start.tolist()):
            out.append((sd.tokens[s:s + n].tobytes(), sd.marks[w:w + n].tobytes()))
    return out


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, peoples_daily):
    """Four files: two small, one large enough to be cut into line ranges, one .gz (never cut)."""
    lines = open(peoples_daily, encoding="utf-8").readlines()
    d = tmp_path_factory.mktemp("cluster_corpus") / "in"
    d.mkdir()
    (d / "a.txt").write_text("".join(lines[:200]), encoding="utf-8")
    (d / "b.txt").write_text("".join(lines[200:260]), encoding="utf-8")
    (d / "c.txt").write_text("".join(lines[260:1200]), encoding="utf-8")
    with gzip.open(d / "d.txt.gz", "wt", encoding="utf-8") as f:
        f.write("".join(lines[1200:1300]))
    return d


def _prepare(corpus, out, *extra):
    return ["prepare", "--input", str(corpus), "--vocab-size", "3000", "--num-threads", "2", "--out", str(out),
            "--max-docs-per-shard", "150", "--sample-docs", "2000", *extra]


def _single(corpus, tokenizer, out):
    assert cli.main(["shards", "--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
                     "--workers", "1", "--no-progress", "--max-docs-per-shard", "150"]) == 0
    return documents(out)


def test_local_tasks_merge_into_the_single_process_set(corpus_dir, tmp_path, capsys):
    out = tmp_path / "set"
    assert cli.main(_prepare(corpus_dir, out, "--cluster", "local", "--tasks", "3")) == 0
    text = capsys.readouterr().out
    for t in (1, 2, 3):
        assert f"task {t}/3 done: " in text
    assert "prepared " in text and "3 task(s)" in text and "MB/s overall" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]                 # nothing beside it
    assert cli.main(["inspect", "--verify", str(out)]) == 0
    m = read_manifest(out)
    assert m["tasks"] == 3 and [e["name"] for e in m["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(m["shards"]))]
    single = _single(corpus_dir, out / "tokenizer.model", tmp_path / "single")
    assert documents(out) == single and len(single) == 1300
    assert m["num_tokens"] == read_manifest(tmp_path / "single")["num_tokens"]


def test_a_failing_task_leaves_the_old_set_and_nothing_else(corpus_dir, tmp_path, capsys):
    src = tmp_path / "in"
    shutil.copytree(corpus_dir, src)
    with open(src / "b.txt", "ab") as f:
        f.write(b"\xff\xfe broken\n")
    out = tmp_path / "set"
    out.mkdir()
    (out / "manifest.json").write_text("{}")                 # stands for an existing set
    before = sorted(p.name for p in tmp_path.iterdir())
    # the tokenizer's sample (5 documents per file) does not reach the bad line: a task meets it
    assert cli.main(_prepare(src, out, "--cluster", "local", "--tasks", "2", "--strict", "--force",
                             "--sample-docs", "20")) == EXIT_DATA
    err = capsys.readouterr().err
    assert "task 1/2" in err and f"{src / 'b.txt'}:61: invalid UTF-8" in err
    assert (out / "manifest.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == before


def test_plan_cuts_large_plain_files_at_lines_and_keeps_the_order(corpus_dir):
    from data_pipeline.cluster import Spec, plan
    from data_pipeline.corpus import InputRange, read_documents

    tasks = plan(Spec((str(corpus_dir),)), 4)
    assert len(tasks) == 4
    units = [u for t in tasks for u in t.units]
    assert any(isinstance(u, InputRange) and u.path.name == "c.txt" for u in units)
    assert not any(isinstance(u, InputRange) and u.path.name.endswith(".gz") for u in units)
    assert [d.text for d in read_documents(units)] == [d.text for d in read_documents(corpus_dir)]
    sizes = [t.num_bytes for t in tasks]
    assert max(sizes) < 2.2 * sum(sizes) / 4


def _slurm_problem():
    try:
        from test_slurm import PROBLEM
    except Exception as e:  # noqa: BLE001
        return f"cannot check the SLURM cluster: {e}"
    return PROBLEM


@pytest.mark.slurm
def test_slurm_job_array_merges_into_the_single_process_set(corpus_dir, tmp_path):
    problem = _slurm_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "set"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "launcher.prepare", *_prepare(corpus_dir, out, "--slurm", "--profile",
                                                                          "local", "--tasks", "2", "--time", "10")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "(slurm, job " in p.stdout and "task 2/2 done" in p.stdout
    assert verify_shard_set(out) == []
    assert documents(out) == _single(corpus_dir, out / "tokenizer.model", tmp_path / "single")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["set", "single"]
