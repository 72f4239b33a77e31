"""Asynchronous checkpoints (``checkpoint.async``): the protocol of the synchronous save with the writing
in a background thread per rank.

- the writer threads of two ranks (real files, a threading barrier for the collectives): COMPLETE and
  ``latest`` only after both ranks' files; a rank whose write fails leaves ``latest`` on the previous
  checkpoint, the half-written directory removed, and both ranks raise;
- ``roformer-train`` with async saves, SIGTERM to the whole process group while a save is being written:
  the stop waits for it, exits 75 with ``latest`` on a complete checkpoint, and the resumed run's loss
  trace equals the uninterrupted (synchronous) reference, step by step.
(A full disk under an async save: ``test_reliability.py::test_full_disk_during_a_save_then_resume``.)
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.async_save import AsyncSaver
from roformer_dist.checkpoint.trainer_state import TrainCounters, TrainerState
from roformer_dist.errors import StorageError
from roformer_dist.runtime.faults import NO_FAULTS, Faults
from roformer_dist.runtime.stop import EXIT_DONE, EXIT_REQUEUE
from trainer_runs import assert_traces_equal, cli_overrides, reference_run, run_cli, trace, wait_for_group_gone


class ThreadComm:
    """The collectives of ``world_size`` ranks that are threads of this process."""

    def __init__(self, world_size: int):
        self._barrier = threading.Barrier(world_size, timeout=30)

    def barrier(self) -> None:
        self._barrier.wait()


class FilesRunner:
    """A runner whose "DeepSpeed files" are one file per rank, optionally failing like a full disk."""

    def __init__(self, rank: int, fail_at: frozenset[int] = frozenset()):
        self.rank, self.fail_at = rank, fail_at

    def snapshot_checkpoint(self, root: str, tag: str) -> list[tuple[Path, bytes]]:
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        name = "no_such_dir/x" if ckpt.step_of(tag) in self.fail_at else f"model_rank{self.rank}.pt"
        return [(d / name, ckpt.torch_bytes({"rank": self.rank, "w": torch.zeros(250 * (self.rank + 1))}))]


def payload(step: int, rank: int) -> TrainerState:
    return TrainerState(trainer=TrainCounters(step=step), loader={}, rng={}, world_size=2, rank=rank, config={},
                        tokenizer_sha256="0" * 64, stage_index=0)


def two_ranks(root: Path, fn, faults=None):
    """Run ``fn(rank, saver)`` on two threads (ranks 0 and 1); return what each returned or raised."""
    comm = ThreadComm(2)
    out: dict[int, object] = {}

    def main(rank):
        saver = AsyncSaver(root, rank, 2, keep_last=2, comm=comm, timeout_s=20,
                           faults=(faults or {}).get(rank, NO_FAULTS))
        try:
            out[rank] = fn(rank, saver)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_complete_only_after_every_rank_and_a_failed_write_keeps_latest(tmp_path):
    root = tmp_path / "checkpoints"

    def good(rank, saver):
        saver.save(FilesRunner(rank), 4, payload(4, rank))
        saver.wait()
        return saver

    out = two_ranks(root, good)
    assert all(isinstance(v, AsyncSaver) for v in out.values()), out
    assert ckpt.read_latest(root) == "step_00000004" and ckpt.is_complete(root / "step_00000004")
    files = sorted(p.name for p in (root / "step_00000004").iterdir())
    assert files == ["COMPLETE", "model_rank0.pt", "model_rank1.pt", "trainer_state_rank0.pt",
                     "trainer_state_rank1.pt"]  # the markers are gone, the files are listed
    assert ckpt.check_share(ckpt.resolve(root), 1, 2) == []

    # rank 1's write fails (a path that cannot be created): rank 1 raises its StorageError, rank 0 a
    # StorageError naming rank 1 and its reason; the directory is removed, latest keeps naming step 4
    def failing(rank, saver):
        saver.save(FilesRunner(rank, fail_at=frozenset({8}) if rank == 1 else frozenset()), 8, payload(8, rank))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            saver.poll()  # what the step loop does after every step
            time.sleep(0.01)
        return "no error"

    out = two_ranks(root, failing)
    assert isinstance(out[1], StorageError) and out[1].errno == errno.ENOENT, out
    assert "saving checkpoint step_00000008" in str(out[1])
    assert isinstance(out[0], StorageError) and "rank 1 could not write its files: saving checkpoint step_00000008" in str(out[0]), out
    assert out[0].errno == errno.ENOENT and "still names step_00000004" in str(out[0])
    assert ckpt.read_latest(root) == "step_00000004"
    assert not (root / "step_00000008").exists()


def test_rank_zero_commits_only_after_a_slow_rank(tmp_path):
    root = tmp_path / "checkpoints"
    release = threading.Event()

    class HeldBack(Faults):  # rank 1's writer starts only when the test says so
        def in_background_write(self, step):
            release.wait(20)

    def run(rank, saver):
        saver.save(FilesRunner(rank), 4, payload(4, rank))
        if rank == 0:
            time.sleep(0.5)  # rank 0's own files are written by now
            assert saver.in_flight == 4 and (root / "step_00000004" / ".written.0").exists()
            assert not ckpt.is_complete(root / "step_00000004") and ckpt.read_latest(root) is None
            release.set()
        saver.wait()
        return ckpt.is_complete(root / "step_00000004")

    out = two_ranks(root, run, faults={1: HeldBack()})
    assert out[0] is True, out  # rank 0's wait returns once committed (rank 1's once its own files are written)
    assert ckpt.read_latest(root) == "step_00000004"


@pytest.mark.slow
def test_sigterm_during_an_async_save_then_resume_exactly(small_shards, tmp_path, tmp_path_factory):
    reference = reference_run(tmp_path_factory, small_shards)
    run = tmp_path / "run"
    over = cli_overrides(small_shards, run, "trainer.save_every=4", "checkpoint.async=true")
    # every background write sleeps 4 s first: the SIGTERM lands while step 4's save is in flight
    p = run_cli(over, {"ROFORMER_WRITE_DELAY_S": "4", "ROFORMER_STEP_DELAY_S": "0.2"})
    slot = run / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + 180
    while not (slot / "trainer_state_rank1.pt.tmp").exists() and not slot.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert slot.exists() and not ckpt.is_complete(slot), "the save of step 4 was expected in flight"
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == EXIT_REQUEUE, out[-4000:]
    assert "Traceback" not in out
    assert "waiting for the checkpoint of step" in out
    stopped_at = ckpt.step_of(ckpt.read_latest(run / "checkpoints"))
    assert stopped_at >= 4 and ckpt.is_complete(run / "checkpoints" / ckpt.tag_for(stopped_at))
    assert ckpt.is_complete(slot)  # the save in flight was finished, not dropped
    assert not any(p_.name.startswith(".") for p_ in slot.iterdir())
    assert wait_for_group_gone(p.pid) == []
    assert len(trace(run)) == stopped_at

    p = run_cli(over)
    out, _ = p.communicate(timeout=240)
    assert p.returncode == EXIT_DONE, out[-4000:]
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)
    # the async checkpoint holds the same files as the synchronous one of the same step
    sync, asyn = reference / "checkpoints" / "step_00000016", run / "checkpoints" / "step_00000016"
    assert sorted(f.name for f in sync.iterdir()) == sorted(f.name for f in asyn.iterdir())
