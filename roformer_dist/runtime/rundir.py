"""Run directories: every path in one (:class:`RunDir`), and directories that no one else can tamper with.

A run directory holds what a later launch trusts: checkpoints that are resumed and pruned, the
submitit pickles a requeue unpickles, the config. On a shared filesystem another user, or a member
of the group, who can write there can make a run resume their checkpoint, delete another run's files
through a ``checkpoints`` symlink, or replace a pickle. So, before anything is read or written:

- missing directories are created with ``run_dir_mode`` (default ``0750``: no write for the group or
  others; the umask cannot widen it, it is set with ``chmod``);
- the run directory must be owned by the user running the job, and may not be writable by the group
  or others beyond what ``run_dir_mode`` allows (``0770`` lets a team share one run directory);
- its ``checkpoints/``, ``logs/`` and ``tb/`` are checked the same way with ``lstat``: a symlink there
  is refused, not followed.

A directory that fails is a :class:`~roformer_dist.errors.ConfigError` (exit status 2) naming the
directory, its owner or mode, and the ``chmod`` that fixes it. The run directory itself may be a
symlink (a user pointing ``runs/`` at scratch space); what it points to is checked.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from roformer_dist.config import DEFAULT_RUN_DIR_MODE, parse_mode
from roformer_dist.errors import ConfigError, StorageError

__all__ = ["RunDir", "SUBDIRS", "LATEST", "prepare_run_dir", "check_run_dir"]

LATEST = "latest"
"""In the checkpoints directory: the name of the newest complete checkpoint."""


@dataclass(frozen=True)
class RunDir:
    """Every path of a run directory, named once (``RunDir(cfg.run_dir)``; ``RunDir.of(cfg)``)::

        <run_dir>/checkpoints/              step_XXXXXXXX/ ..., latest           (checkpoint.store)
        <run_dir>/metrics.jsonl             one line per step                     (observe.sinks.jsonl)
        <run_dir>/tb/                       TensorBoard events                    (observe.sinks.tensorboard)
        <run_dir>/config.yaml               the resolved config                   (launch.build, roformer-submit)
        <run_dir>/logs/                     each rank's log, jobs.jsonl           (launch.logs, launcher)
        <run_dir>/parent.json               what a fork started from              (checkpoint.lineage)
        <run_dir>/profile/                  trainer.profile's traces              (observe.profiling)
        <run_dir>/compile_cache/            trainer.compile's kernels             (parallel.compiled)
        <run_dir>/rotary_backend.json       rotary_backend auto's measurements    (loop.callbacks.rotary)
        <run_dir>/resolved_run.json         what this launch resolved             (launch.resolved)
        <run_dir>/wandb/, wandb_run.json    W&B's offline files, the run's id     (observe.sinks.wandb_sink)
        <run_dir>/mlflow.db, mlflow_run.json MLflow's store, the run's id         (observe.sinks.mlflow_sink)
        <run_dir>/mlruns/                   MLflow's file store (runs before mlflow.db)
    """

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @classmethod
    def of(cls, cfg) -> "RunDir":
        return cls(cfg.run_dir)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def jobs(self) -> Path:
        """The launcher's record of the SLURM jobs of this run."""
        return self.logs / "jobs.jsonl"

    @property
    def parent(self) -> Path:
        return self.root / "parent.json"

    @property
    def profile(self) -> Path:
        return self.root / "profile"

    @property
    def compile_cache(self) -> Path:
        return self.root / "compile_cache"

    @property
    def rotary_choices(self) -> Path:
        return self.root / "rotary_backend.json"

    @property
    def resolved_run(self) -> Path:
        return self.root / "resolved_run.json"

    @property
    def hang(self) -> Path:
        """The ranks' heartbeat files and, after a hang, their stacks and the report (runtime/heartbeat.py)."""
        return self.root / "hang"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def wandb_run(self) -> Path:
        return self.root / "wandb_run.json"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_run(self) -> Path:
        return self.root / "mlflow_run.json"


SUBDIRS = tuple(p.name for p in (RunDir("").checkpoints, RunDir("").logs, RunDir("").tb))
"""The subdirectories whose contents a later launch trusts."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check(path: Path, st: os.stat_result, mode: int) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"run_dir: {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(f"run_dir: {path} belongs to {_owner(st.st_uid)}, not to you ({_owner(me)}): a run "
                          "resumes and prunes only its own user's checkpoints; choose another run_dir")
    extra = stat.S_IMODE(st.st_mode) & 0o022 & ~mode
    if extra:
        who = " and ".join(w for w, bit in (("the group", 0o020), ("others", 0o002)) if extra & bit)
        raise ConfigError(f"run_dir: {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}, "
                          f"run_dir_mode {mode:04o}): whoever can write there can replace what a resume "
                          f"loads; run `chmod go-w {path}` or set run_dir_mode")


def check_run_dir(run_dir: str | os.PathLike, mode: int) -> None:
    """The checks of the module docstring on an existing run directory and its trusted subdirectories."""
    run_dir = Path(run_dir)
    _check(run_dir, run_dir.stat(), mode)
    for name in SUBDIRS:
        sub = run_dir / name
        try:
            st = sub.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"run_dir: {sub} is a symlink (to {os.readlink(sub)}); it is not followed: a run "
                              "would resume and prune what it points to. Remove the link")
        _check(sub, st, mode)


def _mkdir(path: Path, mode: int) -> None:
    """Create ``path`` and its missing parents; those created get exactly ``mode``."""
    missing = []
    p = path
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            continue  # created by another rank or launch a moment ago: checked below like any other
        os.chmod(d, mode)


def prepare_run_dir(run_dir: str | os.PathLike, mode_text: str = DEFAULT_RUN_DIR_MODE) -> Path:
    """Create ``run_dir`` (and missing parents) and its :data:`SUBDIRS` with ``mode_text``, and check them
    (module docstring). ConfigError for a directory that is not safe to use, StorageError when it cannot
    be created."""
    mode = parse_mode(mode_text)
    run_dir = Path(run_dir)
    try:
        _mkdir(run_dir, mode)
        check_run_dir(run_dir, mode)  # before creating anything inside: a symlinked subdirectory stays as it is
        for name in SUBDIRS:
            _mkdir(run_dir / name, mode)
    except OSError as e:
        raise StorageError.from_os_error(e, "creating the run directory") from None
    check_run_dir(run_dir, mode)
    return run_dir
