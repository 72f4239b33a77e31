"""One run per run directory: a file lock plus a record of who holds it.

``roformer-train``'s local spawner holds the lock for the life of the run; under torchrun or SLURM
global rank 0 does. A second launch on the same ``run_dir`` is refused with :class:`RunLockedError`
(exit status 6) naming the holder: host, pid, SLURM job id and attempt, since when, command.

Files (``<run_dir>/``)::

    .run.lock        the lock target (``flock``); empty, never deleted (deleting it would let two
                     processes lock two different files of the same name)
    run.lock.json    the holder record, written atomically after the lock is taken, removed on release

Decisions (:func:`decide`):

- The file lock is free and there is no record, or the record is this host's and its process is
  gone: take it (a record left by a killed run is reported as a stale lock taken over).
- The record names the same SLURM job as ours with another attempt (``SLURM_RESTART_COUNT``): a
  requeued job takes its own lock back, even while the old attempt's lock lingers (a dead node's
  lease on a network filesystem), after waiting up to ``requeue_grace_s`` for it.
- The record names another host: SLURM is asked (``squeue``) whether the holder's job still runs;
  a job that does not is a stale lock. Without SLURM a record of another host cannot be proven
  stale: the launch is refused and the message says which file to delete if the holder is gone.
- The file lock is held by another process: refused.

What is guaranteed: on a local filesystem, and on shared filesystems whose ``flock`` is coherent
across hosts (NFSv4, NFSv3 with lockd, GPFS, Lustre mounted with ``-o flock``), at most one run holds a
run directory; the kernel releases the lock when its holder dies, however it dies. Where ``flock``
fails (Lustre without ``flock``: ENOSYS; some FUSE filesystems) the record alone decides: it is
created with an atomic ``link`` (exclusive on NFS too), so of two launches that race only one wins,
but two launches that take over the *same stale* record at the same instant could both proceed.
Lustre's ``localflock`` makes locks node-local: two hosts could then both lock; the record check
above (another host's live holder) still refuses the second launch when the holder runs under SLURM.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.atomic import atomic_write_text, fsync_dir
from roformer_dist.config import DEFAULT_RUN_DIR_MODE
from roformer_dist.errors import RunLockedError, StorageError
from roformer_dist.runtime.rundir import prepare_run_dir

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
HOLDER_FILE = "run.lock.json"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HELD = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}
_SLURM_ALIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
                "RESIZING"}


def pid_start(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), to tell a live
    process from another that reuses its pid; None when there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (field 2) may hold spaces and parentheses: split after its closing ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory."""

    host: str
    pid: int
    since: str
    """Local time the lock was taken, ISO 8601."""
    command: str
    slurm_job_id: str = ""
    slurm_attempt: int = 0
    """SLURM_RESTART_COUNT: 0 for the first run of a job, n after n requeues."""
    pid_start: Optional[int] = None
    """The holder process's start time (clock ticks since boot) where known."""
    uid: Optional[int] = None
    """The holder's user id (None in records written before it was recorded)."""

    @classmethod
    def from_record(cls, data: object) -> "Holder":
        """A record read back; TypeError for one whose fields have the wrong types (a damaged or forged
        record: a pid that is not an integer would otherwise reach ``os.kill``)."""
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        kinds = {"host": str, "pid": int, "since": str, "command": str, "slurm_job_id": str,
                 "slurm_attempt": int, "pid_start": (int, type(None)), "uid": (int, type(None))}
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for k, kind in kinds.items():
            if k in fields and (not isinstance(fields[k], kind) or isinstance(fields[k], bool)):
                raise TypeError(f"field {k!r} is {fields[k]!r}")
        return cls(**fields)

    @classmethod
    def of_this_process(cls) -> "Holder":
        return cls(host=socket.gethostname(), pid=os.getpid(), since=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
                   slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
                   slurm_attempt=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                   pid_start=pid_start(os.getpid()), uid=os.geteuid())

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id} attempt {self.slurm_attempt}" if self.slurm_job_id else ""
        return f"pid {self.pid} on host {self.host}{job}, since {self.since}: {self.command}"

    def same_job_other_attempt(self, other: "Holder") -> bool:
        return bool(self.slurm_job_id) and self.slurm_job_id == other.slurm_job_id and \
            self.slurm_attempt != other.slurm_attempt


SLURM_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
"""A SLURM job id as sbatch prints it (``4242``), or one element of a job array (``4242_3``)."""


def slurm_job_alive(job_id: str) -> Optional[bool]:
    """Whether SLURM job ``job_id`` is still running; None when SLURM cannot be asked (or ``job_id``, read
    from a record, is not a job id: it never reaches the command line)."""
    if not SLURM_JOB_ID.fullmatch(job_id):
        return None
    try:
        p = subprocess.run(["squeue", "-h", f"--jobs={job_id}", "-o", "%T"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        # squeue forgets finished jobs after MinJobAge: "Invalid job id specified"
        return False if "Invalid job id" in p.stderr else None
    states = {s.strip() for s in p.stdout.split()}
    return bool(states & _SLURM_ALIVE)


def holder_alive(h: Holder, host: Optional[str] = None) -> Optional[bool]:
    """True / False when it can be told, None when it cannot (another host without SLURM)."""
    if h.slurm_job_id:
        alive = slurm_job_alive(h.slurm_job_id)
        if alive is not None:
            return alive
    if h.host == (host or socket.gethostname()):
        if h.pid <= 0:
            return False
        try:
            os.kill(h.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        start = pid_start(h.pid)
        return h.pid_start is None or start is None or start == h.pid_start
    return None


@dataclass(frozen=True)
class Decision:
    take: bool
    message: str
    """Why: logged as a warning when a lock is taken over, the error message when refused."""
    wait_for_lock: bool = False
    """A requeued job whose previous attempt still holds the file lock: wait a little for it."""


def decide(*, lock_free: bool, holder: Optional[Holder], me: Holder, alive: Optional[bool],
           record_path: Path) -> Decision:
    """Take or refuse the lock (see the module docstring); pure, so every case is a unit test.

    ``lock_free``: the file lock was taken (or the filesystem has none and the record decides);
    ``alive``: :func:`holder_alive` of ``holder``."""
    if holder is None:
        if lock_free:
            return Decision(True, "")
        return Decision(False, f"{record_path.parent} is in use by another run (the lock is held; no holder "
                               f"record in {record_path.name} yet: it is starting)")
    if holder.same_job_other_attempt(me):
        return Decision(True, f"taking back the run lock of SLURM job {holder.slurm_job_id} from its attempt "
                              f"{holder.slurm_attempt} (requeued)", wait_for_lock=not lock_free)
    if not lock_free:
        return Decision(False, f"{record_path.parent} is in use by another run: {holder.describe()}")
    if alive is False:
        return Decision(True, f"taking over a stale run lock of {holder.describe()} (that process is not running)")
    if alive is True:
        return Decision(False, f"{record_path.parent} is in use by another run: {holder.describe()} (its file lock "
                               "is not visible from here: the filesystem's locks are not shared between hosts)")
    return Decision(False, f"{record_path.parent} may be in use by another run: {holder.describe()}; it runs on "
                           f"another host and cannot be checked from here. If it is gone, delete {record_path}")


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir`` for the block (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, *, mode: str = DEFAULT_RUN_DIR_MODE, use_flock: bool = True,
                 requeue_grace_s: float = 30.0):
        """``mode``: ``run_dir_mode``, for the directories created and the ownership check
        (:mod:`roformer_dist.runtime.rundir`)."""
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.lock_path = self.run_dir / LOCK_FILE
        self.record_path = self.run_dir / HOLDER_FILE
        self.use_flock = use_flock
        self.requeue_grace_s = requeue_grace_s
        self.holder: Optional[Holder] = None
        self._fd: Optional[int] = None

    # ------------------------------------------------------------------ record
    def read_holder(self) -> Optional[Holder]:
        try:
            return Holder.from_record(json.loads(self.record_path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as e:
            log.warning("%s is unreadable (%s); treating the run lock as unrecorded", self.record_path, e)
            return None

    def _write_record(self, me: Holder, replace: bool) -> None:
        text = json.dumps(asdict(me), indent=1) + "\n"
        if replace:
            atomic_write_text(self.record_path, text)
            return
        # exclusive creation (no file lock to rely on): link() fails if the record exists, also on NFS
        tmp = self.record_path.with_name(f".{HOLDER_FILE}.{me.host}.{me.pid}")
        atomic_write_text(tmp, text)
        try:
            os.link(tmp, self.record_path)
        except FileExistsError:
            raise RunLockedError(f"{self.run_dir} was taken by another run a moment ago: "
                                 f"{(self.read_holder() or me).describe()}") from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.run_dir)

    # ------------------------------------------------------------------ lock
    def _try_flock(self) -> Optional[bool]:
        """True: locked; False: held by another process; None: this filesystem has no file locks."""
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _HELD:
                return False
            if e.errno in _NO_LOCKS:
                return None
            raise

    def acquire(self) -> "RunLock":
        me = Holder.of_this_process()
        prepare_run_dir(self.run_dir, self.mode)
        try:
            self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise StorageError.from_os_error(e, "taking the run lock") from None
        got = self._try_flock() if self.use_flock else None
        if got is None and self.use_flock:
            log.warning("%s: this filesystem offers no file locks; the holder record %s alone guards the run "
                        "directory", self.lock_path, self.record_path.name)
        holder = self.read_holder()
        if holder is not None and holder.host == me.host and holder.pid == me.pid:
            holder = None  # our own record (a lock taken twice in one process)
        alive = holder_alive(holder) if holder is not None and got is not False else None
        d = decide(lock_free=got is not False, holder=holder, me=me, alive=alive, record_path=self.record_path)
        if not d.take:
            self._close()
            raise RunLockedError(d.message)
        if d.wait_for_lock:
            deadline = time.monotonic() + self.requeue_grace_s
            while got is False and time.monotonic() < deadline:
                time.sleep(0.5)
                got = self._try_flock()
            if got is False:
                log.warning("%s: the previous attempt's file lock is still held after %.0f s; going on with the "
                            "holder record alone", self.lock_path, self.requeue_grace_s)
        if d.message:  # before logging is set up: straight to the console
            print(f"roformer-train: {d.message}", file=sys.stderr, flush=True)
        try:
            self._write_record(me, replace=got is True or holder is not None)
        except OSError as e:
            self._close()
            raise StorageError.from_os_error(e, "writing the run lock record") from None
        except RunLockedError:
            self._close()
            raise
        self.holder = me
        return self

    def release(self) -> None:
        """Remove our record and unlock; safe to call twice and from an abort path."""
        if self.holder is not None:
            current = self.read_holder()
            if current is not None and (current.host, current.pid) == (self.holder.host, self.holder.pid):
                with contextlib.suppress(OSError):
                    self.record_path.unlink()
            self.holder = None
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
