"""Shard sets, manifests and corpora as untrusted input: each case a reproduced attack or crash.

- Names from data (``tokenizer.path``, shard names, the names in a cluster task's result) are plain
  base names before they are joined to a directory or put into a URL, and are shell-quoted in a
  ``pipe:`` command: the injected command of a hostile manifest never runs (``roformer-train``'s
  data check, ``roformer-data inspect --verify``: exit 4, one line, no traceback).
- The tar parser refuses negative, non-octal, base-256 and oversized member sizes (it looped
  forever on a negative one) and always moves forward.
- Reads are bounded: a shard by its manifest ``bytes`` (a symlink to /dev/zero, an endless
  ``pipe:`` stream, an oversized HTTP answer stop there), a ``pipe:`` command by a time limit;
  token ids at or above ``vocab_size`` are bad data; corpus lines over a cap are never read whole;
  deeply nested JSON is a DataError.
- A seeded fuzz of the tar parser and of the manifest reader: every case parses or raises one of
  our errors, in bounded time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import cluster
from data_pipeline.corpus import CorpusStats, InputRange, detect_format, read_documents
from data_pipeline.errors import DataError, UsageError
from data_pipeline.formats import ReadOptions
from data_pipeline.loader import ShardLoader, shard_sizes
from data_pipeline.manifest import (MAX_VOCAB_SIZE, check_training_data, parse_manifest, read_manifest,
                                    read_tokenizer, shard_byte_limit)
from data_pipeline.shards import CorruptShardError, load_shard, verify_shard_set, write_shard_set
from data_pipeline.slots import deal
from data_pipeline.source import RetryPolicy, ShardSource, check_name, read_url
from data_pipeline.tario import iter_tar_members, parse_shard

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
ONE = RetryPolicy(attempts=1, wait_s=0.0)


class Hang(BaseException):
    """A case that ran past its time bound (BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise Hang in the main thread when the block runs longer than ``seconds`` (SIGALRM)."""
    def ring(signum, frame):  # noqa: ARG001
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def fuzz_case(what: str):
    """One fuzz case: done within 2 s, and nothing but our error classes (handled inside) escapes it;
    a hang or any other exception fails the test naming ``what``."""
    try:
        with deadline(2):
            yield
    except Hang:
        pytest.fail(f"{what}: hung")
    except Exception as exc:          # noqa: BLE001 - the point: any other exception is a crash
        pytest.fail(f"{what}: {type(exc).__name__}: {exc}")


def _copy(small_shards, tmp_path) -> Path:
    d = tmp_path / "set"
    shutil.copytree(small_shards.dir, d)
    return d


def _edit_manifest(d: Path, fn) -> dict:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return m


def _checksum(hdr: bytearray) -> None:
    """Recompute a ustar header's checksum in place."""
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)


def _with_size(buf: bytes, header_at: int, field: bytes) -> bytes:
    """``buf`` with the size field of the header at ``header_at`` replaced (checksum recomputed)."""
    out = bytearray(buf)
    hdr = bytearray(out[header_at:header_at + 512])
    hdr[124:136] = field.ljust(12, b"\0")[:12]
    _checksum(hdr)
    out[header_at:header_at + 512] = hdr
    return bytes(out)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A small shard set from the project's writer: 3 shards of 12 documents with word marks, vocab 3000."""
    rng = np.random.default_rng(7)
    docs = [(rng.integers(5, 3000, int(n)).astype(np.uint16), (rng.random(int(n)) < 0.5).astype(np.uint8))
            for n in rng.integers(1, 300, 36)]
    d = tmp_path_factory.mktemp("synthetic") / "set"
    m = write_shard_set(docs, d, vocab_size=3000, max_docs_per_shard=12)
    return d, m


# --------------------------------------------------------------------------- 1. names from data


INJECT_ABS = "tokenizer.model; echo INJECTED > {f} #"


def test_tokenizer_path_cannot_inject_a_shell_command(small_shards, tmp_path):
    """The reproduced attack: a set read through ``pipe:cat DIR/{name}`` whose manifest's tokenizer.path
    holds a command. Refused by the manifest check with a DataError naming the field, from the trainer's
    data check and from ``roformer-data inspect --verify`` (exit 4, no traceback); nothing runs."""
    d = _copy(small_shards, tmp_path)
    flag = tmp_path / "F"
    _edit_manifest(d, lambda m: m["tokenizer"].update(path=INJECT_ABS.format(f=flag)))
    url = f"pipe:cat {d}/{{name}}"
    with pytest.raises(DataError, match=r"manifest\.json: field 'tokenizer\.path': expected a plain file name"):
        check_training_data(url)                       # what roformer-train runs before anything else
    assert not flag.exists()
    r = subprocess.run([str(BIN / "roformer-data"), "inspect", "--verify", url], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr and "field 'tokenizer.path'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not flag.exists()


def test_roformer_train_refuses_the_injecting_manifest(small_shards, tmp_path):
    d = _copy(small_shards, tmp_path)
    flag = tmp_path / "F"
    _edit_manifest(d, lambda m: m["tokenizer"].update(path=INJECT_ABS.format(f=flag)))
    r = subprocess.run([str(BIN / "roformer-train"), "--config", str(ROOT / "configs/experiments/debug.yaml"),
                        f"data.shards=pipe:cat {d}/{{name}}", f"data.eval_shards={small_shards.eval_dir}",
                        f"run_dir={tmp_path / 'run'}", "dist.world_size=1"],
                       capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "tokenizer.path" in r.stderr
    assert not flag.exists()


def test_names_are_shell_quoted_in_pipe_commands(small_shards, tmp_path):
    """A name without '/' passes the base-name check; quoting alone keeps its command from running (the
    manifest check is bypassed here: the reader is handed the hostile manifest directly)."""
    d = _copy(small_shards, tmp_path)
    m = read_manifest(d)
    m["tokenizer"]["path"] = "tokenizer.model; touch INJECTED #"
    src = ShardSource(f"pipe:cat {d}/{{name}}", ONE)
    assert src.child("a b;c") == f"pipe:cat {d}/'a b;c'"
    cwd = os.getcwd()
    os.chdir(tmp_path)                                  # where `touch INJECTED` would create its file
    try:
        with pytest.raises(DataError, match=r"field 'tokenizer\.path'"):
            read_tokenizer(src, m)
        with pytest.raises(DataError, match=r"field 'tokenizer\.path'"):
            read_tokenizer(ShardSource(f"pipe:cat {d}", ONE), m)           # the appended /<name> too
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "INJECTED").exists()
    for quoted in (f"pipe:cat '{d}/{{name}}'", f'pipe:cat "{d}/{{name}}"'):
        with pytest.raises(UsageError, match=r"\{name\} stands inside quotes"):
            read_manifest(quoted)
    assert read_manifest(f"pipe:cat {d}/{{name}}")["vocab_size"] == small_shards.vocab_size
    assert ShardSource("http://h/set").child("a b#c") == "http://h/set/a%20b%23c"


@pytest.mark.parametrize("name", ["", ".", "..", "../tokenizer.model", "/etc/passwd", "sub/tokenizer.model",
                                  "a\\b", "tok\nenizer", "tok\x00", "tok\x7f", "-rf", "x" * 256, "\udc80"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(DataError, match="expected a plain file name"):
        check_name(name, "test")
    with pytest.raises(DataError, match="expected a plain file name"):
        ShardSource("pipe:cat /data/{name}").child(name)


def test_manifest_names_must_be_plain(small_shards, tmp_path):
    d = _copy(small_shards, tmp_path)
    good = read_manifest(d)
    for path in ("../tokenizer.model", str(small_shards.tokenizer), "tok/../tokenizer.model", ""):
        _edit_manifest(d, lambda m: m["tokenizer"].update(path=path))
        with pytest.raises(DataError, match=r"field 'tokenizer\.path': expected a plain file name"):
            read_manifest(d)
    for name in ("shard-000000.tar\n", "shard-\u0660\u0660\u0660\u0660\u0660\u0660.tar", "../shard-000000.tar",
                 "/tmp/shard-000000.tar"):
        _edit_manifest(d, lambda m: (m.update(tokenizer=good["tokenizer"]), m["shards"][0].update(name=name)))
        with pytest.raises(DataError, match=r"field 'shards\[0\]\.name': expected a file name like shard-000000"):
            read_manifest(d)


def test_cluster_merge_checks_the_names_in_task_results(tmp_path):
    staging = tmp_path / "stage"
    task_dir = staging / "tasks" / "task-00000"
    task_dir.mkdir(parents=True)
    (staging / "tokenizer.model").write_bytes(b"model")
    outside = tmp_path / "evil.tar"
    outside.write_bytes(b"x")
    entry = {"name": "../../../evil.tar", "num_docs": 1, "num_tokens": 1, "sha256": "0" * 64}
    manifest = {"format": 1, "tokenizer": {"path": "/abs/tokenizer.model", "sha256": "0" * 64}, "vocab_size": 100,
                "special_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}, "dtype": "uint16", "wwm": True,
                "num_docs": 1, "num_tokens": 1, "shards": [entry], "text_bytes": 1}
    result = {"task": 0, "manifest": manifest, "stats": CorpusStats().to_dict(), "seconds": 1.0}
    tasks = [cluster.Task(0, (), 0)]
    (task_dir / "result.json").write_text(json.dumps(result))
    with pytest.raises(DataError, match=r"result\.json: field 'manifest'.*shards\[0\]\.name"):
        cluster.merge(staging, tasks)
    assert outside.exists() and not (staging / "shard-000000.tar").exists()
    for bad in ({**result, "task": 5}, {**result, "stats": {"lines": "many"}}, [1, 2], {**result, "seconds": None}):
        (task_dir / "result.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=r"result\.json"):
            cluster.merge(staging, tasks)


# --------------------------------------------------------------------------- 2. tar sizes


@pytest.mark.parametrize("field", [b"-0000001000", b"-1", b"0o17", b"1_0", b"+17", b"\x80" + bytes(10) + b"\x01",
                                   b"9", b"77777777777", b"1 2"])
def test_bad_tar_sizes_are_corrupt_shards_at_once(small_shards, field):
    """A negative size looped forever (reproduced: a 1.5 KB shard kept parse_shard spinning at 466 MB).
    Each bad size field is a CorruptShardError naming the shard, the header's offset and the field, from
    both parsers, well within a second; the header checksum is right, only the field is wrong."""
    m = read_manifest(small_shards.dir)
    e = m["shards"][0]
    real = (small_shards.dir / e["name"]).read_bytes()
    second = next(iter_tar_members(real))[2] + 511 & ~511   # the second header: after the first member
    for at in (0, 512 + second):
        buf = _with_size(real, at, field)
        t0 = time.monotonic()
        with deadline(5):
            with pytest.raises(CorruptShardError, match=rf"shard-000000\.tar: (bad tar header at byte {at}: field "
                                                        rf"'size'|truncated \(the member at byte {at} needs)"):
                parse_shard(buf, "shard-000000.tar", m["dtype"], e, verify_hash=False)
            with pytest.raises(CorruptShardError, match=rf"at byte {at}"):
                list(iter_tar_members(buf, "shard-000000.tar"))
        assert time.monotonic() - t0 < 1.0


def test_a_negative_size_in_a_small_shard_file(tmp_path, capsys):
    """The reproduced 1.5 KB shard: one document, its first header's size set to -0000001000, the manifest
    rewritten to the new hash: ``inspect --verify`` exits 4 naming the shard and the field."""
    from data_pipeline import cli

    d = tmp_path / "set"
    write_shard_set([(np.array([5, 6, 7], np.uint16), np.ones(3, np.uint8))], d, vocab_size=100)
    p = d / "shard-000000.tar"
    p.write_bytes(_with_size(p.read_bytes()[:1536] + bytes(1024), 0, b"-0000001000"))
    import hashlib
    _edit_manifest(d, lambda m: m["shards"][0].update(sha256=hashlib.sha256(p.read_bytes()).hexdigest(),
                                                       bytes=p.stat().st_size))
    with deadline(10):
        assert cli.main(["inspect", "--verify", str(d)]) == 4
    err = capsys.readouterr().err
    assert "shard-000000.tar: bad tar header at byte 0: field 'size'" in err


# --------------------------------------------------------------------------- 3. bounded reads


def test_manifest_records_shard_bytes_and_old_manifests_still_read(small_shards, tmp_path):
    m = read_manifest(small_shards.dir)
    assert all(e["bytes"] == (small_shards.dir / e["name"]).stat().st_size for e in m["shards"])
    d = _copy(small_shards, tmp_path)
    _edit_manifest(d, lambda m: [e.pop("bytes") for e in m["shards"]])      # a manifest from before the field
    assert verify_shard_set(d) == []
    old = read_manifest(d)
    assert all(shard_byte_limit(e, 2) >= (d / e["name"]).stat().st_size for e in old["shards"])


def test_a_shard_larger_than_the_manifest_says(small_shards, tmp_path):
    d = _copy(small_shards, tmp_path)
    with open(d / "shard-000001.tar", "ab") as f:
        f.write(bytes(10240))
    assert any("shard-000001.tar: the shard is larger than the manifest says" in p for p in verify_shard_set(d))
    with pytest.raises(CorruptShardError, match="larger than the manifest says"):
        load_shard(f"pipe:cat {d}/{{name}}", read_manifest(d), 1)


def test_a_shard_that_is_dev_zero_stops_at_its_size(small_shards, tmp_path):
    """A symlink to /dev/zero: locally refused before it is opened (not a regular file); read through a
    ``pipe:`` command (an endless stream), reading stops at the manifest's size + 1, with and without the
    ``bytes`` field, and the command is killed."""
    d = _copy(small_shards, tmp_path)
    (d / "shard-000003.tar").unlink()
    (d / "shard-000003.tar").symlink_to("/dev/zero")
    with deadline(20):
        with pytest.raises(CorruptShardError, match=r"shard-000003\.tar: not a regular file \(a device\)"):
            load_shard(d, read_manifest(d), 3)
        m = read_manifest(d)
        with pytest.raises(CorruptShardError, match=rf"larger than the manifest says \({m['shards'][3]['bytes']} "):
            load_shard(ShardSource(f"pipe:cat {d}/{{name}}", ONE), m, 3)
        _edit_manifest(d, lambda m: [e.pop("bytes") for e in m["shards"]])
        with pytest.raises(CorruptShardError, match=r"larger than the manifest says \(at most \d+ bytes for its"):
            load_shard(ShardSource(f"pipe:cat {d}/{{name}}", ONE), read_manifest(d), 3)
        with pytest.raises(CorruptShardError, match="shard-000003.tar"):
            list(ShardLoader(f"pipe:cat {d}/{{name}}", seq_len=64, micro_batch_size=4, num_workers=0, max_epochs=1,
                             retry=ONE))


def _gone(marker: str, within_s: float = 5.0) -> bool:
    """Whether no process holds ``marker`` within ``within_s`` (a killed process may take a moment to die on a
    busy machine)."""
    deadline = time.monotonic() + within_s
    while _running(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _running(marker: str) -> list[str]:
    """Command lines of the processes that hold ``marker``."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and p.name.isdigit():
            out.append(cmd)
    return out


def test_a_stalled_pipe_command_times_out(small_shards, capsys):
    """``pipe:sleep 30`` with a 0.5 s limit: a UrlError (retried as transient) in about that time, and the
    command's whole process group is gone; ``inspect --url-timeout-s`` sets the limit on the command line."""
    from data_pipeline import cli

    t0 = time.monotonic()
    with deadline(20):
        with pytest.raises(DataError, match=r"cannot read pipe:sleep 30: timed out after 0\.5 s"):
            read_url("pipe:sleep 30", "manifest", RetryPolicy(attempts=1, timeout_s=0.5))
        slow = ShardSource(f"pipe:sleep 30.25; cat {small_shards.dir}/{{name}}",
                           RetryPolicy(attempts=2, wait_s=0, timeout_s=0.5))
        with pytest.raises(DataError, match=r"timed out after 0\.5 s.*gave up after 2 attempts"):
            read_manifest(slow)
    assert time.monotonic() - t0 < 10
    assert _gone("sleep 30.25")                           # the shell and its sleep were killed
    assert RetryPolicy().timeout_s == 600.0
    from data_pipeline.source import default_retry, set_default_retry

    before = default_retry()
    try:
        set_default_retry(RetryPolicy(attempts=1, wait_s=0))
        assert cli.main(["inspect", "--url-timeout-s", "0.3", f"pipe:sleep 30.5; cat {small_shards.dir}/{{name}}"]) == 4
    finally:
        set_default_retry(before)
    assert "timed out after 0.3 s" in capsys.readouterr().err


def test_curl_gets_time_and_size_limits_and_an_oversized_answer_stops(small_shards, tmp_path):
    sys.path.insert(0, str(HERE))
    from test_data_urls import http_server

    from data_pipeline.source import _curl_args

    args = _curl_args("http://h/x", 1000, 12.5)
    assert args[args.index("--max-time") + 1] == "12.5" and args[args.index("--max-filesize") + 1] == "1000"
    root = tmp_path / "web"
    shutil.copytree(small_shards.dir, root / "train")
    with open(root / "train" / "shard-000002.tar", "ab") as f:
        f.write(bytes(1 << 20))
    with http_server(root) as base:
        m = read_manifest(f"{base}/train")
        with pytest.raises(CorruptShardError, match=r"shard-000002\.tar: the shard is larger than the manifest"):
            load_shard(ShardSource(f"{base}/train", ONE), m, 2)
        assert load_shard(ShardSource(f"{base}/train", ONE), m, 1).num_docs == m["shards"][1]["num_docs"]


def _set_with_id(tmp_path, vocab_size: int, bad_id: int) -> Path:
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    rng = np.random.default_rng(3)
    docs = [(rng.integers(5, vocab_size, 40).astype(dtype), np.ones(40, np.uint8)) for _ in range(24)]
    docs[17][0][9] = bad_id
    d = tmp_path / f"ids-{vocab_size}"
    write_shard_set(docs, d, vocab_size=vocab_size, max_docs_per_shard=8)
    return d


@pytest.mark.parametrize("vocab_size,bad_id", [(1000, 1000), (1000, 2 ** 16 - 1), (70000, 2 ** 32 - 1)])
def test_token_ids_at_or_above_vocab_size_are_bad_data(tmp_path, vocab_size, bad_id, capsys):
    from data_pipeline import cli

    d = _set_with_id(tmp_path, vocab_size, bad_id)
    kw = dict(seq_len=32, micro_batch_size=2, num_workers=0, max_epochs=1)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptShardError, match=rf"shard-000002\.tar: token id {bad_id} is not below the "
                                                    rf"manifest's vocab_size {vocab_size}"):
            list(ShardLoader(d, **kw))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20                                   # an id of 2**32-1 allocates nothing by its size
    ld = ShardLoader(d, skip_bad_shards=True, **kw)
    assert sum(1 for _ in ld) > 0 and ld.stats["bad_shards"] == ["shard-000002.tar"]
    problems = verify_shard_set(d)
    assert len(problems) == 1 and f"token id {bad_id}" in problems[0]
    assert cli.main(["inspect", "--verify", str(d)]) == 4
    assert "shard-000002.tar: token id" in capsys.readouterr().err


def test_vocab_size_is_bounded(small_shards, tmp_path):
    d = _copy(small_shards, tmp_path)
    _edit_manifest(d, lambda m: m.update(vocab_size=MAX_VOCAB_SIZE + 1, dtype="uint32"))
    with pytest.raises(DataError, match=r"field 'vocab_size': expected a positive integer \(at most 16777216\)"):
        read_manifest(d)


# --------------------------------------------------------------------------- 4. corpora and JSON


def test_a_long_line_is_never_read_whole(tmp_path):
    """A 24 MiB line between two short ones: skipped and counted (the warning always shows), read in
    pieces (peak memory far below the line); ``strict`` names the file and line."""
    f = tmp_path / "big.txt"
    with open(f, "wb") as out:
        out.write("第一行\n".encode())
        for _ in range(24):
            out.write(b"x" * (1 << 20))
        out.write("\n最后一行\n".encode())
    stats = CorpusStats()
    tracemalloc.start()
    try:
        texts = [doc.text for doc in read_documents(f, stats=stats)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert texts == ["第一行", "最后一行"] and stats.long_lines == 1 and stats.lines == 3
    assert peak < 8 << 20
    assert any("1 lines (or blank-line separated documents) longer than 1048576 bytes were skipped" in w
               for w in stats.warnings())
    with pytest.raises(DataError, match=r"big\.txt:2: a line of 25165825 bytes \(newline included\), longer "
                                        r"than the limit of 1048576"):
        list(read_documents(f, options=ReadOptions(strict=True)))
    assert [d.text for d in read_documents(f, options=ReadOptions(max_line_bytes=30 << 20))][1] == "x" * (24 << 20)
    # a byte range starting inside the long line, and format detection, read past it the same way
    assert [d.text for d in read_documents(InputRange(f, 100, f.stat().st_size))] == ["最后一行"]
    g = tmp_path / "first_long.txt"
    g.write_bytes(b"y" * (3 << 20) + "\n迈向/v  充满/v  希望/n\n".encode())
    assert detect_format(g) == "pd"


def test_a_long_blank_line_document_is_skipped(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("a short one\n\n" + ("many lines\n" * 2000) + "\nthe last\n", encoding="utf-8")
    stats = CorpusStats()
    docs = [d.text for d in read_documents(f, stats=stats, options=ReadOptions(doc_boundary="blank", max_line_bytes=1000))]
    assert docs == ["a short one", "the last"] and stats.long_lines == 1
    with pytest.raises(DataError, match=r"docs\.txt:3: a document \(up to the next blank line\) longer than"):
        list(read_documents(f, options=ReadOptions(doc_boundary="blank", strict=True, max_line_bytes=1000)))


def test_deeply_nested_json(small_shards, tmp_path):
    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(DataError, match=r"m\.json: not a manifest \(JSON nested too deeply\)"):
        parse_manifest(deep, "m.json")
    with pytest.raises(DataError, match=r"m\.json: not valid JSON"):
        parse_manifest('{"format": 1' + "1" * 5000 + "}", "m.json")        # an integer of too many digits
    d = _copy(small_shards, tmp_path)
    (d / "manifest.json").write_text('{"format": 1, "tokenizer": ' + deep + "}")
    with pytest.raises(DataError, match="nested too deeply"):
        read_manifest(d)
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "fine"}\n' + '{"text": ' + deep + "}\n", encoding="utf-8")
    stats = CorpusStats()
    assert [x.text for x in read_documents(f, stats=stats)] == ["fine"] and stats.invalid_json_lines == 1
    with pytest.raises(DataError, match=r"c\.jsonl:2: invalid JSON \(nested too deeply\)"):
        list(read_documents(f, options=ReadOptions(strict=True)))


# --------------------------------------------------------------------------- 5. fuzz

OURS = (DataError,)        # UsageError, CorruptShardError, UrlError, TooLargeError: all DataError or ValueError


def _header_offsets(buf: bytes) -> list[int]:
    return [start - 512 for _, start, _ in iter_tar_members(buf)]


def _mutate_tar(rng: random.Random, buf: bytes, headers: list[int]) -> bytes:
    b = bytearray(buf)
    kind = rng.randrange(7)
    if kind == 0:                                            # truncation
        return bytes(b[:rng.randrange(len(b))])
    if kind == 1:                                            # bit flips
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:                                            # a byte range overwritten
        at, n = rng.randrange(len(b)), rng.randint(1, 700)
        fill = rng.choice([bytes(n), b"\xff" * n, bytes(rng.randrange(256) for _ in range(n)), b"ustar\0" * n])
        b[at:at + n] = fill[:n]
        return bytes(b[:len(buf)])
    if kind == 3:                                            # a block inserted or removed
        at = rng.randrange(len(b) // 512) * 512
        if rng.random() < 0.5:
            return bytes(b[:at] + bytes(rng.randrange(256) for _ in range(512)) + b[at:])
        return bytes(b[:at] + b[at + 512:])
    at = rng.choice(headers)
    hdr = bytearray(b[at:at + 512])
    if kind == 4:                                            # the size field
        hdr[124:136] = rng.choice([b"-0000001000", b"-1", b"%011o\0" % rng.randrange(8 ** 11),
                                   b"%011o\0" % rng.randrange(1 << 16), b"77777777777\0", b"0o17", b"1_0", b"+1",
                                   b"\x80" + bytes(rng.randrange(256) for _ in range(11)), b" " * 12, bytes(12),
                                   b"%o" % rng.randrange(2000), b"00000000" + b"9" * 4]).ljust(12, b"\0")[:12]
    elif kind == 5:                                          # the type flag
        hdr[156] = rng.choice(b"0\x0012345678xgLKSV") if rng.random() < 0.9 else rng.randrange(256)
    else:                                                    # the name (and prefix)
        name = rng.choice([b"../../etc/passwd", b"/abs.ids", b"0000000000.ids", b"0000000001.wwm", b"x" * 100,
                           b"\xff\xfe.ids", b"a/b/c.wwm", b"", b"0000000000", b"0000000000.ids\0junk"])
        hdr[0:100] = name.ljust(100, b"\0")[:100]
        if rng.random() < 0.3:
            hdr[345:500] = b"prefix/dir".ljust(155, b"\0")
    if rng.random() < 0.8:
        _checksum(hdr)
    b[at:at + 512] = hdr
    return bytes(b)


def _check_parsed(sd, buf: bytes) -> None:
    """What the loader relies on when a shard parses: every document lies inside the buffer."""
    ends = sd.tok_start + sd.lengths
    assert (sd.tok_start >= 0).all() and (ends <= len(sd.tokens)).all()
    if sd.marks is not None:
        assert (sd.wwm_start >= 0).all() and (sd.wwm_start + sd.lengths <= len(buf)).all()


def test_fuzz_the_tar_parser(synthetic, small_shards):
    """5000 mutations of real shards (the synthetic set's three and one of People's Daily): each parses
    into documents inside the buffer or is one of our errors, within 2 s."""
    d, m = synthetic
    real = read_manifest(small_shards.dir)
    rng = random.Random(20240601)
    shards = [(e, (d / e["name"]).read_bytes(), m) for e in m["shards"]]
    shards.append((real["shards"][0], (small_shards.dir / real["shards"][0]["name"]).read_bytes(), real))
    shards = [(e, buf, _header_offsets(buf), mm) for e, buf, mm in shards]
    outcomes = {"parsed": 0, "refused": 0}
    t0 = time.monotonic()
    for case in range(5000):
        e, buf, headers, mm = shards[case % len(shards)] if case % 5 else shards[-1]
        bad = _mutate_tar(rng, buf, headers)
        with fuzz_case(f"case {case} (a mutated {e['name']})"):
            try:
                _check_parsed(parse_shard(bad, "fuzz.tar", mm["dtype"], e if case % 2 else None,
                                          verify_hash=False, vocab_size=mm["vocab_size"]), bad)
                outcomes["parsed"] += 1
            except OURS:
                outcomes["refused"] += 1
            try:
                list(iter_tar_members(bad, "fuzz.tar"))
            except OURS:
                pass
    assert outcomes["refused"] > 2000 and outcomes["parsed"] > 100, outcomes
    assert time.monotonic() - t0 < 60


_POOL = [None, True, False, -1, 0, 1, 2 ** 70, -2 ** 63, 1.5, 1e308, float("nan"), "", "x", "uint8", [], {},
         [1, 2], {"a": 1}, "../x", "/etc/passwd", "a/b", "shard-000000.tar\n", "shard-000000.tar", "tokenizer.model",
         "\x00", "-rf", "0" * 64, "f" * 64, [[[[[]]]]]]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate_manifest(rng: random.Random, good: dict) -> str:
    m = json.loads(json.dumps(good))
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(m) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        kind = rng.randrange(5)
        if kind == 0:
            del parent[path[-1]]
        elif kind == 1:
            parent[path[-1]] = rng.choice(_POOL)
        elif kind == 2:
            parent[path[-1]] = json.loads("[" * 50 + "]" * 50)
        elif kind == 3 and isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
            parent[path[-1]] = rng.choice([parent[path[-1]] + 1, -parent[path[-1]], parent[path[-1]] * 2 ** 40])
        elif isinstance(parent, dict):
            parent[rng.choice(["extra", "bytes", "name", "path"])] = rng.choice(_POOL)
    text = json.dumps(m)
    r = rng.random()
    if r < 0.1:
        return text[:rng.randrange(len(text))]
    if r < 0.15:
        return "[" * 100_000
    if r < 0.2:
        at = rng.randrange(len(text))
        return text[:at] + rng.choice(["\x00", "}", "{", "1" * 5000, "\ud800", '"', "NaN"]) + text[at:]
    return text


def test_fuzz_the_manifest_reader(synthetic):
    """3000 random edits of a real manifest (wrong types, missing keys, nesting, huge numbers, names with
    '/', broken JSON text): each parses or is a DataError, within 2 s; what parses is then used the way
    the readers use it (names into a pipe: URL, read limits, dealing, and loading a shard) without any
    other exception."""
    d, good = synthetic
    rng = random.Random(7)
    src = ShardSource(f"pipe:cat {d}/{{name}}")
    outcomes = {"parsed": 0, "refused": 0}
    for case in range(3000):
        raw = _mutate_manifest(rng, good)
        with fuzz_case(f"case {case} (on {raw[:300]!r})"):
            try:
                m = parse_manifest(raw, "fuzz/manifest.json")
            except OURS:
                outcomes["refused"] += 1
                continue
            outcomes["parsed"] += 1
            for e in m["shards"]:                         # what readers do with a manifest that parses
                assert 0 <= shard_byte_limit(e, 2) <= 1 << 34
                src.child(e["name"])
            if m["tokenizer"]["path"] is not None:
                src.child(m["tokenizer"]["path"])
            try:
                deal(0, 0, shard_sizes(m), 3)
            except UsageError:
                pass
            if case % 4 == 0:
                try:
                    load_shard(d, m, rng.randrange(len(m["shards"])))
                except OURS:
                    pass
    assert outcomes["refused"] > 500 and outcomes["parsed"] > 50, outcomes
