"""Asynchronous checkpoints (``checkpoint.async: true``): the step loop goes on while the files are written.

The protocol of :func:`store.save` is kept; only who writes, and when, changes. In the step loop, on
every rank: wait for this rank's previous save (:meth:`AsyncSaver.wait`), rank 0 makes room, all meet,
DeepSpeed's files and the trainer state are serialised into host memory (``parallel.snapshot.capture``;
the collectives DeepSpeed runs in a save still run here), and a background thread takes the bytes. The
thread hashes each file's bytes (``checksums.py``) and writes it atomically (temporary file, fsync,
rename), then its rank's marker ``.written.<rank>`` holding the hashes (or ``.failed.<rank>`` with the
reason). On rank 0 the thread then waits for every rank's marker, reads the hashes, removes the markers
and commits (:func:`store.commit`: COMPLETE, then ``latest``, then pruning). No collective runs in a background thread: the ranks meet through the markers in the
checkpoint directory, which every rank already shares.

So COMPLETE still appears only when every rank's files are durable, and ``latest`` only after it. A
failed background write is raised as the synchronous one is (StorageError, exit 74) at the next step,
save or wait of that rank; rank 0 then removes the incomplete directory and ``latest`` keeps naming the
previous checkpoint. A process killed mid-write leaves a directory without COMPLETE, which resume
ignores. A stop or the end of the run calls :meth:`AsyncSaver.wait`, which returns when the save is
committed (rank 0) or written (the others).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

from data_pipeline.atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from roformer_dist.checkpoint import store
from roformer_dist.checkpoint.checksums import digest_bytes
from roformer_dist.checkpoint.trainer_state import TrainerState
from roformer_dist.errors import CheckpointError, StorageError
from roformer_dist.runtime.faults import NO_FAULTS, Faults

__all__ = ["AsyncSaver", "SnapshotsCheckpoint"]

log = logging.getLogger(__name__)

WRITTEN = ".written."
FAILED = ".failed."
_POLL_S = 0.02


class SnapshotsCheckpoint(Protocol):
    """What the saver needs of the runner (``parallel.runner.ParallelRunner``)."""

    def snapshot_checkpoint(self, root: str, tag: str) -> list[tuple[Path, bytes]]: ...


class AsyncSaver:
    """One per rank; at most one save in flight. Not thread-safe: the step loop's thread calls it."""

    def __init__(self, ckpt_root: Path, rank: int, world_size: int, keep_last: int, comm: store.Comm,
                 timeout_s: float, faults: Faults = NO_FAULTS, checksums: bool = True):
        self.ckpt_root = Path(ckpt_root)
        self.checksums = checksums
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.comm, self.timeout_s, self.faults = comm, timeout_s, faults
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._step: Optional[int] = None

    # ------------------------------------------------------------------ the step loop's side
    def save(self, runner: SnapshotsCheckpoint, step: int, payload: TrainerState,
             before_commit: Callable[[], None] = lambda: None) -> None:
        """Wait for the previous save, snapshot ``step`` and hand it to the background writer.
        ``before_commit`` runs here, after the snapshot and before the writer starts (so before any commit)."""
        self.wait()
        tag = store.tag_for(step)
        ckpt_dir = self.ckpt_root / tag
        try:
            store.begin_save(self.ckpt_root, tag, self.rank, self.comm)
            self.faults.point("save.begin")
            files = runner.snapshot_checkpoint(str(self.ckpt_root), tag)
            self.faults.in_save(step, self.rank, self.world_size)
            files.append((store.state_file(ckpt_dir, self.rank), store.torch_bytes(payload.to_dict())))
        except (OSError, RuntimeError) as e:
            raise store.save_failure(e, self.ckpt_root, tag, self.rank) from None
        before_commit()
        self._step, self._error = step, None
        self._thread = threading.Thread(target=self._write, args=(step, files), name=f"checkpoint-writer-{tag}",
                                        daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Raise the error of a finished background save, once (called after every step)."""
        if self._thread is not None and not self._thread.is_alive():
            self._finish()

    def wait(self) -> None:
        """Block until the save in flight is committed (rank 0) or written (other ranks); raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._finish()

    @property
    def in_flight(self) -> Optional[int]:
        """The step being written, if any."""
        return self._step if self._thread is not None and self._thread.is_alive() else None

    def _finish(self) -> None:
        self._thread, error, self._error = None, self._error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ the writer thread
    def _write(self, step: int, files: list[tuple[Path, bytes]]) -> None:
        tag = store.tag_for(step)
        ckpt_dir = self.ckpt_root / tag
        t0 = time.monotonic()
        try:
            self.faults.in_background_write(step)
            hashes = {}
            for path, data in files:
                if self.checksums:  # the bytes as they go to the file
                    hashes[path.name] = digest_bytes(data)
                self.faults.point("save.before_file")
                atomic_write_bytes(path, data)
                self.faults.point("save.after_file")
            for d in sorted({p.parent for p, _ in files}):
                fsync_dir(d)
            atomic_write_text(ckpt_dir / f"{WRITTEN}{self.rank}", json.dumps({"time": time.time(), "hashes": hashes}))
            if self.rank == 0:
                hashes = self._wait_for_ranks(ckpt_dir)
                for r in range(self.world_size):  # before COMPLETE: a kill after it leaves no marker in a checkpoint
                    (ckpt_dir / f"{WRITTEN}{r}").unlink(missing_ok=True)
                store.commit(self.ckpt_root, step, self.world_size, self.keep_last, self.faults,
                             hashes if self.checksums else None)
                log.info("saved checkpoint %s in the background in %.1f s", ckpt_dir, time.monotonic() - t0)
        except (OSError, RuntimeError, CheckpointError) as e:
            self._error = self._failure(e, ckpt_dir, tag)
        except BaseException as e:  # a bug: raised in the step loop with its traceback
            self._error = e

    def _wait_for_ranks(self, ckpt_dir: Path) -> dict[str, str]:
        """Wait for every rank's marker; the content hashes they hold, merged."""
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(self.world_size))
        hashes: dict[str, str] = {}
        while True:
            for r in sorted(waiting):
                failed = ckpt_dir / f"{FAILED}{r}"
                if failed.exists():
                    raise _reported(failed, r)
                written = ckpt_dir / f"{WRITTEN}{r}"
                if written.exists():
                    hashes.update(_marker_hashes(written))
                    waiting.discard(r)
            if not waiting:
                return hashes
            if time.monotonic() > deadline:
                raise CheckpointError(f"{ckpt_dir}: ranks {sorted(waiting)} did not finish writing their files "
                                      f"within {self.timeout_s:.0f} s (dist.timeout_s)")
            time.sleep(_POLL_S)

    def _failure(self, e: BaseException, ckpt_dir: Path, tag: str) -> BaseException:
        """The error to raise in the step loop; other ranks learn of it through ``.failed.<rank>``."""
        if isinstance(e, (CheckpointError, StorageError)):  # ours already: another rank's report, a commit's
            err: BaseException = e
            if self.rank == 0 and not store.is_complete(ckpt_dir):
                shutil.rmtree(ckpt_dir, ignore_errors=True)
                if isinstance(e, StorageError):
                    err = e.with_note(store.describe_latest(self.ckpt_root))
        else:
            try:
                err = store.save_failure(e, self.ckpt_root, tag, self.rank)
            except BaseException as bug:
                err = bug
        if self.rank != 0:
            try:
                atomic_write_text(ckpt_dir / f"{FAILED}{self.rank}", f"{getattr(err, 'errno', 0) or 0}\n{err}\n")
            except OSError:
                pass  # rank 0 then waits for this rank until dist.timeout_s; this rank exits with err meanwhile
        return err


def _marker_hashes(marker: Path) -> dict[str, str]:
    """The hashes a ``.written.<rank>`` marker holds (none from an unreadable one: commit computes those)."""
    try:
        return dict(json.loads(marker.read_text(encoding="utf-8")).get("hashes", {}))
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _reported(marker: Path, rank: int) -> Exception:
    """Rank 0's error for another rank's failed write: a StorageError (exit 74) when that one was."""
    code, _, message = marker.read_text(errors="replace").partition("\n")
    text = f"rank {rank} could not write its files: {message.strip()}"
    if code.strip().isdigit() and int(code):
        err = StorageError(text)
        err.errno = int(code)
        return err
    return CheckpointError(f"{marker.parent}: {text}")
