"""A run's lineage: what its first weights came from (``run_dir/parent.json``), written by the trainer
of a warm start or fork (:mod:`roformer_dist.launch.warm_start`) and by the first launch of a decay branch
(:mod:`roformer_dist.plan.decay_branch`), read by exports for the model card and by ``roformer-eval``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.atomic import atomic_write_text
from roformer_dist.runtime.rundir import RunDir

__all__ = ["Parent", "PARENT_FILE", "write_parent", "read_parent_record", "config_digest"]

PARENT_FILE = RunDir("").parent.name


@dataclass(frozen=True)
class Parent:
    """What a run started from (``run_dir/parent.json``)."""
    kind: str
    """hf-roformer | hf-bert | checkpoint | weights."""
    path: str
    """The absolute path read (for a run: its checkpoint's step directory)."""
    step: Optional[int] = None
    """The parent run's step (checkpoints only)."""
    config_sha256: str = ""
    """sha256 of the parent's config (its run config for a checkpoint, config.json for HF, the model section
    of a weights file)."""
    tokenizer_sha256: str = ""
    """sha256 of the parent's tokenizer model (checkpoints only)."""
    world_size: Optional[int] = None
    """Ranks that wrote the parent checkpoint (checkpoints only)."""
    decay_steps: Optional[int] = None
    """A decay branch (``init.decay_steps``): the steps of its decay from ``step`` (None: a warm start)."""
    decay_shape: str = ""
    """A decay branch: the decay's shape (``optim.decay_shape``)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


def config_digest(obj) -> str:
    """sha256 of a parent's config (a JSON-able dict), as ``Parent.config_sha256`` records it."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_parent(run_dir: Path, parent: Parent) -> None:
    """``run_dir/parent.json`` (atomic); the first record stays when a restart finds one."""
    path = RunDir(run_dir).parent
    if not path.exists():
        atomic_write_text(path, parent.to_json())


def read_parent_record(run_dir: str | os.PathLike) -> Optional[dict]:
    """The run's ``parent.json`` as a dict, or None (a run started from random weights, or unreadable)."""
    try:
        return json.loads(RunDir(run_dir).parent.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
