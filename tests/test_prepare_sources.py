"""``roformer-data prepare --source NAME=INPUT ...``: a corpus mixture, one shard set per source sharing one
tokenizer trained on a weighted sample of all sources (data_pipeline.cli)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import yaml

from data_pipeline import cli
from data_pipeline.errors import EXIT_DATA, EXIT_USAGE
from data_pipeline.tokenizer import sha256_file

LINES = 250


def _lines(src, n: int) -> list[str]:
    """The first ``n`` lines of ``src`` that hold text (one document each)."""
    out = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            if len(line.strip()) >= 8:
                out.append(line.strip() + "\n")
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, peoples_daily, reviews):
    d = tmp_path_factory.mktemp("sources")
    (d / "news.txt").write_text("".join(_lines(peoples_daily, LINES)), encoding="utf-8")
    (d / "reviews").mkdir()
    pos = _lines(reviews[0], LINES)
    (d / "reviews" / "a.txt").write_text("".join(pos[:100]), encoding="utf-8")
    (d / "reviews" / "b.txt").write_text("".join(pos[100:]), encoding="utf-8")
    return d


def _prepare(out, *args) -> list[str]:
    return ["prepare", "--vocab-size", "2000", "--character-coverage", "0.98", "--num-threads", "2",
            "--workers", "1", "--no-progress", "--out", str(out), *args]


def _sources(corpora) -> list[str]:
    return ["--source", f"news={corpora / 'news.txt'}", "--source", f"reviews={corpora / 'reviews' / 'a.txt'}",
            "--source", f"reviews={corpora / 'reviews' / 'b*.txt'}"]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, corpora):
    out = tmp_path_factory.mktemp("mix") / "data" / "mix"
    buf = io.StringIO()                               # capsys is function-scoped: capture by hand
    with contextlib.redirect_stdout(buf):
        rc = cli.main(_prepare(out, *_sources(corpora), "--tokenizer-weights", "news=0.7,reviews=0.3"))
    assert rc == 0
    return out, buf.getvalue()


def test_two_sources_share_one_tokenizer_and_verify(mixture, capsys):
    out, printed = mixture
    assert sorted(p.name for p in out.iterdir()) == ["news", "reviews", "tokenizer.model", "tokenizer.vocab"]
    sha = sha256_file(out / "tokenizer.model")
    for name, docs in (("news", LINES), ("reviews", LINES)):
        m = json.loads((out / name / "manifest.json").read_text())
        assert m["tokenizer"]["sha256"] == sha
        assert m["num_docs"] == docs
        assert cli.main(["inspect", "--verify", "--samples", "0", str(out / name)]) == 0
    assert "verify: OK" in capsys.readouterr().out
    block = printed[printed.index("data:\n"):]
    assert yaml.safe_load(block) == {"data": {"sources": [{"name": "news", "shards": str(out / "news")},
                                                          {"name": "reviews", "shards": str(out / "reviews")}]}}
    assert "weight: W" in printed and "tokenizer sample (weights news=0.7, reviews=0.3)" in printed
    assert not list(out.parent.glob(".mix.partial-*"))


def test_an_existing_mixture_needs_force(mixture, tmp_path, corpora, capsys):
    out = tmp_path / "mix"
    shutil.copytree(mixture[0], out)
    assert cli.main(_prepare(out, *_sources(corpora)[:2])) == EXIT_USAGE
    assert "a mixture is already there" in capsys.readouterr().err
    assert cli.main(_prepare(out, *_sources(corpora)[:2], "--force")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["news", "tokenizer.model", "tokenizer.vocab"]
    assert "tokenizer sample (by size)" in capsys.readouterr().out


def _usage(tmp_path, capsys, *args) -> str:
    assert cli.main(_prepare(tmp_path / "out", *args)) == EXIT_USAGE
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_input_and_source_together_or_neither(tmp_path, corpora, capsys):
    err = _usage(tmp_path, capsys, "--input", str(corpora / "news.txt"), "--source", f"a={corpora / 'news.txt'}")
    assert "--input and --source" in err
    assert "--input FILES" in _usage(tmp_path, capsys)


@pytest.mark.parametrize("value, named", [("bad.name=x.txt", "'bad.name'"), ("=x.txt", "''"),
                                          ("news", "--source news"), ("news=", "--source news=")])
def test_a_bad_source_is_named(tmp_path, capsys, value, named):
    assert named in _usage(tmp_path, capsys, "--source", value)


@pytest.mark.parametrize("weights, named", [("news=1,other=1", "'other'"), ("news=0,reviews=1", "'news=0'"),
                                            ("news=-1,reviews=1", "'news=-1'"), ("news=a,reviews=1", "'news=a'"),
                                            ("news=nan,reviews=1", "'news=nan'"), ("news=1", "reviews"),
                                            ("news", "'news'")])
def test_bad_tokenizer_weights_are_named(tmp_path, corpora, capsys, weights, named):
    err = _usage(tmp_path, capsys, *_sources(corpora), "--tokenizer-weights", weights)
    assert "--tokenizer-weights" in err and named in err


def test_weights_without_sources_and_sources_over_tasks_are_refused(tmp_path, corpora, capsys):
    assert "--source" in _usage(tmp_path, capsys, "--input", str(corpora / "news.txt"), "--tokenizer-weights", "a=1")
    err = _usage(tmp_path, capsys, *_sources(corpora), "--tasks", "2")
    assert "roformer-data tokenizer" in err and "shards --tokenizer" in err
    assert "--slurm" in _usage(tmp_path, capsys, *_sources(corpora), "--slurm")


def test_a_missing_source_input_is_named(tmp_path, corpora, capsys):
    missing = tmp_path / "nowhere.txt"
    rc = cli.main(_prepare(tmp_path / "out", "--source", f"news={corpora / 'news.txt'}", "--source", f"b={missing}"))
    assert rc == EXIT_DATA
    assert "nowhere.txt" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_failing_source_leaves_nothing(tmp_path, corpora, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n", encoding="utf-8")
    rc = cli.main(_prepare(tmp_path / "out", "--source", f"news={corpora / 'news.txt'}", "--source", f"e={empty}"))
    assert rc == EXIT_DATA and "empty.txt" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [empty]


def test_the_tokenizer_sample_follows_the_weights():
    a = [("甲" * (5 + i % 17)) for i in range(4000)]
    b = [("乙" * (30 + i % 50)) for i in range(4000)]
    counts: dict = {}
    texts = list(cli.weighted_interleave({"a": a, "b": b}, {"a": 3, "b": 1}, counts))
    chars_a, chars_b = counts["a"][1], counts["b"][1]
    assert sum(t.count("甲") for t in texts) == chars_a and sum(t.count("乙") for t in texts) == chars_b
    assert chars_a / chars_b == pytest.approx(3, rel=0.01)
    assert counts["a"][0] == len(a) and counts["b"][0] < len(b)     # stops when the first source runs out
    # interleaved all along, not one source after the other: every prefix keeps the shares too
    prefix = texts[:len(texts) // 4]
    assert sum(t.count("甲") for t in prefix) / sum(t.count("乙") for t in prefix) == pytest.approx(3, rel=0.05)


def test_the_default_sample_is_every_source_whole():
    counts: dict = {}
    assert list(cli.weighted_interleave({"a": ["x", "yy"], "b": ["zzz"]}, None, counts)) == ["x", "yy", "zzz"]
    assert counts == {"a": [2, 3], "b": [1, 3]}


def test_an_empty_weighted_source_is_named():
    from data_pipeline.errors import DataError

    with pytest.raises(DataError, match="'b'"):
        list(cli.weighted_interleave({"a": ["x"] * 5, "b": []}, {"a": 1, "b": 1}))
