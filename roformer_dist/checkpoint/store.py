"""The checkpoint store: save, find, check and resolve checkpoints of a run directory.

Layout (``<run_dir>/checkpoints/``)::

    step_00000012/                 DeepSpeed files (model, optimizer; written by every rank)
        trainer_state_rank<r>.pt   the TrainerState payload of rank r (roformer_dist/checkpoint/trainer_state.py)
        COMPLETE                   written by rank 0 after a barrier: the checkpoint counts. JSON: step,
                                   world size, time, and every file of the save with its size and its
                                   content hash (checksums.py; ``checkpoint.checksums``)
        BAD                        written on resume when a file of it is missing or damaged: the reason.
                                   Such a checkpoint is skipped and kept (nothing is deleted)
        EVALUATED                  written once the eval a stop skipped at this step was run and recorded
                                   by a later launch (Trainer.run_skipped_eval)
        universal/                 made on demand for a resume at another world size (universal.py)
    latest                         tag of the newest COMPLETE checkpoint (atomic rename)

A checkpoint without ``COMPLETE`` never becomes ``latest``; resume ignores it and says so. Resume
takes the newest complete checkpoint whose files all check out (:func:`choose_resume`: presence, size
and content hash as saved, loadable), agreed by all ranks; a damaged one is marked ``BAD`` and the one
before it is used. DeepSpeed's own ``latest`` file is not written (``save_latest=False``). :func:`resolve`
is the one answer to "which checkpoint does this path name" for every command (newest complete, not BAD,
its files checked the same way).

Every file this module writes goes through ``data_pipeline.atomic`` (temporary file, fsync, rename).
An OS error while saving (disk full, read-only, permission) is raised as :class:`StorageError` naming
the path; ``latest`` still names the previous complete checkpoint and the half-written directory is
removed (it would never become ``latest`` anyway).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from data_pipeline.atomic import atomic_write_bytes, atomic_write_text
from roformer_dist.checkpoint.checksums import ALGORITHM, digest_file
from roformer_dist.checkpoint.safe_load import check_archive
from roformer_dist.checkpoint.trainer_state import TrainerState
from roformer_dist.checkpoint.write_errors import storage_error
from roformer_dist.config import Config, from_dict
from roformer_dist.errors import CheckpointError, StorageError
from roformer_dist.runtime.faults import NO_FAULTS, Faults
from roformer_dist.runtime.rundir import LATEST, RunDir

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
BAD = "BAD"
EVALUATED = "EVALUATED"
"""Written into a checkpoint whose step's eval a stop skipped, once a later launch has run and recorded it."""
_TAG_RE = re.compile(r"^step_(\d+)$")
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")
"""A file name COMPLETE may list: a plain name inside the checkpoint directory (no path, no ``..``)."""
_MARKERS = {COMPLETE, BAD, EVALUATED}


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG_RE.match(tag)
    if not m:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return int(m.group(1))


def state_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"trainer_state_rank{rank}.pt"


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def read_trainer_state(ckpt_dir: Path, rank: int) -> TrainerState:
    """The checked payload of ``trainer_state_rank<rank>.pt``; CheckpointError naming the file otherwise.
    Read once per file version in a process (a command asks for rank 0's several times): a copy of the
    cached payload, so a caller may change what it gets."""
    path = state_file(ckpt_dir, rank)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the trainer state of rank {rank})") from None
    return copy.deepcopy(_load_trainer_state(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _load_trainer_state(path: str, mtime_ns: int, size: int) -> TrainerState:  # noqa: ARG001 - the cache's key
    import torch  # (here, not at the top: roformer-train's launcher resolves a fresh run without torch)

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a damaged file
        raise CheckpointError(f"{path}: unreadable ({short_error(e)})") from None
    return TrainerState.from_dict(data, where=path)


def checkpoint_config(found: "Found | Path") -> Config:
    """The run config a checkpoint was written with (its rank 0 trainer state)."""
    return from_dict(read_trainer_state(getattr(found, "dir", found), 0).config)


def is_complete(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / COMPLETE).exists()


def is_bad(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / BAD).exists()


@dataclass(frozen=True)
class Found:
    dir: Path
    tag: str
    step: int
    world_size: int
    """World size (number of trainer_state_rank files) that wrote it."""
    files: dict[str, int]
    """Every file of the save with its size (from COMPLETE)."""
    hashes: dict[str, str] = field(default_factory=dict)
    """File name -> content hash (``checksums.ALGORITHM``) from COMPLETE; empty for a checkpoint written
    before checksums (or with ``checkpoint.checksums: false``)."""


def _tags(ckpt_root: Path) -> list[str]:
    return sorted((p.name for p in ckpt_root.iterdir() if p.is_dir() and _TAG_RE.match(p.name)), key=step_of)


def named_checkpoints(path: Path) -> tuple[Path, list[str], bool]:
    """What a user's path names (:data:`CHECKPOINT_FORMS`): (the checkpoints directory, its step tags oldest
    first, whether the path is one step directory, then its tag alone)."""
    p = Path(path)
    if state_file(p, 0).exists() or _TAG_RE.match(p.name):
        return p.parent, [p.name], True
    root = RunDir(p).checkpoints if RunDir(p).checkpoints.is_dir() else p
    return root, _tags(root), False


def read_latest(ckpt_root: Path) -> Optional[str]:
    """The tag ``latest`` names, or None (missing, or not a tag: garbage is reported, never fatal)."""
    path = Path(ckpt_root) / LATEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("%s is unreadable (%s); using the newest complete checkpoint", path, e)
        return None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        log.warning("%s holds bytes that are not UTF-8 (%r...); ignoring it, using the newest complete checkpoint",
                    path, raw[:16])
        return None
    if not _TAG_RE.match(tag):
        log.warning("%s holds %r, not a checkpoint tag; ignoring it, using the newest complete checkpoint",
                    path, tag[:40])
        return None
    return tag


def _read_complete(ckpt_root: Path, tag: str) -> Found:
    """The checkpoint ``tag`` as its COMPLETE marker describes it; OSError / ValueError / ... when the
    marker is unreadable or lists a name that is not a file inside the checkpoint."""
    d = ckpt_root / tag
    meta = json.loads((d / COMPLETE).read_text(encoding="utf-8"))
    files = {str(k): int(v) for k, v in meta["files"].items()}
    outside = [k for k in files if not _FILE_RE.fullmatch(k)]
    if outside:  # joined to the directory, such a name would make the checks read a file elsewhere
        raise ValueError(f"it lists {outside[0]!r}, not a file name inside the checkpoint")
    hashes = {str(k): str(v) for k, v in meta.get("hashes", {}).items()}
    if hashes and meta.get("hash") != ALGORITHM:
        raise ValueError(f"its hashes are {meta.get('hash')!r}, this version checks {ALGORITHM}")
    if set(hashes) - set(files):
        raise ValueError(f"it hashes {sorted(set(hashes) - set(files))[0]!r}, which it does not list")
    return Found(d, tag, step_of(tag), int(meta["world_size"]), files, hashes)


_MARKER_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError)


def read_found(ckpt_root: Path, tag: str) -> Optional[Found]:
    """The checkpoint ``tag`` as its COMPLETE marker describes it; None (logged) when the marker is unreadable."""
    try:
        return _read_complete(ckpt_root, tag)
    except _MARKER_ERRORS as e:
        log.warning("%s: unreadable %s marker (%s); skipping this checkpoint", ckpt_root / tag, COMPLETE,
                    short_error(e))
        return None


def candidates(ckpt_root: Path) -> list[Found]:
    """Complete checkpoints not marked BAD, newest first. Newer incomplete ones are reported and ignored."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    tags = _tags(ckpt_root)
    complete = [t for t in tags if is_complete(ckpt_root / t)]
    bad = [t for t in complete if is_bad(ckpt_root / t)]
    if bad:
        log.warning("skipping checkpoint(s) marked %s: %s (see the %s file in each)", BAD, ", ".join(bad), BAD)
    good = [t for t in complete if t not in bad]
    newest = step_of(good[-1]) if good else -1
    incomplete = [t for t in tags if t not in complete and step_of(t) > newest]
    if incomplete:
        log.warning("ignoring incomplete checkpoint(s)%s: %s (no %s marker)",
                    f" newer than {good[-1]}" if good else "", ", ".join(incomplete), COMPLETE)
    named = read_latest(ckpt_root)
    if named is not None and good and named != good[-1]:
        log.warning("%s names %s but the newest complete checkpoint is %s; using %s", ckpt_root / LATEST, named,
                    good[-1], good[-1])
    out = [read_found(ckpt_root, t) for t in reversed(good)]
    return [f for f in out if f is not None]


def find_resume(ckpt_root: Path) -> Optional[Found]:
    """The newest complete checkpoint not marked BAD (files not checked: see :func:`choose_resume`)."""
    found = candidates(ckpt_root)
    return found[0] if found else None


CHECKPOINT_FORMS = ("a run directory, its checkpoints/ directory, or a checkpoints/step_XXXXXXXX/ directory "
                    "holding trainer_state_rank0.pt")


def resolve(path: str | os.PathLike, read_only: bool = False) -> Found:
    """The checkpoint a user names, for ``to-hf``, ``roformer-eval``, fine-tuning and forks: the rule training
    resumes by. A run directory or a ``checkpoints/`` directory -> its newest complete checkpoint not marked
    BAD whose files check out (``latest`` is only a hint); a step directory -> itself, refused when it is
    incomplete or marked BAD. Its files are checked as a resume checks them (presence, size, content hash,
    structure): a damaged checkpoint is marked BAD, naming the file, and a run directory falls
    back to the one before it. CheckpointError naming the path otherwise. ``read_only`` (a dry run): the same
    choice, nothing marked."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or run directory")
    root, tags, single = named_checkpoints(p)
    if single:
        if not is_complete(p):
            raise CheckpointError(f"{p}: incomplete checkpoint (no {COMPLETE} marker): it was being written "
                                  "when the run stopped")
        if is_bad(p):
            reason = (p / BAD).read_text(encoding="utf-8", errors="replace").strip().splitlines()
            raise CheckpointError(f"{p}: marked {BAD} ({' '.join(reason[1:2]).strip() or 'see its BAD file'}); "
                                  "training skips it too")
        try:
            found = _read_complete(p.parent, p.name)
        except _MARKER_ERRORS as e:
            raise CheckpointError(f"{p}: unreadable {COMPLETE} marker ({short_error(e)})") from None
        problems = check_share(found, 0, 1)
        if problems:
            if read_only:
                raise CheckpointError(f"{p}: damaged (training would skip it): {'; '.join(problems)}")
            _reject(found, problems)
            raise CheckpointError(f"{p}: damaged, now marked {BAD} (training skips it too): {'; '.join(problems)}")
        return found
    if not ((root / LATEST).exists() or tags):
        raise CheckpointError(f"{path}: not a roformer-dist checkpoint (expected {CHECKPOINT_FORMS})")
    rejected = []
    for found in candidates(root):
        problems = check_share(found, 0, 1)
        if not problems:
            if rejected:
                log.warning("using %s instead (the newest usable checkpoint)", found.tag)
            return found
        if not read_only:
            _reject(found, problems)
        rejected.append(f"{found.tag}: " + "; ".join(problems))
    if rejected:
        raise CheckpointError(f"{root}: no usable checkpoint ({' | '.join(rejected)})")
    raise CheckpointError(f"{root}: no complete checkpoint that is not marked {BAD}")


def _reject(found: Found, problems: list[str]) -> None:
    log.error("checkpoint %s is damaged, marking it %s: %s", found.dir, BAD, "; ".join(problems))
    mark_bad(found.dir, problems)


# --------------------------------------------------------------------------- checking files


def check_file(ckpt_dir: Path, name: str, size: int, digest: Optional[str] = None) -> Optional[str]:
    """Why ``name`` of a checkpoint is unusable, or None: present, its size as saved, its content hash as
    saved (when ``digest`` is given), loadable."""
    path = Path(ckpt_dir) / name
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror})"
    if actual != size:
        return f"{path}: {actual} bytes, {size} when saved (truncated or overwritten)"
    if digest is not None:
        try:
            now = digest_file(path)
        except OSError as e:
            return f"{path}: cannot be read ({e.strerror})"
        if now != digest:
            return (f"{path}: its content changed since it was saved ({ALGORITHM} {now[:16]}..., "
                    f"{digest[:16]}... when saved; same size: flipped bits or overwritten)")
    if not name.endswith(".pt"):
        return None
    if name.startswith("trainer_state_rank"):
        try:
            read_trainer_state(ckpt_dir, int(name[len("trainer_state_rank"):-3]))
        except (CheckpointError, ValueError) as e:
            return str(e)
        return None
    return check_archive(path)  # its structure, unpickling nothing


def check_share(found: Found, rank: int, world_size: int) -> list[str]:
    """This rank's share of the checks of ``found`` (file i goes to rank i % world_size)."""
    files = sorted(found.files.items())
    return [p for i, (name, size) in enumerate(files) if i % world_size == rank
            for p in [check_file(found.dir, name, size, found.hashes.get(name))] if p]


def saved_files(ckpt_dir: Path) -> list[Path]:
    """The files of a save in its directory (markers and hidden files aside), sorted by name."""
    return [p for p in sorted(Path(ckpt_dir).iterdir())
            if p.is_file() and p.name not in _MARKERS and not p.name.startswith(".")]


def hash_share(ckpt_dir: Path, rank: int, world_size: int) -> dict[str, str]:
    """This rank's share of the content hashes of a save's files (file i goes to rank i % world_size), read
    back once every rank's files are durable."""
    return {p.name: digest_file(p) for i, p in enumerate(saved_files(ckpt_dir)) if i % world_size == rank}


def mark_bad(ckpt_dir: Path, problems: list[str]) -> None:
    """Record why a checkpoint is unusable; nothing is deleted."""
    text = (f"marked bad at {time.strftime('%Y-%m-%d %H:%M:%S')} on resume; skipped from now on. Problems:\n"
            + "".join(f"  {p}\n" for p in problems))
    try:
        atomic_write_text(Path(ckpt_dir) / BAD, text)
    except OSError as e:
        log.warning("could not write %s/%s (%s); the checkpoint is skipped this time only", ckpt_dir, BAD, e)


class Comm(Protocol):
    """The collectives the checkpoint layer needs (``runtime.process_group.TorchComm`` over the default
    process group; :class:`LocalComm` for one process)."""

    def barrier(self) -> None: ...

    def all_gather(self, obj: Any) -> list[Any]: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""


class LocalComm:
    """One process: no communication."""

    def barrier(self) -> None:
        pass

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj


class SavesCheckpoint(Protocol):
    """What :func:`save` needs of the runner: DeepSpeed's files of ``tag`` under ``root``."""

    def save_checkpoint(self, root: str, tag: str) -> None: ...


def choose_resume(ckpt_root: Path, rank: int, world_size: int, comm: Comm = LocalComm(), read_only: bool = False,
                  accept: Optional[Callable[[Found], bool]] = None) -> Optional[Found]:
    """The newest complete checkpoint whose files all check out, the same on every rank (collective).

    Rank 0's list of candidates is used by all; each rank checks a share of the files; the problems
    are gathered, so every rank takes the same decision. A damaged checkpoint is logged with the
    files and reasons and marked BAD (rank 0); the next older one is tried. Raises CheckpointError when
    complete checkpoints exist but none is usable. ``read_only`` (a dry run): the same choice, logged, with
    nothing marked and ``latest`` left as it is. ``accept``: only the candidates it accepts are considered
    (a loss-spike rollback's: those before the spike), and ``latest`` is left as it is (it names where a resume
    starts, the newest checkpoint)."""
    found = comm.broadcast([f for f in candidates(ckpt_root) if accept is None or accept(f)] if rank == 0 else None)
    rejected = []
    for f in found:
        problems = [p for share in comm.all_gather(check_share(f, rank, world_size)) for p in share]
        if not problems:
            if rejected:
                log.warning("resuming from %s instead (the newest usable checkpoint)", f.tag)
            if rank == 0 and not read_only and accept is None:
                _point_latest_at(ckpt_root, f.tag)
            return f
        rejected.append(f"{f.tag}: " + "; ".join(problems))
        if rank == 0 and read_only:
            log.error("checkpoint %s is damaged (a run would mark it %s and fall back): %s", f.dir, BAD,
                      "; ".join(problems))
        elif rank == 0:
            _reject(f, problems)
    if rejected:
        raise CheckpointError(f"{ckpt_root}: no usable checkpoint ({' | '.join(rejected)}); repair or remove "
                              "them, or start a new run in another run_dir")
    return None


def _point_latest_at(ckpt_root: Path, tag: str) -> None:
    """``latest`` names ``tag``, the checkpoint a run resumes from, when it named another: one just marked BAD
    (whose slot is cleared when its step is saved again: ``latest`` must never name a missing checkpoint), or
    an older one (a save killed between its COMPLETE and the rename of ``latest``)."""
    if read_latest(ckpt_root) != tag:
        try:
            atomic_write_text(ckpt_root / LATEST, tag + "\n")
        except OSError as e:
            log.warning("could not point %s at %s (%s)", ckpt_root / LATEST, tag, e)


# --------------------------------------------------------------------------- saving


def torch_bytes(obj) -> bytes:
    """What ``torch.save`` would write for ``obj``."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` through the atomic writer: serialised in memory, written, fsync-ed, renamed."""
    atomic_write_bytes(path, torch_bytes(obj))


def _clear_slot(ckpt_root: Path, tag: str) -> None:
    """Make room for a save of ``tag``: a leftover of an interrupted save is removed; a checkpoint marked
    BAD is moved aside (``<tag>.bad``, ``<tag>.bad1``, ...), never deleted."""
    d = ckpt_root / tag
    if not d.exists():
        return
    if is_bad(d):
        n, aside = 0, ckpt_root / f"{tag}.bad"
        while aside.exists():
            n += 1
            aside = ckpt_root / f"{tag}.bad{n}"
        os.replace(d, aside)
        log.warning("moved the checkpoint marked %s to %s to save %s again", BAD, aside, tag)
        return
    shutil.rmtree(d)


def describe_latest(ckpt_root: Path) -> str:
    tag = read_latest(ckpt_root)
    if tag is None:
        return "there is no complete checkpoint yet"
    state = "complete" if is_complete(ckpt_root / tag) else "NOT complete"
    return f"{ckpt_root / LATEST} still names {tag} ({state})"


def begin_save(ckpt_root: Path, tag: str, rank: int, comm: Comm) -> None:
    """Every rank: rank 0 makes room for ``tag`` (:func:`_clear_slot`), then all meet."""
    if rank == 0:
        _clear_slot(ckpt_root, tag)
    comm.barrier()


def commit(ckpt_root: Path, step: int, world_size: int, keep_last: int, faults: Faults = NO_FAULTS,
           hashes: Optional[dict[str, str]] = None) -> Path:
    """Rank 0, once every rank's files of ``step`` are durable: COMPLETE (listing each file, its size and,
    given ``hashes``, its content hash: one the writers did not give is computed here), then ``latest``, then
    :func:`prune`."""
    ckpt_dir = ckpt_root / tag_for(step)
    missing = [r for r in range(world_size) if not state_file(ckpt_dir, r).exists()]
    if missing:
        raise CheckpointError(f"{ckpt_dir}: trainer state of ranks {missing} missing after the save barrier")
    paths = saved_files(ckpt_dir)
    files = {p.name: p.stat().st_size for p in paths}
    meta = {"step": step, "world_size": world_size, "time": time.time(), "files": files}
    if hashes is not None:
        meta["hash"] = ALGORITHM
        meta["hashes"] = {p.name: hashes.get(p.name) or digest_file(p) for p in paths}
    faults.point("save.before_complete")
    atomic_write_text(ckpt_dir / COMPLETE, json.dumps(meta, indent=1) + "\n")
    faults.point("save.before_latest")
    atomic_write_text(ckpt_root / LATEST, ckpt_dir.name + "\n")
    faults.point("save.after_latest")
    prune(ckpt_root, keep_last)
    return ckpt_dir


def save_failure(e: BaseException, ckpt_root: Path, tag: str, rank: int) -> StorageError:
    """The StorageError for ``e`` (re-raised when it is not a storage failure: a bug); rank 0 removes the
    half-written directory first, so ``latest`` keeps naming the previous complete checkpoint."""
    ckpt_dir = ckpt_root / tag
    err = storage_error(e, f"saving checkpoint {tag}", ckpt_dir)
    if err is None:
        raise e
    if rank == 0 and not is_complete(ckpt_dir):
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return err.with_note(describe_latest(ckpt_root))


def save(runner: SavesCheckpoint, ckpt_root: Path, step: int, payload: TrainerState, rank: int, world_size: int, keep_last: int,
         comm: Comm = LocalComm(), faults: Faults = NO_FAULTS, before_commit: Callable[[], None] = lambda: None,
         checksums: bool = True) -> Path:
    """Every rank calls this. Returns the checkpoint directory once it is COMPLETE and ``latest``.

    ``before_commit`` runs on every rank once every rank's files are written, before rank 0 commits
    (the trainer makes its records of this step durable there).

    ``runner.save_checkpoint(root, tag)`` writes the DeepSpeed files. An OS error on this rank is
    raised as StorageError after the half-written directory is removed (rank 0), so ``latest`` keeps
    naming the previous complete checkpoint. With ``checksums`` each rank then hashes a share of the files
    (:func:`hash_share`) for COMPLETE. ``checkpoint/async_save.py`` is the same protocol with the writing in a
    background thread."""
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    ckpt_dir = ckpt_root / tag
    t0 = time.monotonic()
    try:
        begin_save(ckpt_root, tag, rank, comm)
        faults.point("save.begin")
        faults.point("save.before_file")
        runner.save_checkpoint(str(ckpt_root), tag)
        faults.point("save.after_file")
        faults.in_save(step, rank, world_size)
        faults.point("save.before_file")
        atomic_torch_save(payload.to_dict(), state_file(ckpt_dir, rank))
        faults.point("save.after_file")
        comm.barrier()
        hashes = None
        if checksums:  # the gather is the barrier: every rank's files are durable
            hashes = {k: v for share in comm.all_gather(hash_share(ckpt_dir, rank, world_size)) for k, v in share.items()}
        before_commit()
        if rank == 0:
            commit(ckpt_root, step, world_size, keep_last, faults, hashes)
            log.info("saved checkpoint %s in %.1f s", ckpt_dir, time.monotonic() - t0)
        comm.barrier()
    except (OSError, RuntimeError) as e:
        raise save_failure(e, ckpt_root, tag, rank) from None
    return ckpt_dir


def prune(ckpt_root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` good complete checkpoints; drop incomplete ones older than them.
    Checkpoints marked BAD are kept for inspection."""
    tags = _tags(ckpt_root)
    complete = [t for t in tags if is_complete(ckpt_root / t) and not is_bad(ckpt_root / t)]
    keep = set(complete[-keep_last:])
    newest_kept = step_of(complete[-1]) if complete else -1
    for t in tags:
        if t not in keep and step_of(t) <= newest_kept and not is_bad(ckpt_root / t):
            shutil.rmtree(ckpt_root / t, ignore_errors=True)


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` and write (then remove) a file in it; StorageError naming it otherwise.

    Run before training, so a read-only or full checkpoint directory fails at start-up, not at the
    first save after hours of work."""
    directory = Path(directory)
    probe = directory / f".write_probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(probe, b"ok\n")
        probe.unlink()
    except OSError as e:
        if e.errno is not None and not e.filename:
            e = OSError(e.errno, e.strerror, str(directory))
        raise StorageError.from_os_error(e, f"checking that {what} is writable") from None


