"""roformer-data under hostile conditions, on real files: an existing shard set is never destroyed,
bad inputs fail before expensive work with a message naming the file or field, a manifest that
disagrees with its tokenizer is caught (by ``inspect --verify`` and at training start), and
suspicious corpora give warnings with counts. Exit statuses: 2 usage, 4 data error."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline import cli
from data_pipeline.errors import EXIT_DATA, EXIT_USAGE, TRAINING_SET, DataError
from data_pipeline.manifest import check_training_data, read_manifest
from data_pipeline.shards import CorruptShardError, verify_shard_set

ROOT = Path(__file__).resolve().parent.parent


def _pd_lines(peoples_daily, n, start=0):
    with open(peoples_daily, encoding="utf-8") as f:
        return [line for i, line in enumerate(f) if start <= i < start + n]


def _hashes(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def _prepare(*args) -> list[str]:
    return ["prepare", "--vocab-size", "3000", "--num-threads", "2", "--workers", "1", "--no-progress", *args]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, peoples_daily):
    d = tmp_path_factory.mktemp("corpus")
    (d / "pd.txt").write_text("".join(_pd_lines(peoples_daily, 300)), encoding="utf-8")
    return d / "pd.txt"


@pytest.fixture(scope="module")
def made_set(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("made") / "set"
    assert cli.main(_prepare("--input", str(corpus), "--out", str(out), "--max-docs-per-shard", "100")) == 0
    return out


def _copy(made_set, tmp_path) -> Path:
    d = tmp_path / "set"
    shutil.copytree(made_set, d)
    return d


def test_exit_statuses_match_the_trainer():
    from roformer_dist import errors

    assert (EXIT_USAGE, EXIT_DATA) == (errors.EXIT_CONFIG, errors.EXIT_DATA)
    assert issubclass(CorruptShardError, DataError) and errors.exit_status(CorruptShardError("x")) == 4


def test_prepare_refuses_an_existing_set_and_force_swaps_only_when_complete(made_set, corpus, tmp_path, capsys):
    d = _copy(made_set, tmp_path)
    before = _hashes(d)
    assert cli.main(_prepare("--input", str(corpus), "--out", str(d))) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{d}: a shard set is already there; pass --force" in err
    assert _hashes(d) == before
    # --force, but the build fails (--strict meets an invalid line): the old set is untouched, nothing is left
    bad = tmp_path / "bad.txt"
    bad.write_bytes(corpus.read_bytes()[:20000] + b"\xff\xfe\n")
    assert cli.main(_prepare("--input", str(bad), "--out", str(d), "--force", "--strict")) == EXIT_DATA
    err = capsys.readouterr().err
    assert "bad.txt:" in err and "invalid UTF-8" in err
    assert _hashes(d) == before and _leftovers(tmp_path) == []
    # --force and a good build: the new set replaces the old one, nothing is left beside it
    assert cli.main(_prepare("--input", str(corpus), "--out", str(d), "--force", "--max-docs-per-shard",
                             "150")) == 0
    assert len(read_manifest(d)["shards"]) == 2 and verify_shard_set(d) == []
    assert _leftovers(tmp_path) == []
    # a directory that is not a shard set is never replaced
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert cli.main(_prepare("--input", str(corpus), "--out", str(other), "--force")) == EXIT_USAGE
    assert "is not a shard set (1 entries, no manifest.json)" in capsys.readouterr().err
    assert (other / "todo.txt").read_text() == "keep me"


def test_failures_before_any_output_leave_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "new" / "set"
    assert cli.main(_prepare("--input", str(tmp_path / "missing.txt"), "--out", str(out))) == EXIT_DATA
    assert "missing.txt': no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\u3000\n\n", encoding="utf-8")
    assert cli.main(_prepare("--input", str(empty), "--out", str(out))) == EXIT_DATA
    err = capsys.readouterr().err
    assert "no text to train a tokenizer on" in err and "INTERNAL" not in err
    assert not (tmp_path / "new").exists()
    # shards with an existing tokenizer: an empty corpus is a data error naming the counts
    assert cli.main(["shards", "--input", str(empty), "--tokenizer", str(tmp_path / "nope.model"), "--out",
                     str(out)]) == EXIT_DATA
    assert "nope.model: no such file" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_truncated_gz_in_an_input_directory_is_named(tmp_path, corpus, capsys):
    src = tmp_path / "in"
    src.mkdir()
    shutil.copy(corpus, src / "a.txt")
    whole = gzip.compress(corpus.read_bytes())
    (src / "b.txt.gz").write_bytes(whole[:len(whole) // 2])
    out = tmp_path / "set"
    assert cli.main(_prepare("--input", str(src), "--out", str(out))) == EXIT_DATA
    err = capsys.readouterr().err
    assert f"input {src / 'b.txt.gz'}: cannot be read after line" in err and "truncated .gz" in err
    assert not out.exists() and _leftovers(tmp_path) == []
    (src / "b.txt.gz").write_bytes(b"plain text, not gzip\n")
    assert cli.main(_prepare("--input", str(src), "--out", str(out))) == EXIT_DATA
    assert f"input {src / 'b.txt.gz'}: cannot be read" in capsys.readouterr().err


def test_read_only_output_fails_before_the_tokenizer_is_trained(tmp_path, corpus):
    """A real read-only filesystem (a tmpfs mounted ro in a private mount namespace) when we are root,
    else a directory without write permission."""
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = [sys.executable, "-m", "launcher.prepare", *_prepare("--input", str(corpus), "--out", str(ro / "set"))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if os.geteuid() == 0 and shutil.which("unshare"):
        script = f"mount -t tmpfs -o ro,size=1m tmpfs {ro} && exec \"$@\""
        p = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *cmd], env=env, capture_output=True,
                           text=True, timeout=120)
        expected = "Read-only file system"
    else:
        ro.chmod(0o555)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        expected = "Permission denied"
    assert p.returncode == EXIT_USAGE, p.stdout + p.stderr
    assert f"{ro / 'set'}: cannot write the output there ({expected}" in p.stderr
    assert "tokenizer:" not in p.stdout                       # failed before any training


def test_manifest_that_disagrees_with_its_tokenizer(made_set, tmp_path, capsys):
    d = _copy(made_set, tmp_path)
    manifest = json.loads((d / "manifest.json").read_text())
    real = manifest["vocab_size"]
    for wrong in (real - 500, real + 500):                   # smaller: IndexError later; larger: a wrong model
        (d / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": wrong}))
        assert cli.main(["inspect", "--verify", str(d)]) == EXIT_DATA
        assert f"field 'vocab_size' is {wrong}, but the tokenizer" in capsys.readouterr().err
        with pytest.raises(DataError, match=f"training set: .*field 'vocab_size' is {wrong}, but the tokenizer "
                                            f".*tokenizer.model has {real} pieces") as e:
            check_training_data(d)
        assert (e.value.input, e.value.field) == (TRAINING_SET, "vocab_size")   # for the caller to name
    bad_ids = {**manifest, "special_ids": {**manifest["special_ids"], "mask": 5}}
    (d / "manifest.json").write_text(json.dumps(bad_ids))
    assert cli.main(["inspect", "--verify", str(d)]) == EXIT_DATA
    assert "field 'special_ids.mask' is 5, but the tokenizer" in capsys.readouterr().err


def test_training_start_checks_name_the_field(made_set, small_shards, tmp_path):
    """What the trainer runs before it builds a model (roformer_dist.plan.data.resolve_data)."""
    from roformer_dist.config import load_config
    from roformer_dist.errors import ConfigError
    from roformer_dist.plan.data import resolve_data

    debug = ROOT / "configs" / "experiments" / "debug.yaml"
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", f"data.eval_shards={small_shards.eval_dir}"])
    resolved, manifests = resolve_data(cfg, None)
    assert resolved.model.vocab_size == manifests["main"]["vocab_size"] == small_shards.vocab_size
    # an eval set made with another tokenizer: the message names the field and shows two different hashes
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", f"data.eval_shards={made_set}"])
    with pytest.raises(DataError, match=r"data.eval_shards: .*field 'tokenizer.sha256' is (\w+)\.\.\., the training "
                                        r"set's is (\w+)\.\.\.: made with another tokenizer") as e:
        resolve_data(cfg, None)
    a, b = [w.rstrip(".,") for w in str(e.value).split() if w.endswith("...,") or w.endswith("...:")][:2]
    assert a != b
    # the same tokenizer but a manifest whose vocab_size was changed: named as such, not as a hash mismatch
    ev = _copy(small_shards.eval_dir, tmp_path)
    m = json.loads((ev / "manifest.json").read_text())
    (ev / "manifest.json").write_text(json.dumps({**m, "vocab_size": m["vocab_size"] + 8}))
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", f"data.eval_shards={ev}"])
    with pytest.raises(DataError, match=r"data.eval_shards: .*field 'vocab_size' is \d+, but the tokenizer"):
        resolve_data(cfg, None)
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", "model.vocab_size=5000"])
    with pytest.raises(ConfigError, match="model.vocab_size: 5000 differs from the shard manifest's vocab_size"):
        resolve_data(cfg, None)
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", "data.eval_shards="])
    with pytest.raises(DataError, match="tokenizer sha256 .* differs from the checkpoint's 000000000000"):
        resolve_data(cfg, {"tokenizer_sha256": "0" * 64})



def test_errors_carry_their_input_and_each_layer_names_it(made_set, small_shards, tmp_path, capsys):
    """data_pipeline says which input an error is about in a field (a role), never in a caller's words; the
    trainer names it by its config key, roformer-data by its flag."""
    from data_pipeline.errors import EVAL_SET, MODEL_VOCAB_SIZE, OUTPUT, TOKENIZER, UsageError
    from data_pipeline.imported import kind_of
    from roformer_dist.config import load_config
    from roformer_dist.errors import ConfigError
    from roformer_dist.plan.data import resolve_data

    # the library: roles and fields, no config keys
    with pytest.raises(DataError, match=r"^eval set: .*manifest\.json: field 'tokenizer\.sha256'") as e:
        check_training_data(small_shards.dir, made_set)
    assert (e.value.input, e.value.field) == (EVAL_SET, "tokenizer.sha256")
    with pytest.raises(UsageError, match=r"^model vocab size: 5000 differs from the shard manifest's") as u:
        check_training_data(small_shards.dir, model_vocab_size=5000)
    assert u.value.argument == MODEL_VOCAB_SIZE and "model.vocab_size" not in str(u.value)
    with pytest.raises(UsageError, match=r"^tokenizer: .*tok\.bin: expected a SentencePiece") as u:
        kind_of(tmp_path / "tok.bin")
    assert u.value.argument == TOKENIZER
    # naming keeps the class, the message and the field
    renamed = e.value.naming("data.eval_shards")
    assert type(renamed) is type(e.value) and renamed.field == "tokenizer.sha256"
    assert str(renamed) == "data.eval_shards: " + e.value.message
    # the trainer: the first source of a mixture by its key and name
    d = _copy(made_set, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, "vocab_size": m["vocab_size"] + 8}))
    debug = ROOT / "configs" / "experiments" / "debug.yaml"
    news = f"[{{name: news, shards: '{d}', weight: 1}}]"
    cfg = load_config(debug, ["data.shards=", "data.eval_shards=", f"data.sources={news}"])
    with pytest.raises(DataError, match=r"^data\.sources\[0\] \(news\): .*field 'vocab_size' is") as e:
        resolve_data(cfg, None)
    assert e.value.field == "vocab_size"
    cfg = load_config(debug, [f"data.shards={small_shards.dir}", "data.eval_shards=", "model.vocab_size=5000"])
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 5000 differs .*; use model\.vocab_size=auto$"):
        resolve_data(cfg, None)
    # roformer-data: by its flags
    assert cli.main(_prepare("--input", str(small_shards.source), "--tokenizer", str(tmp_path / "tok.bin"),
                             "--out", str(tmp_path / "out"))) == EXIT_USAGE
    assert f"error: --tokenizer: {tmp_path / 'tok.bin'}: expected a SentencePiece" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli.main(_prepare("--input", str(small_shards.source), "--out", str(tmp_path / "file"))) == EXIT_USAGE
    assert f"error: --out: {tmp_path / 'file'}: exists and is not a directory" in capsys.readouterr().err
    assert cli.FLAGS[OUTPUT] == "--out"

def test_binary_input_warns_with_counts_and_small_vocab_is_reported(tmp_path, corpus, caplog):
    import sentencepiece

    src = tmp_path / "in"
    src.mkdir()
    shutil.copy(corpus, src / "a.txt")
    lib = next(Path(sentencepiece.__file__).parent.glob("*.so"))      # a real binary file
    (src / "b.txt").write_bytes(lib.read_bytes()[:300_000])
    out = tmp_path / "set"
    with caplog.at_level("WARNING"):
        assert cli.main(["prepare", "--input", str(src), "--out", str(out), "--vocab-size", "8000", "--num-threads",
                         "2", "--workers", "1", "--no-progress"]) == 0
    text = caplog.text
    assert f"input {src / 'b.txt'} looks binary, not text (" in text and "lines are not UTF-8" in text
    assert "lines hold NUL bytes" in text
    assert "were skipped (" in text and "not UTF-8" in text
    got = read_manifest(out)["vocab_size"]
    assert got < 8000 and f"tokenizer: {got} pieces, fewer than the 8000 asked for" in text
    assert text.count("looks binary") == 1                   # said once, not again while writing shards


def test_long_documents_are_split_for_tokenizer_training_not_dropped(tmp_path, peoples_daily, caplog):
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    lines = [line.strip() for line in _pd_lines(peoples_daily, 400, start=1000)]
    text = "".join(line.replace("/", "").replace(" ", "") for line in lines)   # one ~40 KB document
    assert len(text.encode()) > 3 * (1 << 14)
    report: dict = {}
    with caplog.at_level("WARNING"):
        model = train_tokenizer([text], tmp_path / "sp", vocab_size=4000, num_threads=2, report=report)
    assert report["split_texts"] == 1 and report["split_pieces"] >= 3
    assert "1 documents longer than 16383 bytes were split into" in caplog.text
    tk = Tokenizer(model)
    assert tk.vocab_size > 500 and tk.decode(tk.encode(text[:200])) == text[:200]


def test_corrupt_shard_is_a_data_error_for_the_loader_and_inspect(made_set, tmp_path, capsys):
    from data_pipeline.loader import ShardLoader

    d = _copy(made_set, tmp_path)
    p = d / "shard-000001.tar"
    b = bytearray(p.read_bytes())
    b[3000] ^= 0xFF
    p.write_bytes(bytes(b))
    assert cli.main(["inspect", "--verify", str(d)]) == EXIT_DATA
    assert "shard-000001.tar: sha256 mismatch" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"shard-000001\.tar: sha256 mismatch"):
        list(ShardLoader(d, seq_len=64, micro_batch_size=4, num_workers=0, max_epochs=1))


def test_roformer_train_exit_statuses_for_data_problems(made_set, small_shards, tmp_path, capsys):
    """roformer-train refuses before any rank starts: 4 for a manifest that disagrees with its tokenizer,
    2 for a model.vocab_size that disagrees with the data."""
    from roformer_dist.cli.train import main as train_main

    debug = str(ROOT / "configs" / "experiments" / "debug.yaml")
    d = _copy(made_set, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, "vocab_size": m["vocab_size"] - 100}))
    common = [f"run_dir={tmp_path / 'run'}", "data.eval_shards="]
    assert train_main(["--config", debug, f"data.shards={d}", *common]) == 4
    assert "field 'vocab_size' is" in capsys.readouterr().err
    assert train_main(["--config", debug, f"data.shards={small_shards.dir}", "model.vocab_size=5000", *common]) == 2
    assert "model.vocab_size: 5000 differs" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
