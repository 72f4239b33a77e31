"""``roformer-data prepare|shards --tasks N``: run the tasks of :mod:`data_pipeline.cluster` through submitit.

``--cluster slurm`` (``--slurm``): one SLURM job array, one array element per task (one node, one
SLURM task, ``cpus_per_task`` CPUs, which is also the task's number of tokenising processes), with
the cluster profiles of ``roformer-submit`` (``--profile NAME``; ``--partition``, ``--account``,
``--qos``, ``--constraint``, ``--time``, ``--cpus-per-task``, ``--mem`` override it; the profile's
``setup`` lines, ``env`` and ``env_from`` go into the batch script as ``roformer-submit`` writes them,
see ``launcher.profiles``). A preempted or timed-out element is requeued by submitit and starts its
task over. ``--cluster local``: the same tasks as processes on this
machine (submitit's local executor), the CPUs shared between them.

The submitting process waits: it prints a progress line per task (from the task's
``progress.json``) at most every 10 s and one when it finishes; when a task fails it cancels the
others and raises :class:`~data_pipeline.errors.TaskError` (or the task's own DataError) with the
end of the task's log. The submitit folder (scripts, pickles, logs) is ``<staging>/logs``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import time
from pathlib import Path

import submitit

from data_pipeline import cluster
from data_pipeline.errors import DataError, TaskError, UsageError
from data_pipeline.options import ClusterOptions, DataOptions

__all__ = ["PrepareTask", "run_tasks", "slurm_parameters", "main"]

PROGRESS_EVERY_S = 10.0


class PrepareTask(submitit.helpers.Checkpointable):
    """One task of the array; requeued as it was (``Checkpointable``), it starts its task over."""

    def __init__(self, spec: cluster.Spec, staging: str):
        self.spec, self.staging = spec, staging

    def __call__(self, task: cluster.Task) -> dict:
        return cluster.run_task(self.spec, task, self.staging)


def slurm_parameters(c: ClusterOptions, num_tasks: int) -> tuple[dict, int, int]:
    """(submitit SlurmExecutor parameters, CPUs per task, max_num_timeout) from the profile and flags."""
    from launcher import profiles
    from roformer_dist.config import load_config

    items = [f"slurm={c.profile}"] if c.profile else []
    for key, flag in (("partition", c.partition), ("account", c.account), ("qos", c.qos),
                      ("constraint", c.constraint), ("time_min", c.time), ("cpus_per_task", c.cpus_per_task)):
        if flag is not None:
            items.append(f"slurm.{key}={flag}")
    if c.mem:
        items.append(f"slurm.mem_gb={profiles.parse_mem_gb(c.mem)}")
    try:
        cfg = load_config(None, items)
        profiles.check_submit_env(cfg.slurm)  # slurm.env_from: set here, passed on by sbatch
    except ValueError as e:
        raise UsageError(str(e)) from None
    params = profiles.slurm_parameters(cfg)
    params.pop("gpus_per_node", None)                 # tokenising needs no GPU
    cpus = cfg.slurm.cpus_per_task
    params.update(job_name="roformer-data-prepare", nodes=1, ntasks_per_node=1, cpus_per_task=cpus,
                  array_parallelism=num_tasks)
    return params, cpus, cfg.slurm.max_num_timeout


def run_tasks(mode: str, spec: cluster.Spec, tasks: list, staging: Path, o: DataOptions) -> None:
    """Submit ``tasks`` and wait for all of them (see the module docstring)."""
    folder = Path(staging) / "logs"
    if mode == "slurm":
        if shutil.which("sbatch") is None:
            raise UsageError("--cluster slurm: no sbatch on PATH (no SLURM here); use --cluster local")
        params, cpus, max_timeouts = slurm_parameters(o.cluster, len(tasks))
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_timeouts)
        ex.update_parameters(**params)
        workers = o.shards.workers or cpus
    else:
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=o.cluster.time or 7 * 24 * 60)
        workers = o.shards.workers or max(1, (os.cpu_count() or 1) // len(tasks))
    spec = dataclasses.replace(spec, workers=workers)
    jobs = ex.map_array(PrepareTask(spec, str(staging)), tasks)
    ids = sorted({j.job_id.split("_")[0] for j in jobs})
    print(f"{time.strftime('%H:%M:%S')} submitted {len(jobs)} task(s) ({mode}, job {', '.join(ids)}), "
          f"{workers} tokenising process(es) each", flush=True)
    try:
        _follow(jobs, tasks, Path(staging))
    except BaseException:
        for j in jobs:
            if not j.done():
                j.cancel(check=False)
        raise


def _follow(jobs: list, tasks: list, staging: Path) -> None:
    n = len(jobs)
    printed: dict[int, float] = {}
    finished: set[int] = set()
    while len(finished) < n:
        for i, (job, task) in enumerate(zip(jobs, tasks)):
            if i in finished:
                continue
            if job.done():
                _check(job, task, n)
                r = cluster.read_progress(staging, task.index) or {}
                finished.add(i)
                print(f"{time.strftime('%H:%M:%S')} task {task.index + 1}/{n} done: {r.get('docs', 0)} documents, "
                      f"{r.get('tokens', 0)} tokens, {r.get('text_bytes', 0) / 1e6:.1f} MB of text in "
                      f"{r.get('seconds', 0):.1f} s ({r.get('text_bytes', 0) / max(r.get('seconds', 0), 1e-9) / 1e6:.2f} "
                      f"MB/s)", flush=True)
                continue
            r = cluster.read_progress(staging, task.index)
            if r and time.monotonic() - printed.get(i, 0.0) >= PROGRESS_EVERY_S:
                printed[i] = time.monotonic()
                print(f"{time.strftime('%H:%M:%S')} task {task.index + 1}/{n}: {r['docs']} documents, "
                      f"{r['text_bytes'] / 1e6:.1f} MB of text, {r['text_bytes'] / max(r['seconds'], 1e-9) / 1e6:.2f} "
                      f"MB/s", flush=True)
        time.sleep(1.0)


def _check(job, task, n: int) -> None:
    """Raise the task's error (DataError / UsageError as the task raised it, else TaskError)."""
    try:
        job.result()
        return
    except Exception as e:  # noqa: BLE001 - submitit reports a task's failure as its own exception types
        text = str(e)
    # submitit's message holds the task's traceback (then the paths of its logs): find our error in it
    errors = re.findall(r"^data_pipeline\.[\w.]*?(DataError|CorruptShardError|UsageError): (.*)$", text, re.M)
    if errors:
        kind, message = errors[-1]
        raise (UsageError if kind == "UsageError" else DataError)(f"task {task.index + 1}/{n} ({task.describe()}): "
                                                                 f"{message}")
    lines = [x for x in text.strip().splitlines() if x.strip() and not x.strip().startswith("- ")]
    line = lines[-1].strip() if lines else "(no error text)"
    log_tail = ""
    try:
        log_tail = "\n".join(Path(job.paths.stderr).read_text(errors="replace").splitlines()[-15:])
    except OSError:
        pass
    raise TaskError(f"task {task.index + 1}/{n} (job {job.job_id}, state {job.state}) failed: {line}\n"
                    f"end of its log:\n{log_tail}")


def main(argv=None) -> int:
    """``roformer-data``: the data pipeline's command with this module's cluster runner for ``--tasks``."""
    from data_pipeline.cli import main as data_main

    return data_main(argv, run_tasks=run_tasks)


if __name__ == "__main__":
    sys.exit(main())
