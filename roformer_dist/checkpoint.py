"""Save, find, check and resume checkpoints; convert for another world size; read weights for export.

Layout (``<run_dir>/checkpoints/``)::

    step_00000012/                 DeepSpeed files (model, optimizer; written by every rank)
        trainer_state_rank<r>.pt   the TrainerState payload of rank r (roformer_dist/trainer_state.py)
        COMPLETE                   written by rank 0 after a barrier: the checkpoint counts. JSON: step,
                                   world size, time, and every file of the save with its size
        BAD                        written on resume when a file of it is missing or damaged: the reason.
                                   Such a checkpoint is skipped and kept (nothing is deleted)
        universal/                 made on demand for a resume at another world size
    latest                         tag of the newest COMPLETE checkpoint (atomic rename)

A checkpoint without ``COMPLETE`` never becomes ``latest``; resume ignores it and says so. Resume
takes the newest complete checkpoint whose files all check out (:func:`choose_resume`: presence, size
as saved, loadable), agreed by all ranks; a damaged one is marked ``BAD`` and the one before it is
used. DeepSpeed's own ``latest`` file is not written (``save_latest=False``).

Every file this module writes goes through ``data_pipeline.atomic`` (temporary file, fsync, rename).
An OS error while saving (disk full, read-only, permission) is raised as :class:`StorageError` naming
the path; ``latest`` still names the previous complete checkpoint and the half-written directory is
removed (it would never become ``latest`` anyway).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from data_pipeline.atomic import atomic_write_bytes, atomic_write_text
from roformer_dist.errors import CheckpointError, StorageError
from roformer_dist.faults import NO_FAULTS, Faults
from roformer_dist.trainer_state import TrainerState

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
LATEST = "latest"
UNIVERSAL = "universal"
BAD = "BAD"
_TAG_RE = re.compile(r"^step_(\d+)$")
_MARKERS = {COMPLETE, BAD}


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG_RE.match(tag)
    if not m:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return int(m.group(1))


def state_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"trainer_state_rank{rank}.pt"


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def read_trainer_state(ckpt_dir: Path, rank: int) -> TrainerState:
    """The checked payload of ``trainer_state_rank<rank>.pt``; CheckpointError naming the file otherwise."""
    path = state_file(ckpt_dir, rank)
    if not path.exists():
        raise CheckpointError(f"{path}: missing (the trainer state of rank {rank})")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a damaged file
        raise CheckpointError(f"{path}: unreadable ({_short(e)})") from None
    return TrainerState.from_dict(data, where=str(path))


def load_trainer_state(ckpt_dir: Path, rank: int) -> dict:
    """The same payload as a mapping (``TrainerState.to_dict``: trainer, loader, rng, world_size, rank,
    config, tokenizer_sha256, stage_index, format), for callers that read it by key."""
    return read_trainer_state(ckpt_dir, rank).to_dict()


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
    files: Optional[dict[str, int]] = None
    """Every file of the save with its size (from COMPLETE); None for checkpoints of earlier versions."""


def _tags(ckpt_root: Path) -> list[str]:
    return sorted((p.name for p in ckpt_root.iterdir() if p.is_dir() and _TAG_RE.match(p.name)), key=step_of)


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


def _found(ckpt_root: Path, tag: str) -> Optional[Found]:
    d = ckpt_root / tag
    try:
        meta = json.loads((d / COMPLETE).read_text(encoding="utf-8"))
        files = meta.get("files")
        return Found(d, tag, step_of(tag), int(meta["world_size"]),
                     {str(k): int(v) for k, v in files.items()} if isinstance(files, dict) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("%s: unreadable %s marker (%s); skipping this checkpoint", d, COMPLETE, _short(e))
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
    out = [_found(ckpt_root, t) for t in reversed(good)]
    return [f for f in out if f is not None]


def find_resume(ckpt_root: Path) -> Optional[Found]:
    """The newest complete checkpoint not marked BAD (files not checked: see :func:`choose_resume`)."""
    found = candidates(ckpt_root)
    return found[0] if found else None


# --------------------------------------------------------------------------- checking files


def _expected_files(found: Found) -> dict[str, Optional[int]]:
    """The files a checkpoint must hold: every file COMPLETE lists (with its size); for checkpoints of
    earlier versions the trainer states, what DeepSpeed files are there, and one ZeRO optimizer file
    per data-parallel rank for plain data parallelism."""
    if found.files is not None:
        return dict(found.files)
    names: dict[str, Optional[int]] = {state_file(found.dir, r).name: None for r in range(found.world_size)}
    for p in found.dir.glob("*.pt"):
        names.setdefault(p.name, None)
    try:
        cfg = read_trainer_state(found.dir, 0).config
        zero = int(cfg["deepspeed"]["zero_stage"])
        layout = (int(cfg["parallel"]["tensor"]), int(cfg["parallel"]["pipeline"]))
    except (CheckpointError, KeyError, TypeError, ValueError):
        return names
    if zero >= 1 and layout == (1, 1):
        prefix = "bf16_zero" if cfg["deepspeed"].get("precision") == "bf16" else "zero"
        for d in range(found.world_size):
            names.setdefault(f"{prefix}_pp_rank_{d}_mp_rank_00_optim_states.pt", None)
    return names


def check_file(ckpt_dir: Path, name: str, size: Optional[int]) -> Optional[str]:
    """Why ``name`` of a checkpoint is unusable, or None: present, its size as saved, loadable."""
    path = Path(ckpt_dir) / name
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror})"
    if size is not None and actual != size:
        return f"{path}: {actual} bytes, {size} when saved (truncated or overwritten)"
    if not name.endswith(".pt"):
        return None
    if name.startswith("trainer_state_rank"):
        try:
            read_trainer_state(ckpt_dir, int(name[len("trainer_state_rank"):-3]))
        except (CheckpointError, ValueError) as e:
            return str(e)
        return None
    try:
        # mmap: reads the archive's index and the pickled structure, not the tensor data
        torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure to load is a damaged file
        return f"{path}: unreadable ({_short(e)})"
    return None


def check_share(found: Found, rank: int, world_size: int) -> list[str]:
    """This rank's share of the checks of ``found`` (file i goes to rank i % world_size)."""
    files = sorted(_expected_files(found).items())
    return [p for i, (name, size) in enumerate(files) if i % world_size == rank
            for p in [check_file(found.dir, name, size)] if p]


def mark_bad(ckpt_dir: Path, problems: list[str]) -> None:
    """Record why a checkpoint is unusable; nothing is deleted."""
    text = (f"marked bad at {time.strftime('%Y-%m-%d %H:%M:%S')} on resume; skipped from now on. Problems:\n"
            + "".join(f"  {p}\n" for p in problems))
    try:
        atomic_write_text(Path(ckpt_dir) / BAD, text)
    except OSError as e:
        log.warning("could not write %s/%s (%s); the checkpoint is skipped this time only", ckpt_dir, BAD, e)


class Comm:
    """The collectives the checkpoint layer needs; the default is one process (no communication)."""

    def barrier(self) -> None:
        pass

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj


def choose_resume(ckpt_root: Path, rank: int, world_size: int, comm: Comm = Comm()) -> Optional[Found]:
    """The newest complete checkpoint whose files all check out, the same on every rank (collective).

    Rank 0's list of candidates is used by all; each rank checks a share of the files; the problems
    are gathered, so every rank takes the same decision. A damaged checkpoint is logged with the
    files and reasons and marked BAD (rank 0); the next older one is tried. Raises CheckpointError when
    complete checkpoints exist but none is usable."""
    found = comm.broadcast(candidates(ckpt_root) if rank == 0 else None)
    rejected = []
    for f in found:
        problems = [p for share in comm.all_gather(check_share(f, rank, world_size)) for p in share]
        if not problems:
            if rejected:
                log.warning("resuming from %s instead (the newest usable checkpoint)", f.tag)
            return f
        rejected.append(f"{f.tag}: " + "; ".join(problems))
        if rank == 0:
            log.error("checkpoint %s is damaged, marking it %s and falling back: %s", f.dir, BAD, "; ".join(problems))
            mark_bad(f.dir, problems)
    if rejected:
        raise CheckpointError(f"{ckpt_root}: no usable checkpoint ({' | '.join(rejected)}); repair or remove "
                              "them, or start a new run in another run_dir")
    return None


# --------------------------------------------------------------------------- saving


def _storage_error(e: BaseException, doing: str, path: Path) -> Optional[StorageError]:
    """A StorageError for a failure to write ``path``, None when ``e`` is not one (a bug: re-raise it).

    torch.save reports write failures as RuntimeError without errno ("unexpected pos", "file write
    failed", "open file failed with strerror: ..."): the filesystem is asked what went wrong."""
    if isinstance(e, OSError):
        if e.errno is None:
            return None
        if not e.filename:
            e = OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))
        return StorageError.from_os_error(e, doing)
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(k in text for k in ("inline_container", "PytorchStreamWriter",
                                                                       "write failed", "open file failed")):
        return None
    code = None
    m = re.search(r"strerror: (.+?)\s*$", text, re.M)
    if m:
        code = {os.strerror(c): c for c in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO,
                                            errno.EPERM)}.get(m.group(1).strip())
    if code is None:
        code = _diagnose(path)
    return StorageError.from_os_error(OSError(code, os.strerror(code), str(path)), doing)


def _diagnose(path: Path) -> int:
    """errno of a write failure torch did not explain: read-only, no permission, full, or an I/O error."""
    d = path if path.is_dir() else path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return errno.EIO
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if not os.access(d, os.W_OK):
        return errno.EACCES
    if st.f_bavail * st.f_frsize < 16 * 2**20:
        return errno.ENOSPC
    return errno.EIO


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` through the atomic writer: serialised in memory, written, fsync-ed, renamed."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


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


def save(runner, ckpt_root: Path, step: int, payload: TrainerState, rank: int, world_size: int, keep_last: int,
         comm: Comm = Comm(), faults: Faults = NO_FAULTS) -> Path:
    """Every rank calls this. Returns the checkpoint directory once it is COMPLETE and ``latest``.

    ``runner.save_checkpoint(root, tag)`` writes the DeepSpeed files. An OS error on this rank is
    raised as StorageError after the half-written directory is removed (rank 0), so ``latest`` keeps
    naming the previous complete checkpoint."""
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    ckpt_dir = ckpt_root / tag
    t0 = time.monotonic()
    try:
        if rank == 0:
            _clear_slot(ckpt_root, tag)
        comm.barrier()
        runner.save_checkpoint(str(ckpt_root), tag)
        faults.in_save(step, rank, world_size)
        atomic_torch_save(payload.to_dict(), state_file(ckpt_dir, rank))
        comm.barrier()
        if rank == 0:
            missing = [r for r in range(world_size) if not state_file(ckpt_dir, r).exists()]
            if missing:
                raise CheckpointError(f"{ckpt_dir}: trainer state of ranks {missing} missing after the save barrier")
            files = {p.name: p.stat().st_size for p in sorted(ckpt_dir.iterdir())
                     if p.is_file() and p.name not in _MARKERS and not p.name.startswith(".")}
            meta = {"step": step, "world_size": world_size, "time": time.time(), "files": files}
            atomic_write_text(ckpt_dir / COMPLETE, json.dumps(meta, indent=1) + "\n")
            atomic_write_text(ckpt_root / LATEST, tag + "\n")
            prune(ckpt_root, keep_last)
            log.info("saved checkpoint %s in %.1f s", ckpt_dir, time.monotonic() - t0)
        comm.barrier()
    except (OSError, RuntimeError) as e:
        err = _storage_error(e, f"saving checkpoint {tag}", ckpt_dir)
        if err is None:
            raise
        if rank == 0 and not is_complete(ckpt_dir):
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        raise err.with_note(describe_latest(ckpt_root)) from None
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


# --------------------------------------------------------------------------- conversion and export


def to_universal(ckpt_dir: Path, zero_stage: int) -> Path:
    """Convert a ZeRO 1-3 checkpoint to DeepSpeed's universal format once (idempotent); rank 0 only."""
    out = ckpt_dir / UNIVERSAL
    done = out / "DONE"
    if done.exists():
        return out
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    tmp = ckpt_dir / (UNIVERSAL + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    args = Namespace(input_folder=str(ckpt_dir), output_folder=str(tmp), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True,
                     inject_missing_state=zero_stage in (1, 2))
    log.info("converting %s to the universal format (ZeRO-%d)", ckpt_dir, zero_stage)
    ds_to_universal.main(args)
    os.replace(tmp, out)
    atomic_write_text(done, "ok\n")
    return out


def _torch_load(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path.parent}: missing {path.name} (is this a checkpoint of that layout?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file
        raise CheckpointError(f"{path}: unreadable ({_short(e)})") from None


def read_model_shards(ckpt_dir: Path, layout, num_layers: int) -> dict[str, list[torch.Tensor]]:
    """Parameter name -> its shards in tensor-rank order, as the tensor x pipeline layout saved them.

    Files (written by data rank 0 of each (pipeline, tensor) position)::

        tensor x data        mp_rank_<tp>_model_states.pt            ['module']: plain names, this rank's slices
        pipeline (x tensor)  layer_<idx>-model_<tp>-model_states.pt  one pipeline layer's state
                                                                     (indices: see parallel/pipeline.py)
    """
    from roformer_dist.parallel.pipeline import to_plain_names

    ckpt_dir = Path(ckpt_dir)
    per_name: dict[str, list[torch.Tensor]] = {}
    if layout.pipeline == 1:
        for t in range(layout.tensor):
            for k, v in _torch_load(ckpt_dir / f"mp_rank_{t:02d}_model_states.pt")["module"].items():
                per_name.setdefault(k, []).append(v)
    else:
        for idx in range(num_layers + 2):  # the tied decoder (last entry) is saved with entry 0
            for t in range(layout.tensor):
                sd = _torch_load(ckpt_dir / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
                for k, v in to_plain_names(idx, sd, num_layers).items():
                    per_name.setdefault(k, []).append(v)
    return per_name


def consolidate_state_dict(ckpt_dir: str | os.PathLike, model_cfg=None, layout=None):
    """``(ModelConfig, fp32 state_dict)`` of the plain ``RoFormerForMaskedLM`` from a checkpoint of any
    tensor x pipeline layout. Without ``model_cfg`` / ``layout`` both come from the trainer state
    saved beside it (its resolved config and world size)."""
    from roformer_dist.parallel.consolidate import merge_model_shards
    from roformer_dist.parallel.topology import Layout

    ckpt_dir = Path(ckpt_dir)
    if model_cfg is None or layout is None:
        from roformer_dist.config import from_dict

        state = read_trainer_state(ckpt_dir, 0)
        cfg = from_dict(state.config)
        model_cfg = model_cfg or cfg.model
        layout = layout or Layout.from_config(cfg, state.world_size)
    shards = read_model_shards(ckpt_dir, layout, model_cfg.num_hidden_layers)
    return model_cfg, merge_model_shards(shards)


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a ``checkpoints/`` root (then its newest complete checkpoint)."""
    path = Path(path)
    if path.is_dir() and not state_file(path, 0).exists() and ((path / LATEST).exists() or _tags(path)):
        found = find_resume(path)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint in this checkpoints directory")
        return found.dir
    return path


def load_consolidated_weights(ckpt_dir: str | os.PathLike):
    """(ModelConfig, fp32 state_dict with our key names) from a training checkpoint of any ZeRO stage."""
    from roformer_dist.config import from_dict

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    if not state_file(ckpt_dir, 0).exists():
        raise CheckpointError(f"{ckpt_dir}: not a roformer-dist checkpoint (no trainer_state_rank0.pt)")
    if not is_complete(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: checkpoint is incomplete (no {COMPLETE} marker)")
    state = read_trainer_state(ckpt_dir, 0)
    cfg = from_dict(state.config)
    if cfg.parallel.tensor > 1 or cfg.parallel.pipeline > 1:
        return consolidate_state_dict(ckpt_dir, cfg.model)
    if cfg.deepspeed.zero_stage == 0:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise CheckpointError(f"{ckpt_dir}: no mp_rank_*_model_states.pt")
        sd = _torch_load(files[0])["module"]
        sd = {k: v.float() for k, v in sd.items()}
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
        sd = {k: v.float() for k, v in sd.items()}
    return cfg.model, sd

