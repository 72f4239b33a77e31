"""Experiment config + cluster profile + command-line flags -> the resolved ``Config`` and executor parameters.

Order (later wins): the experiment YAML, the profile (``--profile NAME`` = ``configs/cluster/NAME.yaml``,
the ``slurm`` section), ``key=value`` overrides, then the scheduling flags (``--nodes``, ``--time``, ...).
The job's shape decides the world size: ``dist.world_size`` becomes ``slurm.nodes x slurm.tasks_per_node``,
and on GPU clusters there is one task per GPU (``tasks_per_node = gpus_per_node``), so the config is
validated for the world size that will really run.

What reaches the batch script (``sbatch_script``; submitit writes the same text). The ``slurm`` section and
``run_dir`` are checked by the rules of ``launcher.slurm_settings`` (the config checks only the job's shape)
when the config is resolved and again in ``slurm_parameters``, which every batch script comes from
(``roformer-data prepare --tasks`` too): ``slurm.partition``, ``account`` and ``qos`` hold only letters,
digits and ``_ - . ,``; ``slurm.constraint`` also the feature operators ``& | ! * : [ ] ( )`` (no spaces);
``slurm.env`` and ``slurm.env_from`` keys are variable names (``[A-Za-z_][A-Za-z0-9_]*``); no SLURM string,
``slurm.setup`` line or ``run_dir`` holds a control character (a newline would start a script line of its
own). Rendering:

- ``slurm.env`` values are double-quoted (``slurm_settings.double_quoted``): ``$NAME`` and ``${NAME}`` are
  expanded by the batch shell (profiles use ``$HOME``), every other character is literal (backslash, ``"``
  and a ``$`` that starts no reference are escaped). Command substitution (``$(...)``, backticks) is refused, with
  a message pointing to ``slurm.setup`` (shell by design: the user's own lines, one line each).
- ``slurm.env_from`` (secrets by reference, e.g. ``{WANDB_API_KEY: WANDB_API_KEY}``): the batch script
  holds only names, ``export KEY="${NAME?...}"`` (or the check ``: "${NAME?...}"`` when the names
  are equal), never the value: it reaches the job through the environment sbatch exports
  (``--export=ALL``, sbatch's default; submitit passes no ``--export``). ``check_submit_env`` refuses a
  submission whose variable is not set, or is kept from the job by ``SBATCH_EXPORT``.
- the job name is ``roformer-<run_dir's name>`` with anything but ``A-Za-z0-9_.+-`` replaced by ``_``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.source import is_url
from launcher.slurm_settings import ENV_REFERENCE, check_line, double_quoted, env_from_line, validate_slurm
from roformer_dist.config import Config, SlurmConfig, load_config, replace
from roformer_dist.errors import ConfigError

# Written into the sbatch script before srun: `scancel --signal=USR2 --full` (and some preemption setups)
# also signal the batch shell, whose default action on SIGUSR2 is to die and end the job (measured here).
# With a trap the shell lives on; the ranks get the signal from SLURM directly and save.
USR2_TRAP = "trap 'date \"+%T batch script: SIGUSR2, the ranks save and rank 0 requeues\"' USR2"


@dataclass(frozen=True)
class JobFlags:
    """Scheduling flags of ``roformer-submit``; None = keep the config's / profile's value."""

    profile: Optional[str] = None
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    tasks_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: Optional[int] = None

    def overrides(self) -> list[str]:
        """``slurm.<key>=<value>`` for every flag given (the profile not included)."""
        out = []
        for key in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem_gb", "partition",
                    "account", "qos", "constraint", "time_min"):
            value = getattr(self, key)
            if value is not None:
                out.append(f"slurm.{key}={value}")
        return out


def parse_mem_gb(text: str) -> int:
    """``--mem 64G`` / ``64GB`` / ``64`` -> 64 (GB per node; 0 = the cluster's default)."""
    t = text.strip().upper()
    for suffix in ("GB", "G"):
        if t.endswith(suffix):
            t = t[: -len(suffix)]
            break
    if not t.isdigit():
        raise ConfigError(f"slurm.mem_gb: --mem expects whole gigabytes per node such as 64G, got {text!r}")
    return int(t)


def resolve(config: str, overrides: list[str], flags: JobFlags) -> Config:
    """Load, apply profile/overrides/flags, fix the job's world size, validate. ConfigError names the key."""
    items = ([f"slurm={flags.profile}"] if flags.profile else []) + list(overrides) + flags.overrides()
    cfg = load_config(config, items)
    s = cfg.slurm
    tasks = s.tasks_per_node
    if s.gpus_per_node > 0:
        if flags.tasks_per_node is not None and flags.tasks_per_node != s.gpus_per_node:
            raise ConfigError(f"slurm.tasks_per_node: {flags.tasks_per_node} tasks per node with "
                             f"slurm.gpus_per_node {s.gpus_per_node}; the launcher runs one rank per GPU")
        tasks = s.gpus_per_node
    world = s.nodes * tasks
    cfg = load_config(config, items + [f"slurm.tasks_per_node={tasks}", f"dist.world_size={world}"])
    validate_slurm(cfg.slurm)  # before anything is created: refused alike for --cluster slurm and local
    check_line(cfg.run_dir, "run_dir")  # it is in the batch script: #SBATCH --output, srun, the job name
    # The job may start in another working directory than this shell's: make paths absolute.
    paths = {"run_dir": cfg.run_dir}
    for key, value in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards),
                       ("init.from_", cfg.init.from_)):
        if value and not is_url(value):
            paths[key] = value
    changes = {k: _absolute(v) for k, v in paths.items()}
    for key in ("sources", "eval_sources"):
        listed = getattr(cfg.data, key)
        if listed:
            changes[f"data.{key}"] = tuple(dataclasses.replace(s, shards=s.shards if is_url(s.shards) else
                                                               _absolute(s.shards)) for s in listed)
    return replace(cfg, **changes)


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _shard_sets(cfg: Config) -> list[tuple[str, str]]:
    """(config key, location) of every shard set the job reads."""
    out = [("data.shards", cfg.data.shards)] if cfg.data.shards or not cfg.data.sources else []
    out += [(f"data.sources[{i}] ({s.name})", s.shards) for i, s in enumerate(cfg.data.sources)]
    out.append(("data.eval_shards", cfg.data.eval_shards))
    out += [(f"data.eval_sources[{i}] ({s.name})", s.shards) for i, s in enumerate(cfg.data.eval_sources)]
    return out


def check_data(cfg: Config) -> None:
    """A local shard set is a directory with a manifest.json: refuse to queue without one. A shard set at a
    URL is checked by the job when it starts (a ``pipe:`` command may only work on the compute nodes). The
    parent of a warm start must exist (the job's ranks check that it fits the model)."""
    for key, value in _shard_sets(cfg):
        if key == "data.shards" and not value:
            raise ConfigError("data.shards: no training shard set given")
        if value and not is_url(value) and not (Path(value) / "manifest.json").is_file():
            raise ConfigError(f"{key}: {value} is not a shard set (no manifest.json; make one with "
                             "`roformer-data prepare`)")
    if cfg.init.from_ and not Path(cfg.init.from_).exists():
        raise ConfigError(f"init.from: {cfg.init.from_}: no such file or directory (the parent of a warm start "
                          "or fork)")


def job_name(cfg: Config) -> str:
    return "roformer-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", Path(cfg.run_dir).name)


def setup_lines(cfg: Config) -> list[str]:
    """Shell lines run in the batch script before srun: the USR2 trap, the profile's env (values, then
    names taken from the submitting environment), its setup; of a section that passes ``validate_slurm``."""
    env = [f"export {k}={double_quoted(v, f'slurm.env.{k}')}" for k, v in cfg.slurm.env.items()]
    env += [env_from_line(k, name) for k, name in cfg.slurm.env_from.items()]
    return [USR2_TRAP, *env, *cfg.slurm.setup]


def check_submit_env(s: SlurmConfig, cluster: str = "slurm", environ=None) -> None:
    """Every ``slurm.env_from`` variable is set here and (``cluster`` slurm) reaches the job: sbatch exports
    the whole environment unless ``SBATCH_EXPORT`` says otherwise. ConfigError naming the key."""
    environ = os.environ if environ is None else environ
    for key, name in s.env_from.items():
        if name not in environ:
            raise ConfigError(f"slurm.env_from.{key}: {name} is not set in this environment; the job takes {key} "
                              f"from it (export {name}=... before roformer-submit)")
    export = environ.get("SBATCH_EXPORT")
    if cluster != "slurm" or export is None or not s.env_from:
        return
    given = [part.split("=", 1)[0].strip() for part in export.split(",")]
    for key, name in s.env_from.items():
        if "ALL" not in given and name not in given:
            raise ConfigError(f"slurm.env_from.{key}: SBATCH_EXPORT={export} keeps {name} from the job; unset "
                              f"SBATCH_EXPORT or add {name} to it")


def job_environment(s: SlurmConfig, environ=None) -> dict[str, str]:
    """What the batch script's exports set, computed here for ``--cluster local`` (no batch shell):
    ``slurm.env`` with ``$NAME``/``${NAME}`` expanded (unset = empty, as in the shell), then
    ``slurm.env_from``. Apply in order: a value may refer to a variable set before it."""
    env = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}

    def expand(m: re.Match) -> str:
        return env.get(m.group().strip("${}"), "")

    for key, value in s.env.items():
        out[key] = env[key] = ENV_REFERENCE.sub(expand, value)
    for key, name in s.env_from.items():
        out[key] = env[key] = env.get(name, "")
    return out


def slurm_parameters(cfg: Config) -> dict:
    """Parameters of ``submitit.SlurmExecutor.update_parameters`` (also what ``--dry-run`` renders), from a
    ``slurm`` section that passes ``validate_slurm``: every batch script comes from here."""
    s = cfg.slurm
    validate_slurm(s)
    params = {
        "job_name": job_name(cfg),
        "time": s.time_min,
        "nodes": s.nodes,
        "ntasks_per_node": s.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "signal_delay_s": s.signal_delay_s,
        "setup": setup_lines(cfg),
        # requeue-able even where the cluster's JobRequeue=0 (needed by `scontrol requeue` and preemption)
        "additional_parameters": {"requeue": True},
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem_gb:
        params["mem"] = f"{s.mem_gb}GB"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[key] = getattr(s, key)
    if s.exclude:
        params["exclude"] = ",".join(s.exclude)
    return params


def submitit_command(folder: Path) -> str:
    """The command submitit puts after ``srun`` (same as ``SlurmExecutor._submitit_command_str``)."""
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_script(cfg: Config, folder: Path) -> str:
    """The sbatch script submitit would write for this config (for ``--dry-run``; needs no SLURM)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **slurm_parameters(cfg))
