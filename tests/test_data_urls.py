"""Shard sets read from URLs (webdataset's opener): a real HTTP server on localhost (tests/http_server.py),
``pipe:cat``; transient failures retried with back-off, permanent ones naming the URL; the same batches,
resume and elastic resume as from the directory; the trainer's loss trace over HTTP equals the local one."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from data_pipeline import cli
from data_pipeline.errors import DataError
from data_pipeline.loader import ShardLoader
from data_pipeline.manifest import check_training_data, read_manifest
from data_pipeline.shards import CorruptShardError
from data_pipeline.source import RetryPolicy

HERE = Path(__file__).resolve().parent
FAST = RetryPolicy(attempts=4, wait_s=0.05)
KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels")


@contextmanager
def http_server(root: Path, *fail: str):
    """Serve ``root`` on 127.0.0.1; yields the base URL. ``fail``: "N:REGEX" (the first N requests of each
    matching path get HTTP 500)."""
    port_file = root.parent / f".port-{os.getpid()}-{time.monotonic_ns()}"
    args = [a for f in fail for a in ("--fail", f)]
    proc = subprocess.Popen([sys.executable, str(HERE / "http_server.py"), str(root), str(port_file), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        proc.kill()
        proc.wait()
        port_file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def web_root(small_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    (root / "train").symlink_to(small_shards.dir)
    (root / "eval").symlink_to(small_shards.eval_dir)
    return root


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def test_http_and_pipe_give_the_directory_s_batches_state_and_verify(small_shards, web_root, capsys):
    kw = dict(seq_len=64, micro_batch_size=2, num_workers=2, seed=4)
    local = ShardLoader(small_shards.dir, **kw)
    want = _take(local, 12)
    with http_server(web_root) as base:
        url = f"{base}/train"
        remote = ShardLoader(url, retry=FAST, **kw)
        assert remote.manifest == local.manifest
        got = _take(remote, 8)
        assert _same(got, want[:8])
        # the state of an HTTP run resumes from the directory (and the other way): same shard set
        resumed = ShardLoader(small_shards.dir, **kw)
        resumed.load_state_dict(remote.state_dict())
        assert _same(_take(resumed, 4), want[8:12])
        assert cli.main(["inspect", "--verify", url, "--samples", "1"]) == 0
        out = capsys.readouterr().out
        assert "verify: OK (8 shards re-hashed and parsed, totals match, tokenizer agrees)" in out
        assert "doc 0 (" in out                                  # decoded with the tokenizer read over HTTP
        m = check_training_data(url, f"{base}/eval")
        assert m["vocab_size"] == small_shards.vocab_size
    pipe = f"pipe:cat {small_shards.dir}"
    assert _same(_take(ShardLoader(pipe, retry=FAST, **kw), 4), want[:4])
    assert cli.main(["inspect", "--verify", pipe, "--samples", "0"]) == 0
    braces = f"pipe:cat {small_shards.dir}/{{name}}"               # {name}: where the file name goes
    assert read_manifest(braces) == local.manifest


def test_elastic_resume_over_http(small_shards, web_root):
    """2 ranks read over HTTP, then 1 rank resumes from their states (the elastic rule): the same
    batches as the same resume from the directory."""
    kw = dict(seq_len=64, micro_batch_size=2, seed=5, max_epochs=1, num_workers=1)
    with http_server(web_root) as base:
        url = f"{base}/train"
        ranks = [ShardLoader(url, dp_rank=r, dp_size=2, retry=FAST, **kw) for r in range(2)]
        for ld in ranks:
            _take(ld, 5)
        states = [ld.state_dict() for ld in ranks]
        one = ShardLoader(url, retry=FAST, **kw)
        one.load_state_dict(states)
        rest = _take(one, 20)
    local = ShardLoader(small_shards.dir, **kw)
    local.load_state_dict(states)
    assert _same(rest, _take(local, 20))


def test_transient_500s_are_retried_with_back_off_and_logged(small_shards, web_root, caplog):
    kw = dict(seq_len=64, micro_batch_size=2, num_workers=0, seed=4, max_epochs=1)
    want = list(ShardLoader(small_shards.dir, **kw))
    with http_server(web_root, r"2:shard-00000[35]\.tar", r"2:manifest\.json") as base:
        with caplog.at_level(logging.WARNING):
            got = list(ShardLoader(f"{base}/train", retry=FAST, **kw))
    assert _same(got, want)
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 6, retries                          # 2 for the manifest, 2 for each of 2 shards
    assert any(f"{base}/train/shard-000003.tar failed: HTTP 500 (attempt 2 of 4); retrying in 0.1 s" in m
               for m in retries), retries
    with http_server(web_root, r"9:shard-000001\.tar") as base:  # more failures than attempts
        with pytest.raises(CorruptShardError, match=rf"cannot read {base}/train/shard-000001\.tar: HTTP 500 "
                                                    r"\(gave up after 4 attempts\)"):
            list(ShardLoader(f"{base}/train", retry=FAST, **kw))


def test_permanent_failures_name_the_url_and_are_not_retried(small_shards, tmp_path, caplog):
    root = tmp_path / "web"
    shutil.copytree(small_shards.dir, root / "train")
    (root / "train" / "shard-000002.tar").unlink()
    kw = dict(seq_len=64, micro_batch_size=2, num_workers=0, seed=4, max_epochs=1)
    with http_server(root) as base:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(CorruptShardError, match=rf"shard shard-000002\.tar: cannot read "
                                                        rf"{base}/train/shard-000002\.tar: HTTP 404"):
                list(ShardLoader(f"{base}/train", retry=RetryPolicy(attempts=5, wait_s=2.0), **kw))
        assert time.monotonic() - t0 < 10 and "retrying" not in caplog.text
        with pytest.raises(DataError, match=rf"{base}/nothing: not a readable shard set \(manifest: cannot read "
                                            rf"{base}/nothing/manifest\.json: HTTP 404\)"):
            read_manifest(f"{base}/nothing")
    with pytest.raises(DataError, match=r"no opener for the URL scheme 's3'"):
        read_manifest("s3://bucket/set")


@pytest.mark.slow
def test_training_from_http_equals_local_and_resumes(small_shards, web_root, tmp_path):
    """2 gloo ranks, the debug model: the loss trace read over HTTP (train and eval sets), stopped after 2
    steps and resumed over HTTP, equals the uninterrupted run from the directories."""
    sys.path.insert(0, str(HERE))
    from test_trainer import STAGES_1, train, trace

    from roformer_dist.config import load_config

    stages = STAGES_1.replace("steps: 8", "steps: 4")

    def cfg(shards, eval_shards, run, *extra):
        return load_config(HERE.parent / "configs" / "experiments" / "debug.yaml",
                           [f"data.shards={shards}", f"data.eval_shards={eval_shards}", f"run_dir={run}",
                            "dist.world_size=2", "trainer.save_every=0", "trainer.eval_every=0",
                            "data.eval_batches=1", "data.url_retry_wait_s=0.05", stages, *extra])

    assert train(cfg(small_shards.dir, small_shards.eval_dir, tmp_path / "local")) == [0, 0]
    with http_server(web_root) as base:
        run = tmp_path / "http"
        assert train(cfg(f"{base}/train", f"{base}/eval", run, "trainer.stop_at_step=2")) == [0, 0]
        assert train(cfg(f"{base}/train", f"{base}/eval", run)) == [0, 0]
    assert "resuming from" in (run / "logs" / "rank0.log").read_text()
    assert trace(run) == trace(tmp_path / "local")                 # bit for bit
    assert len(trace(run)) == 4
