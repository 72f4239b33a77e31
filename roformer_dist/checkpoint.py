"""Save, find and resume checkpoints; convert for another world size; export weights.

Layout (``<run_dir>/checkpoints/``)::

    step_00000012/                 DeepSpeed files (model, optimizer; written by every rank)
        trainer_state_rank<r>.pt   step, tokens, loader position, RNG, world size, config
        COMPLETE                   written by rank 0 after a barrier: the checkpoint counts
        universal/                 made on demand for a resume at another world size
    latest                         tag of the newest COMPLETE checkpoint (atomic rename)

A checkpoint without ``COMPLETE`` never becomes ``latest``; resume ignores it and
says so. DeepSpeed's own ``latest`` file is not written (``save_latest=False``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from roformer_dist import faults

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
LATEST = "latest"
UNIVERSAL = "universal"
_TAG_RE = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG_RE.match(tag)
    if not m:
        raise ValueError(f"not a checkpoint tag: {tag!r}")
    return int(m.group(1))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def state_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"trainer_state_rank{rank}.pt"


def load_trainer_state(ckpt_dir: Path, rank: int) -> dict:
    path = state_file(ckpt_dir, rank)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing trainer state of rank {rank}")
    return torch.load(path, map_location="cpu", weights_only=True)


def is_complete(ckpt_dir: Path) -> bool:
    return (ckpt_dir / COMPLETE).exists()


@dataclass(frozen=True)
class Found:
    dir: Path
    tag: str
    step: int
    world_size: int
    """World size (number of trainer_state_rank files) that wrote it."""


def find_resume(ckpt_root: Path) -> Optional[Found]:
    """The newest COMPLETE checkpoint, or None. Newer incomplete ones are reported and ignored."""
    if not ckpt_root.is_dir():
        return None
    tags = sorted((p.name for p in ckpt_root.iterdir() if p.is_dir() and _TAG_RE.match(p.name)), key=step_of)
    complete = [t for t in tags if is_complete(ckpt_root / t)]
    if not complete:
        if tags:
            log.warning("ignoring incomplete checkpoint(s) %s: no COMPLETE marker", ", ".join(tags))
        return None
    best = complete[-1]
    latest_file = ckpt_root / LATEST
    if latest_file.exists():
        named = latest_file.read_text().strip()
        if named != best:
            log.warning("%s names %s but the newest complete checkpoint is %s; using %s",
                        latest_file, named, best, best)
    newer = [t for t in tags if step_of(t) > step_of(best)]
    if newer:
        log.warning("ignoring incomplete checkpoint(s) newer than %s: %s", best, ", ".join(newer))
    meta = json.loads((ckpt_root / best / COMPLETE).read_text())
    return Found(ckpt_root / best, best, step_of(best), int(meta["world_size"]))


def save(engine, ckpt_root: Path, step: int, trainer_state: dict, rank: int, world_size: int,
         keep_last: int, barrier) -> Path:
    """Every rank calls this. Returns the checkpoint directory once it is COMPLETE and ``latest``."""
    tag = tag_for(step)
    ckpt_dir = ckpt_root / tag
    if rank == 0 and ckpt_dir.exists():
        # A leftover of an interrupted save of the same step: start it afresh.
        shutil.rmtree(ckpt_dir)
    barrier()
    t0 = time.monotonic()
    engine.save_checkpoint(str(ckpt_root), tag=tag, save_latest=False)
    faults.maybe_crash_in_save(step, rank, world_size)
    atomic_torch_save(trainer_state, state_file(ckpt_dir, rank))
    barrier()
    if rank == 0:
        missing = [r for r in range(world_size) if not state_file(ckpt_dir, r).exists()]
        if missing:
            raise RuntimeError(f"{ckpt_dir}: trainer state of ranks {missing} missing after the save barrier")
        meta = {"step": step, "world_size": world_size, "time": time.time()}
        atomic_write_text(ckpt_dir / COMPLETE, json.dumps(meta) + "\n")
        atomic_write_text(ckpt_root / LATEST, tag + "\n")
        prune(ckpt_root, keep_last)
        log.info("saved checkpoint %s in %.1f s", ckpt_dir, time.monotonic() - t0)
    barrier()
    return ckpt_dir


def prune(ckpt_root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop incomplete ones older than them."""
    tags = sorted((p.name for p in ckpt_root.iterdir() if p.is_dir() and _TAG_RE.match(p.name)), key=step_of)
    complete = [t for t in tags if is_complete(ckpt_root / t)]
    keep = set(complete[-keep_last:])
    newest_kept = step_of(complete[-1]) if complete else -1
    for t in tags:
        if t not in keep and step_of(t) <= newest_kept:
            shutil.rmtree(ckpt_root / t, ignore_errors=True)


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
    done.write_text("ok\n")
    return out


def load_consolidated_weights(ckpt_dir: str | os.PathLike):
    """(ModelConfig, fp32 state_dict with our key names) from a training checkpoint of any ZeRO stage."""
    from roformer_dist.config import from_dict

    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_dir() and (ckpt_dir / LATEST).exists() and not state_file(ckpt_dir, 0).exists():
        ckpt_dir = ckpt_dir / (ckpt_dir / LATEST).read_text().strip()   # a checkpoints/ root was given
    if not state_file(ckpt_dir, 0).exists():
        raise ValueError(f"{ckpt_dir}: not a roformer-dist checkpoint (no trainer_state_rank0.pt)")
    if not is_complete(ckpt_dir):
        raise ValueError(f"{ckpt_dir}: checkpoint is incomplete (no {COMPLETE} marker)")
    state = load_trainer_state(ckpt_dir, 0)
    cfg = from_dict(state["config"])
    if cfg.parallel.tensor > 1 or cfg.parallel.pipeline > 1:
        from roformer_dist.parallel.consolidate import consolidate_state_dict

        return consolidate_state_dict(ckpt_dir, cfg.model)
    if cfg.deepspeed.zero_stage == 0:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ValueError(f"{ckpt_dir}: no mp_rank_*_model_states.pt")
        sd = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
        sd = {k: v.float() for k, v in sd.items()}
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
        sd = {k: v.float() for k, v in sd.items()}
    return cfg.model, sd
