"""The checkpoint layer's files, in one process: COMPLETE's file list, checks before loading (missing,
truncated, unloadable), BAD markers and fallback, a garbage ``latest``, saves that fail on a full or
read-only filesystem (real tmpfs mounts when running as root, skipped otherwise).

The stand-in runner writes real ``torch.save`` files under the names DeepSpeed gives them; real
DeepSpeed checkpoints are damaged and resumed end to end in test_reliability.py."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.config import load_config, to_dict
from roformer_dist.errors import CheckpointError, StorageError
from roformer_dist.checkpoint.trainer_state import TrainCounters, TrainerState
from trainer_runs import flip_byte

DEBUG = Path(__file__).resolve().parent.parent / "configs" / "experiments" / "debug.yaml"
WORLD = 2


class TorchSaveRunner:
    """Writes what a 2-rank ZeRO-2 DeepSpeed save writes, with ``torch.save``: one model file, one
    optimizer file per rank (``floats`` fp32 values each)."""

    def __init__(self, floats=1000):
        self.floats = floats

    def save_checkpoint(self, root, tag):
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": {"w": torch.ones(self.floats)}}, d / "mp_rank_00_model_states.pt")
        for r in range(WORLD):
            torch.save({"optimizer_state_dict": {"exp_avg": torch.zeros(self.floats)}},
                       d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def payload(step, rank=0):
    cfg = load_config(DEBUG, ["model.vocab_size=100"])
    return TrainerState(trainer=TrainCounters(step=step), loader={"format": 1}, rng={}, world_size=WORLD,
                        rank=rank, config=to_dict(cfg), tokenizer_sha256="ab" * 32, stage_index=0)


class OtherRank(ckpt.LocalComm):
    """Rank 0's barriers; at the one after the trainer states, rank 1's state is there as well."""

    def __init__(self, ckpt_dir: Path, step: int):
        self.ckpt_dir, self.step, self.calls = ckpt_dir, step, 0

    def barrier(self):
        self.calls += 1
        if self.calls == 2:
            ckpt.atomic_torch_save(payload(self.step, 1).to_dict(), ckpt.state_file(self.ckpt_dir, 1))


def save(root, step, runner=None, keep_last=3):
    """Rank 0's save of a 2-rank job in one process (rank 1's trainer state arrives at the barrier)."""
    comm = OtherRank(Path(root) / ckpt.tag_for(step), step)
    return ckpt.save(runner or TorchSaveRunner(), root, step, payload(step, 0), 0, WORLD, keep_last, comm)


def choose(root):
    return ckpt.choose_resume(root, 0, 1)


def test_complete_lists_every_file_with_its_size(tmp_path):
    d = save(tmp_path, 4)
    meta = json.loads((d / ckpt.COMPLETE).read_text())
    assert meta["step"] == 4 and meta["world_size"] == WORLD
    assert sorted(meta["files"]) == ["mp_rank_00_model_states.pt", "trainer_state_rank0.pt", "trainer_state_rank1.pt",
                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert all(meta["files"][n] == (d / n).stat().st_size for n in meta["files"])
    assert (tmp_path / ckpt.LATEST).read_text() == "step_00000004\n"
    assert choose(tmp_path).tag == "step_00000004"


def test_damaged_newest_checkpoints_are_marked_bad_and_skipped(tmp_path, caplog):
    for step in (4, 8, 12):
        save(tmp_path, step)
    state = tmp_path / "step_00000012" / "trainer_state_rank0.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    (tmp_path / "step_00000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with caplog.at_level(logging.WARNING):
        found = choose(tmp_path)
    assert found.tag == "step_00000004"
    bad12 = (tmp_path / "step_00000012" / ckpt.BAD).read_text()
    assert "trainer_state_rank0.pt: 100 bytes" in bad12 and "truncated" in bad12
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in (tmp_path / "step_00000008" / ckpt.BAD).read_text()
    assert "trainer_state_rank0.pt" in caplog.text and "zero_pp_rank_1" in caplog.text
    assert state.exists() and (tmp_path / "step_00000012" / "mp_rank_00_model_states.pt").exists()  # nothing deleted
    # marked once, skipped from then on without checking again
    assert [f.tag for f in ckpt.candidates(tmp_path)] == ["step_00000004"]
    # `latest` named step 12: it now names the checkpoint resumed from, so that it never names a missing
    # directory when step 12 is saved again (the BAD one is moved aside first; found by bench/chaos.py)
    assert ckpt.read_latest(tmp_path) == "step_00000004"


def test_latest_follows_a_save_killed_between_complete_and_its_rename(tmp_path):
    """COMPLETE written, then the process died before `latest` moved (bench/chaos.py, save.before_latest): the
    resume takes the complete checkpoint and points `latest` at it, even when no step is left to train."""
    save(tmp_path, 4)
    save(tmp_path, 8)
    (tmp_path / ckpt.LATEST).write_text("step_00000004\n")
    assert choose(tmp_path).tag == "step_00000008" and ckpt.read_latest(tmp_path) == "step_00000008"


def without_hashes(ckpt_dir):
    """COMPLETE as a checkpoint written before checksums has it."""
    meta = json.loads((ckpt_dir / ckpt.COMPLETE).read_text())
    del meta["hash"], meta["hashes"]
    (ckpt_dir / ckpt.COMPLETE).write_text(json.dumps(meta))


def test_a_file_that_does_not_load_is_named_even_at_its_saved_size(tmp_path):
    d = save(tmp_path, 4)
    f = d / "mp_rank_00_model_states.pt"
    f.write_bytes(b"\0" * f.stat().st_size)  # same size, not an archive
    problems = ckpt.check_share(ckpt.find_resume(tmp_path), 0, 1)
    assert len(problems) == 1 and "mp_rank_00_model_states.pt: its content changed since it was saved" in problems[0]
    without_hashes(d)  # an older checkpoint: size and structure still catch it
    problems = ckpt.check_share(ckpt.find_resume(tmp_path), 0, 1)
    assert len(problems) == 1 and "mp_rank_00_model_states.pt: unreadable" in problems[0]


def test_a_flipped_byte_that_still_loads_is_caught_by_its_hash_and_the_checkpoint_before_is_used(tmp_path, caplog):
    for step in (4, 8):
        save(tmp_path, step)
    meta = json.loads((tmp_path / "step_00000008" / ckpt.COMPLETE).read_text())
    assert meta["hash"] == "xxh3_128" and set(meta["hashes"]) == set(meta["files"])
    optim = tmp_path / "step_00000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # a byte of the tensor data (the end of the archive holds its index): torch.load still reads it
    flip_byte(optim, optim.stat().st_size // 3)
    torch.load(optim, weights_only=True)
    assert ckpt.check_archive(optim) is None  # size and structure as saved: only the hash sees it
    # roformer-convert verify / to-hf / roformer-eval / forks (store.resolve) and resume (choose_resume) alike
    with caplog.at_level(logging.ERROR):
        assert ckpt.resolve(tmp_path).tag == "step_00000004"
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: its content changed" in caplog.text
    assert "zero_pp_rank_1" in (tmp_path / "step_00000008" / ckpt.BAD).read_text()
    assert choose(tmp_path).tag == "step_00000004"


def test_a_damaged_step_directory_named_explicitly_is_refused_and_marked(tmp_path):
    d = save(tmp_path, 4)
    flip_byte(d / "trainer_state_rank1.pt", 200)
    with pytest.raises(CheckpointError, match=r"step_00000004: damaged, now marked BAD .*trainer_state_rank1.pt"):
        ckpt.resolve(d)
    assert ckpt.is_bad(d)


def test_resolve_read_only_makes_the_same_choice_and_marks_nothing(tmp_path):
    """A dry run's resolve (a warm start's or a decay branch's parent): the checkpoint before a damaged one, or a
    refusal of a damaged step directory, with nothing marked BAD."""
    for step in (4, 8):
        save(tmp_path, step)
    flip_byte(tmp_path / "step_00000008" / "trainer_state_rank1.pt", 200)
    assert ckpt.resolve(tmp_path, read_only=True).tag == "step_00000004"
    with pytest.raises(CheckpointError, match=r"step_00000008: damaged \(training would skip it\): .*rank1.pt"):
        ckpt.resolve(tmp_path / "step_00000008", read_only=True)
    assert not ckpt.is_bad(tmp_path / "step_00000008")
    assert ckpt.resolve(tmp_path).tag == "step_00000004" and ckpt.is_bad(tmp_path / "step_00000008")


def test_a_checkpoint_from_before_checksums_is_still_resumed(tmp_path):
    d = save(tmp_path, 4)
    without_hashes(d)
    assert ckpt.resolve(tmp_path).hashes == {} and choose(tmp_path).tag == "step_00000004"


def test_checks_are_shared_between_ranks(tmp_path):
    found = ckpt.find_resume(save(tmp_path, 4).parent)
    (found.dir / "trainer_state_rank1.pt").unlink()
    (found.dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    shares = [ckpt.check_share(found, r, 2) for r in range(2)]
    assert sorted(p.split("/")[-1] for s in shares for p in s) == [
        "trainer_state_rank1.pt: missing", "zero_pp_rank_0_mp_rank_00_optim_states.pt: missing"]
    assert all(len(s) == 1 for s in shares)  # five files, two ranks: each checked a part


def test_garbage_latest_is_ignored(tmp_path, caplog):
    save(tmp_path, 4)
    save(tmp_path, 8)
    (tmp_path / ckpt.LATEST).write_bytes(b"\xff\xfe\x00garbage")
    with caplog.at_level(logging.WARNING):
        assert choose(tmp_path).tag == "step_00000008"
    assert "not UTF-8" in caplog.text
    (tmp_path / ckpt.LATEST).write_text("../../etc\n")
    assert ckpt.read_latest(tmp_path) is None and choose(tmp_path).tag == "step_00000008"


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    d = save(tmp_path, 4)
    (d / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint.*mp_rank_00_model_states.pt: missing"):
        choose(tmp_path)


def test_a_complete_marker_without_its_file_list_is_skipped(tmp_path, caplog):
    save(tmp_path, 4)
    d = save(tmp_path, 8)
    (d / ckpt.COMPLETE).write_text(json.dumps({"step": 8, "world_size": WORLD, "time": 0}))
    assert choose(tmp_path).tag == "step_00000004"
    assert "unreadable COMPLETE marker" in caplog.text and "step_00000008" in caplog.text


def test_saving_over_a_bad_checkpoint_moves_it_aside(tmp_path):
    d = save(tmp_path, 4)
    ckpt.mark_bad(d, ["x: missing"])
    save(tmp_path, 4)
    assert (tmp_path / "step_00000004.bad" / ckpt.BAD).exists()
    assert ckpt.is_complete(d) and not ckpt.is_bad(d)
    ckpt.prune(tmp_path, 1)
    assert (tmp_path / "step_00000004.bad").exists()


def test_prune_keeps_bad_checkpoints(tmp_path):
    for step in (4, 8, 12):
        save(tmp_path, step, keep_last=5)
    ckpt.mark_bad(tmp_path / "step_00000004", ["x: missing"])
    ckpt.prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000012"]


# --------------------------------------------------------------------------- filesystems that refuse writes


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    """A real tmpfs of ``size`` at ``path``; skips the test when mounting is not allowed here."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_save_on_a_full_disk_keeps_latest_on_the_complete_checkpoint(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as root:
        save(root, 4, TorchSaveRunner(floats=40_000))  # three files of ~160 KB: fits
        with pytest.raises(StorageError) as info:
            save(root, 8, TorchSaveRunner(floats=100_000))  # ~1.2 MB: does not
        msg = str(info.value)
        assert "saving checkpoint step_00000008" in msg and "No space left on device (ENOSPC)" in msg
        assert str(root / "step_00000008") in msg
        assert f"{root / ckpt.LATEST} still names step_00000004 (complete)" in msg
        assert info.value.errno == errno.ENOSPC
        assert not (root / "step_00000008").exists()  # the half-written directory went, latest never moved
        assert ckpt.read_latest(root) == "step_00000004" and choose(root).tag == "step_00000004"


def test_read_only_checkpoint_directory_is_found_before_training(tmp_path):
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        with pytest.raises(StorageError, match=r"checking that the checkpoint directory is writable: cannot write "
                                               rf"{ro}.*Read-only file system \(EROFS\)"):
            ckpt.check_writable(ro, "the checkpoint directory")
        with pytest.raises(StorageError, match="EROFS"):
            save(ro, 4)


def test_a_trainer_state_is_read_once_per_version_and_its_config_comes_back_typed(tmp_path, monkeypatch):
    """A command asks for rank 0's trainer state several times (to-hf: the model card, the config, the
    counters): the file is loaded once while it is unchanged, a changed file is read again, and every caller
    gets its own copy."""
    d = tmp_path / "step_00000004"
    d.mkdir()
    ckpt.atomic_torch_save(payload(4).to_dict(), ckpt.state_file(d, 0))
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    first, second = ckpt.read_trainer_state(d, 0), ckpt.read_trainer_state(d, 0)
    assert len(loads) == 1 and first.trainer.step == second.trainer.step == 4
    first.trainer.step = 99
    assert ckpt.read_trainer_state(d, 0).trainer.step == 4  # a copy each time
    cfg = ckpt.checkpoint_config(d)
    assert cfg.model.vocab_size == 100 and cfg == load_config(DEBUG, ["model.vocab_size=100"])
    ckpt.atomic_torch_save(payload(8).to_dict(), ckpt.state_file(d, 0))  # another version of the file
    assert ckpt.read_trainer_state(d, 0).trainer.step == 8 and len(loads) == 2


def test_a_dry_run_chooses_the_same_checkpoint_and_writes_nothing(tmp_path, caplog):
    for step in (4, 8):
        save(tmp_path, step)
    state = tmp_path / "step_00000008" / "trainer_state_rank0.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    with caplog.at_level(logging.WARNING):
        found = ckpt.choose_resume(tmp_path, 0, 1, read_only=True)
    assert found.tag == "step_00000004" and "a run would mark it BAD" in caplog.text
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
    assert ckpt.read_latest(tmp_path) == "step_00000008"  # left as it was
    assert choose(tmp_path).tag == "step_00000004"  # the run's own choice: the same one, now marked
    assert (tmp_path / "step_00000008" / ckpt.BAD).exists()
