"""A run resolved once, by the command that starts it, and handed down to its ranks: :class:`ResolvedRun`.

:func:`resolve_run` reads and checks everything a launch decides before its first step: the data
(every source's manifest; ``model.vocab_size`` and ``pad_token_id`` filled from it), the config at the
run's world size, the corpus mixture's plan, each curriculum stage's plan (micro-batch, accumulation,
rotary settings, masking rate), and where the weights come from (the newest usable checkpoint of the
run, else ``init.from``, else a fresh start). Every refusal is one of our errors before any rank trains.

Who resolves, and how the ranks get it:

- ``roformer-train`` on one machine resolves in the launcher (which holds the run lock) and passes the
  object to the ranks it spawns;
- under torchrun or SLURM every rank is started alike: global rank 0 takes the run lock, resolves,
  writes the run to ``<run_dir>/resolved_run.json`` and says so; the other ranks read that file
  (:func:`hand_down`). Each of them checks that its own config is the one rank 0 resolved
  (:func:`config_sha256`): a config file edited between the two reads is refused on every rank.

The ranks derive nothing the object holds: they do not read manifests to size the model, plan the mixture,
choose the checkpoint or compute a stage's micro-batch (``tests/test_layout.py`` checks the imports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from data_pipeline.atomic import atomic_write_text
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.compat import check_compatible
from roformer_dist.checkpoint.lineage import Parent
from roformer_dist.config import Config, RopeSettings, StagePlan, dump_yaml, from_dict, stage_plans, to_dict, validate
from roformer_dist.errors import ConfigError, StorageError, exit_status
from roformer_dist.observe.metrics import run_sinks
from roformer_dist.plan.curriculum import describe_schedule
from roformer_dist.plan.data import resolve_data
from roformer_dist.plan.decay_branch import BranchPoint, branch_config, branch_point, describe_decay, seed_branch
from roformer_dist.plan.mixture import MixturePlan, SourcePlan, plan_mixture
from roformer_dist.runtime.rundir import RunDir, prepare_run_dir

__all__ = ["ResolvedRun", "Resume", "resolve_run", "config_sha256", "hand_down", "FORMAT"]

log = logging.getLogger(__name__)

FORMAT = 2
"""The version of ``resolved_run.json``'s layout."""


def config_sha256(cfg: Config) -> str:
    """sha256 of a config as loaded (file, presets, overrides; before the data fills anything in)."""
    return hashlib.sha256(dump_yaml(cfg).encode()).hexdigest()


@dataclass(frozen=True)
class Resume:
    """Where this launch's weights come from: a checkpoint of the run (resumed exactly), else ``init.from``'s
    parent (a warm start), else nothing (a fresh start)."""
    checkpoint: Optional[ckpt.Found] = None
    warm_start: Optional[Parent] = None
    branch: Optional[Parent] = None
    """A decay branch's parent (its record in parent.json)."""

    def describe(self) -> str:
        if self.checkpoint is not None:
            c = self.checkpoint
            branch = f"; {describe_decay(dataclasses.asdict(self.branch))}" if self.branch is not None else ""
            return f"resume {c.dir} (step {c.step}, written by {c.world_size} rank(s)){branch}"
        if self.warm_start is not None:
            return f"warm start from {self.warm_start.kind} {self.warm_start.path}"
        return "fresh start"


@dataclass(frozen=True)
class ResolvedRun:
    """One launch of a run, resolved and checked; see the module docstring. Frozen: a rank reads it."""
    cfg: Config
    """The config with what the data decides filled in (``model.vocab_size``, ``model.pad_token_id``)."""
    world_size: int
    config_sha256: str
    """:func:`config_sha256` of the config as loaded, which every rank started under torchrun checks."""
    manifests: dict[str, dict]
    """Training source name -> its shard manifest, the first source's first."""
    mixture: MixturePlan
    stages: tuple[StagePlan, ...]
    resume: Resume
    run_dir: RunDir
    launch: str = ""
    """A random token naming this launch's resolution (a rank that reads an older file notices)."""
    notes: tuple[tuple[str, int, str], ...] = ()
    """What resolving logged (logger name, level, message): a checkpoint ignored or marked BAD. Rank 0 logs them
    again into the run's log (:meth:`log_notes`); the process that resolved may have had no log of its own."""
    sinks: tuple[str, ...] = ("jsonl", "tensorboard")
    """The metric sinks in force (``observe.metrics.run_sinks``: checked against the sink table)."""

    def log_notes(self) -> None:
        for name, level, message in self.notes:
            logging.getLogger(name).log(level, "%s", message)

    @property
    def manifest(self) -> dict:
        """The first training source's manifest (tokenizer, special ids)."""
        return next(iter(self.manifests.values()))

    @property
    def elastic(self) -> bool:
        """Resuming a checkpoint written by another number of ranks."""
        found = self.resume.checkpoint
        return found is not None and found.world_size != self.world_size

    def summary(self) -> str:
        """A few lines for the log: the resume decision and each stage's plan."""
        lines = [f"resolved run ({self.world_size} rank(s)): {self.resume.describe()}",
                 f"  {describe_schedule(self.cfg.optim, self.cfg.curriculum.stages)}",
                 "  evaluation masks {:g} of the tokens; the chosen become [MASK], a random token, unchanged in "
                 "shares {}".format(self.cfg.data.eval_mlm_probability, "/".join(f"{x:g}" for x in
                                                                                 self.cfg.data.mask_replace))]
        for s in self.stages:
            lines.append(f"  stage {s.index + 1} {s.name!r}: seq_len {s.seq_len}, global batch {s.global_batch_size}, "
                         f"micro-batch {s.micro_batch_size}, accumulation {s.accumulation}, masking "
                         f"{s.mlm_probability:g}, rope_theta {s.rope.rope_theta:g}"
                         + (f" {s.rope.rope_scaling} x{s.rope.rope_scaling_factor:g}"
                            if s.rope.rope_scaling != "none" else ""))
        return "\n".join(lines)

    # ------------------------------------------------------------------ the run directory's copy
    def to_json(self) -> dict[str, Any]:
        found = self.resume.checkpoint
        return {
            "format": FORMAT, "launch": self.launch, "world_size": self.world_size,
            "config_sha256": self.config_sha256, "run_dir": str(self.run_dir.root), "notes": self.notes,
            "sinks": list(self.sinks),
            "config": to_dict(self.cfg),
            "manifests": self.manifests,
            "mixture": dataclasses.asdict(self.mixture),
            "stages": [{"index": s.index, "name": s.name, "micro_batch_size": s.micro_batch_size,
                        "accumulation": s.accumulation, "rope": s.rope.to_dict(), "mlm_probability": s.mlm_probability,
                        "settings": dict(s.settings)}
                       for s in self.stages],
            "resume": {"checkpoint": None if found is None else {**dataclasses.asdict(found), "dir": str(found.dir)},
                       "warm_start": None if self.resume.warm_start is None else
                       dataclasses.asdict(self.resume.warm_start),
                       "branch": None if self.resume.branch is None else dataclasses.asdict(self.resume.branch)},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> "ResolvedRun":
        """The object :meth:`to_json` wrote; ConfigError naming ``where`` for a file of another layout."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(f"{where}: not a resolved run of format {FORMAT} (format {got!r}); start the run again "
                              "with roformer-train, which writes it")
        try:
            cfg = from_dict(data["config"])
            mix = data["mixture"]
            mixture = MixturePlan(
                tuple(SourcePlan(**{**s, "targets": tuple(s["targets"]), "shares": tuple(s["shares"])})
                      for s in mix["sources"]), tuple(mix["stage_names"]), tuple(mix["budgets"]))
            stages = tuple(StagePlan(s["index"], cfg.curriculum.stages[s["index"]], s["micro_batch_size"],
                                     s["accumulation"], RopeSettings.from_dict(s["rope"]), s["mlm_probability"],
                                     s["settings"])
                           for s in data["stages"])
            found, parent = data["resume"]["checkpoint"], data["resume"]["warm_start"]
            branch = data["resume"].get("branch")
            resume = Resume(None if found is None else ckpt.Found(**{**found, "dir": Path(found["dir"])}),
                            None if parent is None else Parent(**parent), None if branch is None else Parent(**branch))
            return cls(cfg, int(data["world_size"]), data["config_sha256"], data["manifests"], mixture, stages, resume,
                       RunDir(data["run_dir"]), data["launch"], tuple((n, int(lv), m) for n, lv, m in data["notes"]),
                       tuple(data["sinks"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"{where}: damaged resolved run ({type(e).__name__}: {e}); start the run again with "
                              "roformer-train, which writes it") from None

    def write(self) -> Path:
        """Into ``<run_dir>/resolved_run.json`` (atomic); returns the path. StorageError when it cannot be written."""
        path = self.run_dir.resolved_run
        prepare_run_dir(self.run_dir.root, self.cfg.run_dir_mode)  # made (or checked) as the run lock makes it
        try:
            atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")
        except OSError as e:
            raise StorageError.from_os_error(e, f"writing {path}") from None
        return path

    @classmethod
    def read(cls, run_dir: RunDir) -> "ResolvedRun":
        path = run_dir.resolved_run
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: missing: rank 0 writes it at the start of each launch; is run_dir on a "
                              "filesystem every node shares?") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable resolved run ({e})") from None
        return cls.from_json(data, str(path))


def _resume(cfg: Config, world_size: int, manifest: dict, run_dir: RunDir, read_only: bool,
            branch: Optional[BranchPoint]) -> Resume:
    """The newest usable checkpoint (damaged ones marked BAD, unless ``read_only``, and skipped), checked against
    this config; else, for a decay branch, its parent's checkpoint linked into the run first; else ``init.from``'s
    parent, read and fitted to the model once here (every mismatch a ConfigError)."""
    if cfg.checkpoint.resume:
        found = ckpt.choose_resume(run_dir.checkpoints, 0, 1, read_only=read_only)
        if found is None and branch is not None:
            if read_only:  # a dry run: what the first launch resumes
                found = branch.checkpoint(read_only=True)
            else:
                seed_branch(branch, run_dir)
                found = ckpt.choose_resume(run_dir.checkpoints, 0, 1)
        if found is not None:
            check_compatible(found, ckpt.read_trainer_state(found.dir, 0), cfg, world_size, manifest)
            return Resume(checkpoint=found, branch=None if branch is None else branch.parent)
    if cfg.init.from_:
        from roformer_dist.launch.warm_start import warm_start  # torch state dicts: only when there is a parent

        parent, _ = warm_start(cfg, manifest["tokenizer"]["sha256"], read_only)
        return Resume(warm_start=parent)
    return Resume()


def resolve_run(cfg: Config, world_size: Optional[int] = None, take_lock: Optional[Callable[[], None]] = None,
                read_only: bool = False) -> ResolvedRun:
    """Resolve ``cfg`` (as loaded) for a launch of ``world_size`` ranks (default dist.world_size); see the module
    docstring. The data and the config are checked first, reading only; then ``take_lock()`` takes the run lock
    (which makes the run directory: a run refused for its data leaves none) and the checkpoint directory is read
    (a damaged checkpoint may be marked BAD and ``latest`` pointed at the one chosen). ``read_only`` (a dry run,
    no lock): the same decisions, nothing written anywhere."""
    world_size = cfg.dist.world_size if world_size is None else world_size
    sinks = run_sinks(cfg)  # an unknown sink is refused before anything is written
    run_dir = RunDir.of(cfg)
    with _recorded() as notes:
        resolved, manifests = resolve_data(cfg)
        branch = None
        if resolved.init.decay_steps:  # the curriculum and schedule of a decay branch from its parent's step
            validate(resolved, world_size)
            branch = branch_point(resolved, run_dir, read_only)
            resolved = branch_config(resolved, branch.parent.step)
        validate(resolved, world_size)
        mixture = plan_mixture(resolved, manifests)
        if take_lock is not None:
            take_lock()
        resume = _resume(resolved, world_size, next(iter(manifests.values())), run_dir, read_only, branch)
    return ResolvedRun(resolved, world_size, config_sha256(cfg), manifests, mixture, stage_plans(resolved, world_size),
                       resume, run_dir, secrets.token_hex(8), tuple(notes), sinks)


@contextlib.contextmanager
def _recorded() -> Iterator[list[tuple[str, int, str]]]:
    """What the package logs (INFO and up) while resolving, kept for the run's log instead of printed; printed
    after all when resolving fails (the error's context)."""
    notes: list[tuple[str, int, str]] = []
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)
            notes.append((record.name, record.levelno, record.getMessage()))

    package = logging.getLogger("roformer_dist")
    keep, propagate = Keep(logging.INFO), package.propagate
    package.addHandler(keep)
    package.propagate = False
    completed = False
    try:
        yield notes
        completed = True
    finally:
        package.propagate = propagate
        package.removeHandler(keep)
        if not completed:
            for record in records:
                logging.getLogger(record.name).handle(record)


def hand_down(cfg: Config, rank: int, world_size: int, comm, resolve) -> ResolvedRun:
    """Under torchrun or SLURM (collective): global rank 0 calls ``resolve()`` (it holds the run lock) and
    writes the result to the run directory; every other rank reads it there and checks that it resolved
    ``cfg``. Every rank raises the same error when one of them fails (no rank is left waiting)."""
    run, error = None, None
    if rank == 0:
        try:
            run = resolve()
            run.write()
        except Exception as e:  # noqa: BLE001 - ours are sent on; anything else is a bug, raised here
            if exit_status(e) is None:
                comm.broadcast(ConfigError(f"rank 0 failed to resolve the run ({type(e).__name__}); see its log"))
                raise
            error = e
    launch = comm.broadcast(error if error is not None else run.launch if run is not None else None)
    if isinstance(launch, Exception):
        raise launch
    if rank != 0:
        try:
            run = ResolvedRun.read(RunDir.of(cfg))
            error = _check_handed(run, cfg, rank, world_size, launch)
        except ConfigError as e:
            error = e
    errors = [e for e in comm.all_gather(error) if e is not None]
    if errors:
        raise errors[0]
    return run


def _check_handed(run: ResolvedRun, cfg: Config, rank: int, world_size: int, launch: str) -> Optional[ConfigError]:
    path = run.run_dir.resolved_run
    if run.launch != launch:
        return ConfigError(f"rank {rank}: {path} is not the resolved run rank 0 just wrote (launch {run.launch}, "
                           f"expected {launch}): is run_dir on a filesystem every node shares?")
    if run.config_sha256 != config_sha256(cfg):
        return ConfigError(f"rank {rank}: its config differs from the one rank 0 resolved ({path}: config sha256 "
                           f"{run.config_sha256[:12]}, this rank's {config_sha256(cfg)[:12]}): the config file or "
                           "the overrides changed between resolve and start; start every rank with the same config")
    if run.world_size != world_size:
        return ConfigError(f"rank {rank}: {path} was resolved for {run.world_size} rank(s), this rank is one of "
                           f"{world_size}")
    return None
