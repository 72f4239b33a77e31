"""A decay branch (``init.decay_steps``; ``roformer-train --fork PARENT --decay STEPS``): a finished model at the
budget of any checkpoint of a stable phase, without fixing the run's length in advance.

``init.from`` names a checkpoint of ours (or a run: its newest usable one) at step N, taken while the parent's
learning rate stood at its peak (``optim.schedule: constant``, or ``wsd`` before its decay). The branch is a
run of its own (its own ``run_dir``) that *resumes* that checkpoint exactly: weights, optimizer moments, step
counter, data position, RNG streams and spike history are the parent's at N, so its first step computes what
the parent's step N + 1 computed, but with the decayed learning rate. Its config is this one's with:

- the curriculum cut (or its last stage lengthened) to end at step N + ``init.decay_steps``;
- ``optim.schedule: wsd`` decaying over those ``init.decay_steps`` steps with ``optim.decay_shape``
  (``linear``, ``cosine``, ``1-sqrt``) from the peak to ``optim.lr x optim.min_lr_ratio``.

The first launch links the parent's checkpoint files into ``<run_dir>/checkpoints/step_N`` (hard links, a
copy across filesystems) and records the parent, its step and the decay in ``<run_dir>/parent.json``; the
parent's directory is only read, so several branches of one parent can run side by side. A restart of the
branch resumes its own newest checkpoint and takes N from ``parent.json``. The model card and
``roformer-eval`` name the decay a model came from.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.lineage import Parent, config_digest, read_parent_record, write_parent
from roformer_dist.config import Config, build, replace
from roformer_dist.errors import CheckpointError, ConfigError
from roformer_dist.plan.curriculum import lr_at
from roformer_dist.runtime.rundir import RunDir

__all__ = ["BranchPoint", "branch_point", "branch_config", "seed_branch", "describe_decay"]


@dataclass(frozen=True)
class BranchPoint:
    """Where a decay branch starts: its parent record (path: the parent's step directory; step) and, when this
    launch read it, the parent's checkpoint."""
    parent: Parent
    found: "ckpt.Found | None" = None

    def checkpoint(self, read_only: bool = False) -> "ckpt.Found":
        """The parent's checkpoint, checked (read again when this launch took the step from parent.json; a
        damaged one marked BAD unless ``read_only``)."""
        if self.found is not None:
            return self.found
        try:
            return ckpt.resolve(Path(self.parent.path), read_only)
        except CheckpointError as e:
            raise ConfigError(f"init.from: the decay branch's parent checkpoint: {e}") from None


def branch_point(cfg: Config, run_dir: RunDir, read_only: bool = False) -> BranchPoint:
    """The branch point of ``cfg`` (``init.decay_steps`` > 0): the step recorded in ``parent.json`` by an
    earlier launch of this run, else ``init.from``'s checkpoint, checked (a checkpoint of ours, taken at the
    parent's peak learning rate; a damaged one marked BAD unless ``read_only``). ConfigError naming the key
    otherwise."""
    if not cfg.checkpoint.resume:
        raise ConfigError("checkpoint.resume: a decay branch (init.decay_steps) resumes its parent's checkpoint; "
                          "leave checkpoint.resume true")
    record = read_parent_record(run_dir.root)
    if record is not None and record.get("decay_steps"):
        if record.get("decay_steps") != cfg.init.decay_steps:
            raise ConfigError(f"init.decay_steps: {cfg.init.decay_steps}, but {run_dir.parent} records a branch of "
                              f"{record.get('decay_steps')} decay steps; keep it, or branch into a new run_dir")
        return BranchPoint(Parent(**{k: v for k, v in record.items() if k in Parent.__dataclass_fields__}))
    try:
        found = ckpt.resolve(Path(cfg.init.from_).expanduser(), read_only)
    except CheckpointError as e:
        raise ConfigError(f"init.from: a decay branch (init.decay_steps {cfg.init.decay_steps}) starts from a "
                          f"checkpoint of ours: {e}") from None
    state = ckpt.read_trainer_state(found.dir, 0)
    _check_at_peak(state.config, found, cfg)
    parent = Parent("checkpoint", str(found.dir), found.step, config_digest(state.config), state.tokenizer_sha256,
                    found.world_size, cfg.init.decay_steps, cfg.optim.decay_shape)
    return BranchPoint(parent, found)


def _check_at_peak(saved: dict, found: "ckpt.Found", cfg: Config) -> None:
    """The parent's last step ran at this config's peak lr: the decay starts where the parent stood."""
    try:
        parent = build(Config, saved)
        lr = lr_at(parent.optim, parent.curriculum.stages, found.step - 1)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"init.from: {found.dir}: cannot read the parent's schedule ({e})") from None
    if found.step < 1 or not math.isclose(lr, cfg.optim.lr, rel_tol=1e-9):
        raise ConfigError(
            f"init.decay_steps: a decay branch starts from the parent's stable learning rate, but at step "
            f"{found.step} of {found.dir} the parent ran at lr {lr:g} (schedule {parent.optim.schedule}), and this "
            f"config's optim.lr is {cfg.optim.lr:g}: branch from a checkpoint of a constant or wsd parent before its "
            "decay, with the parent's optim.lr")


def branch_config(cfg: Config, step: int) -> Config:
    """``cfg`` as the branch from ``step`` runs it: the curriculum ends at ``step + init.decay_steps`` and the
    schedule is wsd with that decay."""
    decay = cfg.init.decay_steps
    end, start, stages = step + decay, 0, []
    for st in cfg.curriculum.stages:
        if start >= end:
            break
        stages.append(replace(st, steps=min(st.steps, end - start)))
        start += stages[-1].steps
    if start < end:  # the parent's curriculum ends sooner: its last stage goes on
        stages[-1] = replace(stages[-1], steps=stages[-1].steps + end - start)
    return replace(cfg, **{"curriculum.stages": tuple(stages), "optim.schedule": "wsd", "optim.decay_steps": decay})


def seed_branch(point: BranchPoint, run_dir: RunDir) -> None:
    """The first launch of a branch: ``parent.json``, then the parent's checkpoint linked into this run's
    ``checkpoints/`` (complete or not at all: built aside, then renamed)."""
    found = point.checkpoint()
    write_parent(run_dir.root, point.parent)
    run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
    target = run_dir.checkpoints / found.dir.name
    aside = run_dir.checkpoints / f".branching-{found.dir.name}"
    shutil.rmtree(aside, ignore_errors=True)
    try:
        shutil.copytree(found.dir, aside, copy_function=_link_or_copy)
        os.replace(aside, target)
    except OSError as e:
        shutil.rmtree(aside, ignore_errors=True)
        raise CheckpointError(f"{target}: cannot link the parent's checkpoint {found.dir} here ({e.strerror or e})"
                              ) from None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def describe_decay(record: "dict | None") -> str:
    """What a run's ``parent.json`` says of a decay branch, in words; empty for any other run."""
    if not record or not record.get("decay_steps"):
        return ""
    return (f"decay branch of {record.get('path')} at step {record.get('step')}: {record['decay_steps']} steps of "
            f"{record.get('decay_shape') or 'wsd'} decay")
