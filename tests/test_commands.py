"""What every command shares: one checkpoint resolver, and one way to report a full disk.

- A run directory whose newest checkpoint is marked BAD: training, ``to-hf``, ``roformer-eval`` and
  fine-tuning all take the checkpoint before it.
- Each command that writes, run against a real full filesystem (a tmpfs filled up; root only): exit
  status 74, one line naming the path and the reason, no traceback, nothing half-written left there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.errors import EXIT_STORAGE

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")


def run_cmd(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_with_bad_newest(small_shards, tmp_path_factory) -> Path:
    """A 1-rank ZeRO-0 run of the debug model with checkpoints at steps 2 and 4; step 4 marked BAD
    (``latest`` still names it, as after a resume that found it damaged)."""
    run = tmp_path_factory.mktemp("resolve") / "run"
    r = run_cmd("roformer_dist.cli.train", "--config", str(ROOT / "configs" / "experiments" / "debug.yaml"),
                f"data.shards={small_shards.dir}", f"data.eval_shards={small_shards.eval_dir}", f"run_dir={run}",
                "dist.world_size=1", "curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 8, steps: 4}]",
                "deepspeed.zero_stage=0", "trainer.save_every=2", "trainer.eval_every=0", "data.eval_batches=1",
                "checkpoint.keep_last=3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    root = run / "checkpoints"
    assert ckpt.read_latest(root) == "step_00000004" and ckpt.is_complete(root / "step_00000002")
    ckpt.mark_bad(root / "step_00000004", ["a test marked it"])
    return run


def test_every_command_takes_the_checkpoint_training_would_resume_from(run_with_bad_newest, tmp_path):
    run, root = run_with_bad_newest, run_with_bad_newest / "checkpoints"
    # training: the collective choice of the ranks (here one), files checked
    assert ckpt.choose_resume(root, 0, 1).tag == "step_00000002"
    # the resolver every command uses, for the run directory and for its checkpoints/ directory
    assert ckpt.resolve(run).tag == ckpt.resolve(root).tag == "step_00000002"

    r = run_cmd("roformer_dist.cli.convert", "to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf"),
                "--check-docs", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "roformer_export.json").read_text())["step"] == 2

    r = run_cmd("roformer_dist.cli.eval", str(run), "--lengths", "128", "--batches", "1",
                "--json", str(tmp_path / "eval.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())[0]["step"] == 2

    from roformer_dist.finetune.models import load_classifier

    clf = load_classifier(str(run), ["neg", "pos"], from_scratch=False, seed=0)
    assert "step_00000002" in clf.description and "(step 2)" in clf.description

    # naming the BAD checkpoint itself is refused, with the reason
    r = run_cmd("roformer_dist.cli.eval", str(root / "step_00000004"), "--lengths", "128")
    assert r.returncode == 5 and "marked BAD" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs, filled up to the last block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        with open(disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def assert_full_disk_reported(r: subprocess.CompletedProcess, prog: str, disk: Path) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip() and "warn" not in line.lower()]
    assert r.returncode == EXIT_STORAGE, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr
    assert any(line.startswith(prog) and "No space left on device" in line and str(disk) in line
               for line in lines), r.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["filler"], "something half-written was left behind"


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory, small_shards) -> Path:
    from roformer_dist.checkpoint.weights import save_weights
    from roformer_dist.config import load_config
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = load_config(ROOT / "configs" / "experiments" / "debug.yaml",
                      [f"model.vocab_size={small_shards.vocab_size}"]).model
    path = tmp_path_factory.mktemp("weights") / "w.pt"
    save_weights(path, cfg, RoFormerForMaskedLM(cfg).state_dict())
    return path


def test_convert_from_hf_on_a_full_disk(weights_file, tmp_path, full_disk):
    hf = tmp_path / "hf"
    r = run_cmd("roformer_dist.cli.convert", "to-hf", "--checkpoint", str(weights_file), "--out", str(hf),
                "--no-tokenizer")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cmd("roformer_dist.cli.convert", "from-hf", "--hf-dir", str(hf), "--out", str(full_disk / "w.pt"))
    assert_full_disk_reported(r, "roformer-convert from-hf", full_disk)


def test_convert_to_hf_on_a_full_disk(weights_file, small_shards, full_disk):
    r = run_cmd("roformer_dist.cli.convert", "to-hf", "--checkpoint", str(weights_file), "--tokenizer",
                str(small_shards.dir), "--out", str(full_disk / "hf"))
    assert_full_disk_reported(r, "roformer-convert to-hf", full_disk)


def test_eval_json_on_a_full_disk(run_with_bad_newest, full_disk):
    r = run_cmd("roformer_dist.cli.eval", str(run_with_bad_newest), "--lengths", "128", "--batches", "1",
                "--json", str(full_disk / "eval.json"))
    assert_full_disk_reported(r, "roformer-eval", full_disk)


def test_finetune_on_a_full_disk(tmp_path, full_disk):
    for name, rows in (("train", [("好", "pos"), ("差", "neg")] * 8), ("dev", [("很好", "pos"), ("很差", "neg")])):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"sentence": s, "label": y}, ensure_ascii=False) + "\n" for s, y in rows))
    r = run_cmd("roformer_dist.cli.finetune", "--baseline", "ngram", "--train", str(tmp_path / "train.jsonl"),
                "--dev", str(tmp_path / "dev.jsonl"), "--out", str(full_disk / "ft"))
    # the output directory itself fits (an inode); its results.json does not
    assert r.returncode == EXIT_STORAGE and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "roformer-finetune: error: cannot write" in r.stderr and "No space left on device" in r.stderr
    assert not any(p.name != "results.json" and p.name.startswith(".") for p in (full_disk / "ft").iterdir())
    assert not (full_disk / "ft" / "results.json").exists()


def test_data_shards_on_a_full_disk(small_shards, full_disk):
    r = run_cmd("launcher.prepare", "shards", "--input", str(small_shards.source), "--tokenizer",
                str(small_shards.tokenizer), "--out", str(full_disk / "set"), "--no-progress")
    assert_full_disk_reported(r, "roformer-data shards", full_disk)


def test_submit_on_a_full_disk(small_shards, full_disk):
    r = run_cmd("launcher.cli", "--config", str(ROOT / "configs" / "experiments" / "debug.yaml"), "--cluster",
                "local", f"data.shards={small_shards.dir}", f"data.eval_shards={small_shards.eval_dir}",
                f"run_dir={full_disk / 'run'}", timeout=120)
    assert r.returncode == EXIT_STORAGE and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    assert "roformer-submit: error:" in r.stderr and "No space left on device" in r.stderr
