"""Experiment config + cluster profile + command-line flags -> the resolved ``Config`` and executor parameters.

Order (later wins): the experiment YAML, the profile (``--profile NAME`` = ``configs/cluster/NAME.yaml``,
the ``slurm`` section), ``key=value`` overrides, then the scheduling flags (``--nodes``, ``--time``, ...).
The job's shape decides the world size: ``dist.world_size`` becomes ``slurm.nodes x slurm.tasks_per_node``,
and on GPU clusters there is one task per GPU (``tasks_per_node = gpus_per_node``), so the config is
validated for the world size that will really run.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_pipeline.source import is_url
from roformer_dist.config import Config, load_config, replace
from roformer_dist.errors import ConfigError

# Written into the sbatch script before srun: `scancel --signal=USR2 --full` (and some preemption setups)
# also signal the batch shell, whose default action on SIGUSR2 is to die and end the job (measured here).
# With a trap the shell lives on; the ranks get the signal from SLURM directly and save.
USR2_TRAP = "trap 'echo \"$(date +%T) batch script: SIGUSR2, the ranks save and rank 0 requeues\"' USR2"


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
    # The job may start in another working directory than this shell's: make paths absolute.
    paths = {"run_dir": cfg.run_dir}
    for key, value in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards)):
        if value and not is_url(value):
            paths[key] = value
    return replace(cfg, **{k: str(Path(v).expanduser().resolve()) for k, v in paths.items()})


def check_data(cfg: Config) -> None:
    """A local shard set is a directory with a manifest.json: refuse to queue without one. A shard set at a
    URL is checked by the job when it starts (a ``pipe:`` command may only work on the compute nodes)."""
    for key, value in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards)):
        if key == "data.shards" and not value:
            raise ConfigError("data.shards: no training shard set given")
        if value and not is_url(value) and not (Path(value) / "manifest.json").is_file():
            raise ConfigError(f"{key}: {value} is not a shard set (no manifest.json; make one with "
                             "`roformer-data prepare`)")


def job_name(cfg: Config) -> str:
    return f"roformer-{Path(cfg.run_dir).name}"


def _double_quoted(value: str) -> str:
    """Quote for the batch shell but let it expand $VARIABLES (profiles use $HOME and the like)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def setup_lines(cfg: Config) -> list[str]:
    """Shell lines run in the batch script before srun: the USR2 trap, the profile's env, its setup."""
    env = [f"export {k}={_double_quoted(v)}" for k, v in cfg.slurm.env.items()]
    return [USR2_TRAP, *env, *cfg.slurm.setup]


def slurm_parameters(cfg: Config) -> dict:
    """Parameters of ``submitit.SlurmExecutor.update_parameters`` (also what ``--dry-run`` renders)."""
    s = cfg.slurm
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
    return params


def submitit_command(folder: Path) -> str:
    """The command submitit puts after ``srun`` (same as ``SlurmExecutor._submitit_command_str``)."""
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_script(cfg: Config, folder: Path) -> str:
    """The sbatch script submitit would write for this config (for ``--dry-run``; needs no SLURM)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **slurm_parameters(cfg))
