"""Checkpoints, stored configs and run directories that someone else wrote.

Each case was reproduced as an attack first: a pickle that runs a command when a checkpoint file is
loaded, a ``COMPLETE`` whose file list leaves the checkpoint, a stored config whose eval shard set is
a ``pipe:`` command, a run directory owned by another user, writable by the group, or with a
``checkpoints`` symlink into another run. The commands must refuse each with one message, and the
planted command must not run."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.checksums import digest_file
from roformer_dist.checkpoint.safe_load import check_archive, load, weights_only_loads
from roformer_dist.checkpoint.weights import load_checkpoint_weights
from roformer_dist.config import load_config, to_dict
from roformer_dist.errors import CheckpointError, ConfigError
from roformer_dist.runtime.rundir import prepare_run_dir
from roformer_dist.runtime.runlock import RunLock
from test_checkpoint_files import DEBUG, TorchSaveRunner, payload, save

BIN = Path(sys.executable).parent


class RunsACommand:
    """Unpickling this runs ``touch <marker>``: what a malicious checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil_pt(path: Path, marker: Path) -> Path:
    torch.save({"module": {"w": torch.ones(3)}, "extra": RunsACommand(marker)}, path)
    return path


class EvilRunner(TorchSaveRunner):
    """A save whose model file carries the planted command (sizes in COMPLETE match: it is 'intact')."""

    def __init__(self, marker: Path):
        super().__init__()
        self.marker = marker

    def save_checkpoint(self, root, tag):
        super().save_checkpoint(root, tag)
        evil_pt(Path(root) / tag / "mp_rank_00_model_states.pt", self.marker)


def test_the_planted_pickle_would_run_when_loaded_plainly(tmp_path):
    """The attack is real: a plain torch.load runs it (so the refusals below are not vacuous)."""
    marker = tmp_path / "ran"
    torch.load(evil_pt(tmp_path / "x.pt", marker), weights_only=False)
    assert marker.exists()


def test_pickled_code_in_a_checkpoint_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    d = save(tmp_path / "ck", 4, runner=EvilRunner(marker))
    problem = check_archive(d / "mp_rank_00_model_states.pt")
    assert problem and "refused: it pickles posix.system" in problem
    # the resume check marks it BAD and falls back to nothing: no usable checkpoint
    with pytest.raises(CheckpointError, match="posix.system"):
        ckpt.choose_resume(tmp_path / "ck", 0, 1)
    assert (d / ckpt.BAD).exists()
    (d / ckpt.BAD).unlink()
    with pytest.raises(CheckpointError, match="refused: it pickles posix.system"):
        load(d / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="refused"):  # ZeRO-2 config: DeepSpeed's own loader reads it
        load_checkpoint_weights(d)
    with pytest.raises(CheckpointError, match="refused"), weights_only_loads():
        torch.load(d / "mp_rank_00_model_states.pt", weights_only=False)  # as DeepSpeed calls it
    assert torch.load is not None and torch.load.__name__ == "load"  # restored after the block
    assert not marker.exists()


def test_to_hf_of_a_checkpoint_with_pickled_code_exits_5_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    d = save(tmp_path / "run" / "checkpoints", 4, runner=EvilRunner(marker))
    p = subprocess.run([str(BIN / "roformer-convert"), "to-hf", "--checkpoint", str(d), "--out", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 5, p.stderr
    assert "refused" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_complete_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "ck"
    d = save(root, 4)
    outside = evil_pt(tmp_path / "evil.pt", marker)
    meta = json.loads((d / ckpt.COMPLETE).read_text())
    meta["files"]["../../evil.pt"] = outside.stat().st_size
    (d / ckpt.COMPLETE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./evil\.pt', not a file name inside"):
        ckpt.resolve(d)
    assert ckpt.candidates(root) == []  # skipped, with a warning, like any unreadable marker
    meta["files"] = {str(outside): outside.stat().st_size}  # an absolute path
    (d / ckpt.COMPLETE).write_text(json.dumps(meta))
    assert ckpt.choose_resume(root, 0, 1) is None
    assert not marker.exists()


def test_real_torch_files_pass_the_structural_check(tmp_path):
    d = save(tmp_path, 4)
    assert [check_archive(d / n) for n in sorted(ckpt.find_resume(tmp_path).files) if n.endswith(".pt")] == \
        [None] * 5
    raw = (d / "mp_rank_00_model_states.pt").read_bytes()
    i = raw.index(b"data.pkl")  # damage the pickle's bytes, not the archive's index
    (tmp_path / "flip.pt").write_bytes(raw[:i + 200] + bytes([raw[i + 200] ^ 0xFF]) + raw[i + 201:])
    assert check_archive(tmp_path / "flip.pt") is not None


def test_eval_does_not_run_a_pipe_url_from_a_stored_config(tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / "run" / "checkpoints"
    d = save(root, 4)
    state = payload(4)
    cfg = to_dict(load_config(DEBUG, ["model.vocab_size=100"]))
    cfg["data"]["eval_shards"] = f"pipe:touch {marker}; cat /dev/null/{{name}}"
    state.config = cfg
    ckpt.atomic_torch_save(state.to_dict(), ckpt.state_file(d, 0))
    meta = json.loads((d / ckpt.COMPLETE).read_text())
    meta["files"]["trainer_state_rank0.pt"] = ckpt.state_file(d, 0).stat().st_size
    # a consistent checkpoint, as whoever wrote it would make it (the content hash would catch a change otherwise)
    meta["hashes"]["trainer_state_rank0.pt"] = digest_file(ckpt.state_file(d, 0))
    (d / ckpt.COMPLETE).write_text(json.dumps(meta))
    p = subprocess.run([str(BIN / "roformer-eval"), str(tmp_path / "run"), "--lengths", "64"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "data.eval_shards of the run is the URL" in p.stderr and "--eval-shards" in p.stderr
    assert "Traceback" not in p.stderr and not marker.exists()


# --------------------------------------------------------------------------- run directories


def test_run_directories_are_created_0750_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        with RunLock(tmp_path / "runs" / "a"):
            pass
    finally:
        os.umask(old)
    for p in (tmp_path / "runs", tmp_path / "runs" / "a", tmp_path / "runs" / "a" / "checkpoints",
              tmp_path / "runs" / "a" / "logs"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o750, p
    record = tmp_path / "runs" / "a" / "run.lock.json"
    assert not record.exists()  # released


def test_a_group_writable_run_dir_is_refused_unless_the_mode_allows_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o770)
    with pytest.raises(ConfigError, match=r"run_dir: .*writable by the group .*chmod go-w"):
        RunLock(run).acquire()
    with RunLock(run, mode="0770"):
        pass
    os.chmod(run, 0o757)
    with pytest.raises(ConfigError, match="writable by others"):
        RunLock(run, mode="0770").acquire()


def test_a_checkpoints_symlink_is_refused_not_followed(tmp_path, small_shards):
    other = tmp_path / "other_run" / "checkpoints"
    save(other, 4)
    before = sorted(p.name for p in other.rglob("*"))
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    (run / "checkpoints").symlink_to(other)
    p = subprocess.run([str(BIN / "roformer-train"), "--config", str(DEBUG), f"run_dir={run}",
                        f"data.shards={small_shards.dir}", f"data.eval_shards={small_shards.eval_dir}",
                        f"model.vocab_size={small_shards.vocab_size}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "checkpoints is a symlink" in p.stderr and "not followed" in p.stderr and "Traceback" not in p.stderr
    assert sorted(p.name for p in other.rglob("*")) == before  # nothing read, marked or pruned there


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_run_dir_owned_by_another_user_is_refused(tmp_path):
    run = tmp_path / "theirs"
    run.mkdir(mode=0o755)
    os.chown(run, 65534, 65534)
    with pytest.raises(ConfigError, match=r"belongs to .*uid 65534.*not to you"):
        RunLock(run).acquire()
    assert not (run / ".run.lock").exists()  # nothing written into it


def test_a_damaged_lock_record_is_a_warning_not_a_traceback(tmp_path, caplog):
    run = prepare_run_dir(tmp_path / "run")
    (run / "run.lock.json").write_text(json.dumps({"host": "h", "pid": "12; rm -rf /", "since": "", "command": ""}))
    with RunLock(run) as lock:
        assert lock.holder.uid == os.geteuid()
        assert json.loads((run / "run.lock.json").read_text())["uid"] == os.geteuid()
    assert "unreadable" in caplog.text and "'pid'" in caplog.text


def test_run_dir_mode_is_validated():
    for bad in ("0650", "750", "rwx", "0999"):
        with pytest.raises(ConfigError, match="run_dir_mode"):
            load_config(DEBUG, [f"run_dir_mode={bad}"])
    assert load_config(DEBUG, ["run_dir_mode=0770"]).run_dir_mode == "0770"


def test_exported_files_are_never_group_or_world_writable(tmp_path):
    from roformer_dist.hf.export import share_with_group

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    old = os.umask(0)
    try:
        share_with_group(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644 and stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


def test_a_unicode_digit_label_is_sorted_not_a_traceback(tmp_path):
    from roformer_dist.finetune.data import label_list, read_examples

    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"sentence": t, "label": lab}) + "\n"
                         for t, lab in (("好", "1"), ("坏", "²"), ("行", "10"))), encoding="utf-8")
    ds = read_examples(f)
    assert label_list(ds, ds) == ["1", "10", "²"]  # not all integers: sorted as text


def test_a_forged_slurm_job_id_in_a_lock_record_never_reaches_squeue(tmp_path, monkeypatch):
    from roformer_dist.runtime.runlock import Holder, holder_alive

    marker = tmp_path / "squeue_ran"
    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\necho RUNNING\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    forged = Holder(host="elsewhere", pid=1, since="", command="", slurm_job_id="--user=root")
    assert holder_alive(forged) is None and not marker.exists()  # cannot be told: the launch is refused
    real = Holder(host="elsewhere", pid=1, since="", command="", slurm_job_id="4242_3")
    assert holder_alive(real) is True and marker.read_text().split() == ["-h", "--jobs=4242_3", "-o", "%T"]


def test_fine_tuning_readers_refuse_an_endless_line_and_deep_json(tmp_path):
    from data_pipeline.corpus import MAX_LINE_BYTES
    from data_pipeline.errors import DataError
    from roformer_dist.finetune.data import read_examples

    f = tmp_path / "train.jsonl"
    with open(f, "wb") as out:
        out.write(b'{"sentence": "ok", "label": 1}\n{"sentence": "')
        out.write(b"x" * (MAX_LINE_BYTES + 10))
        out.write(b'", "label": 0}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: a line of \d+ bytes, over the limit"):
        read_examples(f)
    f.write_text('{"sentence": "a", "label": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(DataError, match=r"train.jsonl:1: invalid JSON \(nested too deeply\)"):
        read_examples(f)
    t = tmp_path / "train.tsv"
    t.write_bytes(b"sentence\tlabel\n" + b"y" * (MAX_LINE_BYTES + 1) + b"\t1\n")
    with pytest.raises(DataError, match=r"train.tsv:2: a line of"):
        read_examples(t)


def test_the_url_time_limit_is_the_configs(small_shards):
    from data_pipeline.source import default_retry, set_default_retry
    from roformer_dist.plan.data import resolve_data

    before = default_retry()
    try:
        resolve_data(load_config(DEBUG, [f"data.shards={small_shards.dir}", f"data.eval_shards={small_shards.eval_dir}",
                                         "data.url_timeout_s=7.5"]))
        assert default_retry().timeout_s == 7.5
    finally:
        set_default_retry(before)
    with pytest.raises(ConfigError, match="data.url_timeout_s"):
        load_config(DEBUG, ["data.url_timeout_s=0"])
