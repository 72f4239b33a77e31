"""``roformer-submit``: submit a pretraining run to SLURM (or run it here), and look after it.

    roformer-submit --config FILE [key=value ...] [--cluster slurm|local] [--profile NAME] [--nodes N]
                    [--gpus-per-node G] [--tasks-per-node T] [--cpus-per-task C] [--mem 64G]
                    [--partition P] [--account A] [--qos Q] [--constraint C] [--time MINUTES]
                    [--wait] [--dry-run]
    roformer-submit status RUN_DIR      state, requeue count, progress
    roformer-submit cancel RUN_DIR      scancel the run's job
    roformer-submit logs RUN_DIR [-n N] [--rank R]   tail a rank's log (default rank 0)

Submitting validates the config for the job's world size (a bad config exits 2 naming the key and
queues nothing), creates the run directory, writes the resolved config there, records the job id in
``<run_dir>/logs/job_id`` (history in ``logs/jobs.jsonl``) and prints ``job_id: <id>``. The submitit
folder (sbatch script, pickles, per-task stdout/stderr) is ``<run_dir>/logs/``, beside the trainer's
``rank<r>.log``. ``--cluster local`` (the default when there is no ``sbatch``) runs the same job on this
machine with submitit's local executor, in the foreground.

Trust (docs/guides/security.md):

- What reaches the batch script is validated and quoted (``launcher.profiles``): no line of a config
  value becomes a script line, and ``slurm.env`` values expand only ``$NAME`` / ``${NAME}``.
- Secrets by reference: ``slurm.env_from: {WANDB_API_KEY: WANDB_API_KEY}`` names a variable of the
  environment this command runs in; it must be set (checked, also by ``--dry-run``), and only its name
  is written (config.yaml, the batch script, the pickles); sbatch exports the value with the rest of the
  environment (``--cluster local``: the tasks inherit it).
- Files: the run directory and ``logs/`` are created and checked by the run lock
  (``roformer_dist.runtime.rundir``: owner, no group/other write, no symlinks) before anything is
  written there. What this command writes (config.yaml, ``logs/job_id``, ``logs/jobs.jsonl``, submitit's
  sbatch script and pickles) is created under umask 027 (077 when ``run_dir_mode`` gives the group no
  read): never readable by others, never writable but by the owner. The SLURM job gets the same umask
  (``SLURM_UMASK``; the local executor's tasks inherit it), so its result pickles, logs and checkpoints
  follow the same rule.
- ``status`` / ``cancel`` / ``logs`` read ``logs/jobs.jsonl``: a record that is damaged, or whose job id
  is not a SLURM job id (or, for ``--cluster local``, a process id), is refused with a message naming
  the file and line, before the id reaches ``squeue``/``sacct``/``scancel`` (which get ``--jobs=ID`` or
  ``-- ID``). A local job is signalled only if its process is still the one recorded at launch (its start
  time, ``/proc/PID/stat`` field 22, is in the record; a record without one is not signalled).

Exit status: see :data:`EXIT_STATUSES` (the end of ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from data_pipeline.atomic import atomic_write_text
from data_pipeline.command_line import CommandParser
from launcher import profiles, slurm
from launcher.hang_requeue import EXIT_HANG_LIMIT, ended_record
from launcher.hang_requeue import records as hang_records
from launcher.profiles import JobFlags
from roformer_dist.config import DecayShape, choices, fork_overrides, parse_mode, save_config
from roformer_dist.errors import ConfigError, run_command
from roformer_dist.runtime.rundir import RunDir
from roformer_dist.runtime.runlock import SLURM_JOB_ID, RunLock, pid_start

EXIT_OK, EXIT_FAILED, EXIT_LOCKED = 0, 1, 6
EXIT_STATUSES = f"""exit status:
  0    submitted (with --wait or --cluster local: the job COMPLETED)
  1    the job ended in another state; SLURM says it can never start (--wait names SLURM's pending reason,
       e.g. PartitionConfig, instead of waiting forever); submission failed
  2    bad config or usage (the key is named)
  6    the run directory is in use (a run holds its lock, or its last SLURM job is still queued or running)
  {EXIT_HANG_LIMIT}   --wait: the job hung more than slurm.max_hang_requeues times and was ended (the nodes of the
       ranks that went silent are named; <run_dir>/hang/requeues.json)"""
SUBCOMMANDS = ("status", "cancel", "logs")


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="roformer-submit",
        description="Submit a RoFormer pretraining run to SLURM through submitit (requeued on time limits and "
                    "preemption, resumed from its checkpoints), or run it on this machine. "
                    "Also: roformer-submit status|cancel|logs RUN_DIR.",
        epilog="examples:\n"
               "  roformer-submit --config configs/experiments/debug.yaml --profile local --wait\n"
               "  roformer-submit --config configs/experiments/demo.yaml --profile example_gpu --nodes 4 "
               "--time 1440\n"
               "  roformer-submit --config configs/experiments/debug.yaml --nodes 2 --tasks-per-node 1 --dry-run\n"
               "  roformer-submit status runs/debug\n\n" + EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment YAML (configs/experiments/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--fork", metavar="PARENT", help="start a new run from PARENT's weights (init.from=PARENT; see "
                                                 "roformer-train --help); a requeue resumes the fork itself")
    p.add_argument("--decay", metavar="STEPS", type=int,
                   help="with --fork: a decay branch of STEPS steps from PARENT (see roformer-train --help)")
    p.add_argument("--decay-shape", choices=choices(DecayShape), help="with --decay: optim.decay_shape")
    p.add_argument("--cluster", choices=("slurm", "local"),
                   help="slurm, or local = this machine without SLURM (default: slurm when sbatch exists)")
    p.add_argument("--profile", help="cluster profile configs/cluster/NAME.yaml (or a YAML path): the slurm section")
    p.add_argument("--nodes", type=int, help="nodes (slurm.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node; one rank per GPU (slurm.gpus_per_node)")
    p.add_argument("--tasks-per-node", type=int, help="ranks per node (slurm.tasks_per_node)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per rank (slurm.cpus_per_task)")
    p.add_argument("--mem", help="memory per node, e.g. 64G (slurm.mem_gb)")
    p.add_argument("--partition", help="slurm.partition")
    p.add_argument("--account", help="slurm.account")
    p.add_argument("--qos", help="slurm.qos")
    p.add_argument("--constraint", help="slurm.constraint")
    p.add_argument("--time", type=int, metavar="MINUTES", help="time limit per attempt (slurm.time_min)")
    p.add_argument("--wait", action="store_true", help="follow the job through requeues; exit 0 iff it COMPLETED")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sbatch script, then the run's plan and each stage's memory per GPU (as "
                        "roformer-train --dry-run); submit nothing; exit 2 naming a stage that does not fit")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="with --dry-run: the memory of one GPU of the job, e.g. 80GB (default: the visible GPU's)")
    return p


def _flags(args: argparse.Namespace) -> JobFlags:
    return JobFlags(profile=args.profile, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                    tasks_per_node=args.tasks_per_node, cpus_per_task=args.cpus_per_task,
                    mem_gb=profiles.parse_mem_gb(args.mem) if args.mem else None, partition=args.partition,
                    account=args.account, qos=args.qos, constraint=args.constraint, time_min=args.time)


def _say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def submit(args: argparse.Namespace) -> int:
    fork = fork_overrides(args.fork, args.decay, args.decay_shape)
    cfg = profiles.resolve(args.config, args.overrides + fork, _flags(args))
    profiles.check_data(cfg)
    cluster = args.cluster or ("slurm" if shutil.which("sbatch") else "local")
    profiles.check_submit_env(cfg.slurm, cluster)
    run_dir = Path(cfg.run_dir)
    logs = RunDir(run_dir).logs
    s = cfg.slurm
    if args.gpu_memory and not args.dry_run:
        raise ConfigError("--gpu-memory: only with --dry-run (the estimate's budget)")
    if args.dry_run:
        if cluster == "slurm":
            print(profiles.sbatch_script(cfg, logs), end="")
        else:
            print(f"# --cluster local: {cfg.dist.world_size} task(s) on this machine (submitit LocalExecutor), "
                  f"time limit {s.time_min} min, logs in {logs}")
        from roformer_dist.launch.dry_run import dry_run
        from roformer_dist.launch.memory_estimate import parse_bytes

        # the plan as comments: the output stays a batch script (--dry-run > job.sh)
        dry_run(cfg, cfg.dist.world_size, parse_bytes(args.gpu_memory) if args.gpu_memory else None,
                print_fn=lambda text: print("\n".join(f"# {line}" for line in text.splitlines())))
        return EXIT_OK
    if cluster == "slurm" and not shutil.which("sbatch"):
        print("roformer-submit: no sbatch on PATH (no SLURM here); use --cluster local", file=sys.stderr)
        return EXIT_FAILED

    busy = _busy(run_dir)
    if busy:
        print(f"roformer-submit: {busy}", file=sys.stderr)
        return EXIT_LOCKED
    if cluster == "slurm" and s.exclude:
        _check_exclude(s)

    with private_files(cfg.run_dir_mode) as mask:
        # not while a run holds it: its config.yaml must not change under it; the lock creates and checks
        # run_dir and logs/ (owner and mode: the pickles in logs/ are unpickled by a requeued job) before
        # anything is written there
        with RunLock(run_dir, mode=cfg.run_dir_mode):
            save_config(cfg, RunDir(run_dir).config)
        job = _submit(cfg, cluster, logs)
        _record(run_dir, job.job_id, cluster, mask)
    print(f"job_id: {job.job_id}", flush=True)
    shape = f"{s.nodes} node(s) x {s.tasks_per_node} task(s)" if cluster == "slurm" else \
        f"{cfg.dist.world_size} task(s) on this machine"
    _say(f"{cluster}: {shape}, world size {cfg.dist.world_size}, run_dir {run_dir}")
    if cluster == "local":
        return _wait_local(job)
    if args.wait:
        return _wait_slurm(job.job_id, run_dir)
    return EXIT_OK


@contextlib.contextmanager
def private_files(run_dir_mode: str) -> Iterator[int]:
    """Files created in the block, and by the SLURM job submitted in it (``SLURM_UMASK``, which sbatch
    passes to the job; the local executor's processes inherit the umask), are never readable by others
    and never writable but by their owner: umask 027, or 077 when ``run_dir_mode`` gives the group no
    read. Yields the umask."""
    mask = 0o027 if parse_mode(run_dir_mode) & 0o040 else 0o077
    old_mask = os.umask(mask)
    old_env = os.environ.get("SLURM_UMASK")
    os.environ["SLURM_UMASK"] = f"{mask:04o}"  # one set by an outer allocation would win over our umask
    try:
        yield mask
    finally:
        os.umask(old_mask)
        if old_env is None:
            os.environ.pop("SLURM_UMASK", None)
        else:
            os.environ["SLURM_UMASK"] = old_env


def _busy(run_dir: Path) -> str:
    """Why ``run_dir`` cannot take another job now ('' when it can): its last SLURM job is still queued or
    running (a second one would start beside it and be refused by the run lock)."""
    if not RunDir(run_dir).jobs.exists():
        return ""
    try:
        job = _last_job(run_dir)
    except ConfigError as e:
        print(f"roformer-submit: warning: {e}; not checking whether the run's last job still runs", file=sys.stderr)
        return ""
    if job.get("cluster") != "slurm" or not shutil.which("squeue"):
        return ""
    st = slurm.state(job["job_id"])
    if st in ("UNKNOWN", "") or slurm.is_final(st):
        return ""
    return (f"{run_dir} already has SLURM job {job['job_id']} ({st}); it resumes from the run's checkpoints by "
            f"itself. Cancel it first (roformer-submit cancel {run_dir}) or use another run_dir")


def _submit(cfg, cluster: str, logs: Path):
    import submitit

    from launcher.job import TrainJob

    s = cfg.slurm
    if cluster == "slurm":
        ex = submitit.SlurmExecutor(folder=logs, max_num_timeout=s.max_num_timeout)
        ex.update_parameters(**profiles.slurm_parameters(cfg))
    else:
        os.environ.update(profiles.job_environment(s))  # the local controller and its tasks inherit it
        ex = submitit.LocalExecutor(folder=logs, max_num_timeout=s.max_num_timeout)
        ex.update_parameters(timeout_min=s.time_min, signal_delay_s=s.signal_delay_s,
                             tasks_per_node=cfg.dist.world_size, gpus_per_node=s.gpus_per_node * s.nodes)
    job = ex.submit(TrainJob(cfg))
    if cluster == "slurm":
        # job ids restart after the accounting DB is purged: drop results of an older job with this id
        for old in logs.glob(f"{job.job_id}_*_result.pkl"):
            old.unlink(missing_ok=True)
    return job


def _record(run_dir: Path, job_id: str, cluster: str, mask: int = 0o077) -> None:
    """``logs/job_id`` and a line of ``logs/jobs.jsonl`` (mode 0666 & ~``mask``, also when it existed
    wider); a local job's record holds its controller's start time, which ``cancel`` checks."""
    logs = RunDir(run_dir).logs
    atomic_write_text(logs / "job_id", f"{job_id}\n")
    rec = {"job_id": job_id, "cluster": cluster, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "argv": sys.argv[1:]}
    if cluster == "local":
        rec["pid_start"] = pid_start(int(job_id))
    fd = os.open(RunDir(run_dir).jobs, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666 & ~mask)
    with os.fdopen(fd, "a") as f:
        os.fchmod(fd, 0o666 & ~mask)
        f.write(json.dumps(rec) + "\n")


def _check_exclude(s) -> None:
    """ConfigError when ``slurm.exclude`` leaves the partition fewer nodes than the job needs (it would pend
    forever)."""
    nodes, left = slurm.nodes_left(s.partition, s.exclude)
    if nodes and len(left) < s.nodes:
        raise ConfigError(f"slurm.exclude: leaves partition {s.partition or '(default)'} {len(left)} of its "
                          f"{len(nodes)} node(s) ({', '.join(nodes)}) for a job of {s.nodes}: it would never start")


def _wait_local(job) -> int:
    try:
        job.results()
    except Exception as e:  # noqa: BLE001 - submitit raises its own job errors; report and fail
        _say(f"final state: FAILED\n{e}")
        return EXIT_FAILED
    _say("final state: COMPLETED")
    return EXIT_OK


def _wait_slurm(job_id: str, run_dir: Path) -> int:
    try:
        final = slurm.wait(job_id, report=lambda st: _say(f"job {job_id}: {st}"))
    except slurm.Unschedulable as e:
        print(f"roformer-submit: {e}; the job stays queued until you change it or cancel it "
              f"(roformer-submit cancel {run_dir})", file=sys.stderr)
        return EXIT_FAILED
    _say(f"final state: {final} (requeues: {slurm.requeue_count(job_id)})")
    ended = None if final == "COMPLETED" else ended_record(RunDir(run_dir).hang, job_id)
    if ended:
        print(f"roformer-submit: {ended.get('message', 'the job hung past slurm.max_hang_requeues')}",
              file=sys.stderr)
        return EXIT_HANG_LIMIT
    return EXIT_OK if final == "COMPLETED" else EXIT_FAILED


# --------------------------------------------------------------------------- status | cancel | logs


_PID = re.compile(r"[1-9][0-9]*")


def _last_job(run_dir: Path) -> dict:
    """The last record of ``logs/jobs.jsonl``, checked (module docstring); ConfigError naming the file
    and line otherwise."""
    path = RunDir(run_dir).jobs
    if not path.exists():
        raise ConfigError(f"{run_dir}: no job was submitted for this run directory ({path} missing)")
    try:
        lines = [(n, x) for n, x in enumerate(path.read_text(errors="replace").splitlines(), 1) if x.strip()]
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if not lines:
        raise ConfigError(f"{path}: holds no job record")
    n, line = lines[-1]
    where = f"{path}, line {n}"
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        raise ConfigError(f"{where}: not a JSON record (damaged?): {line[:80]!r}") from None
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {line[:80]!r}")
    cluster, jid = rec.get("cluster"), rec.get("job_id")
    if cluster not in ("slurm", "local"):
        raise ConfigError(f"{where}: cluster {cluster!r}: expected slurm or local")
    if cluster == "slurm" and not (isinstance(jid, str) and SLURM_JOB_ID.fullmatch(jid)):
        raise ConfigError(f"{where}: job_id {jid!r} is not a SLURM job id (expected digits, or <job>_<element> "
                          "for an element of a job array)")
    if cluster == "local" and not (isinstance(jid, str) and _PID.fullmatch(jid) and int(jid) > 1):
        raise ConfigError(f"{where}: job_id {jid!r} is not the process id of a --cluster local job")
    start = rec.get("pid_start")
    if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
        raise ConfigError(f"{where}: pid_start {start!r}: expected an integer")
    return rec


def _progress(run_dir: Path) -> str:
    import yaml

    step = 0
    metrics = RunDir(run_dir).metrics
    if metrics.exists():
        lines = [x for x in metrics.read_text(errors="replace").splitlines() if x.strip()]
        try:
            step = int(json.loads(lines[-1])["step"]) if lines else 0
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            step = "?"  # a last line cut short (the trainer killed mid-write)
    try:
        stages = yaml.safe_load(RunDir(run_dir).config.read_text())["curriculum"]["stages"]
        total = str(sum(int(st["steps"]) for st in stages))
    except (OSError, KeyError, TypeError, ValueError):
        total = "?"
    latest = RunDir(run_dir).latest
    tag = latest.read_text().strip() if latest.exists() else "none"
    return f"step {step}/{total}, latest checkpoint: {tag}"


def _local_state(job: dict) -> str:
    """A ``--cluster local`` job (its controller's pid and recorded start time): RUNNING when that process
    still runs, FINISHED when it is gone or its pid belongs to another process now, UNKNOWN when the pid
    is alive but the record has no start time to tell."""
    now = pid_start(int(job["job_id"]))
    if now is None:
        return "FINISHED"
    if job.get("pid_start") is None:
        return "UNKNOWN"
    return "RUNNING" if now == job["pid_start"] else "FINISHED"


def _signal_local(job: dict, sig: int) -> bool:
    """Send ``sig`` to the local job's controller if it is still the process recorded (False otherwise).
    Through a pidfd where there is one: the process checked is the process signalled."""
    pid = int(job["job_id"])
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if _local_state(job) != "RUNNING":
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def status(run_dir: Path) -> int:
    job = _last_job(run_dir)
    jid = job["job_id"]
    print(f"run_dir: {run_dir}")
    print(f"job_id: {jid} ({job['cluster']})")
    if job["cluster"] == "slurm":
        recs = slurm.attempts(jid)
        st = slurm.state(jid)
        reason = slurm.pending_reason(jid) if st == "PENDING" else ""
        why = slurm.never_starts(reason) if reason else None
        print(f"state: {st}" + (f" (reason: {reason})" if reason else ""))
        if why:
            print(f"  this job cannot start as submitted: {why}; change the request or cancel it")
        print(f"requeues: {max(0, len(recs) - 1)}")
        for i, r in enumerate(recs):
            print(f"  attempt {i + 1}: {r['state']:<10} start {r['start']} end {r['end']} nodes {r['nodes']}")
        for r in (r for r in hang_records(RunDir(run_dir).hang) if r.get("job_id") == jid):
            what = ("ended the job (slurm.max_hang_requeues)" if r.get("ended") else
                    f"not requeued ({r['not_requeued']})" if r.get("not_requeued") else
                    f"requeued, excluded: {', '.join(r.get('excluded', [])) or 'none'}"
                    + (f" ({r['not_excluded']})" if r.get("not_excluded") else ""))
            print(f"  hang in attempt {r.get('attempt', 0) + 1}: silent ranks {r.get('silent_ranks')} on "
                  f"{', '.join(r.get('silent_nodes', [])) or '-'}; {what}")
    else:
        st = _local_state(job)
        print(f"state: {st}" + (" (pid alive, but the record has no start time to tell it is the job's)"
                                if st == "UNKNOWN" else ""))
    print(f"progress: {_progress(run_dir)}")
    return EXIT_OK


def cancel(run_dir: Path) -> int:
    job = _last_job(run_dir)
    jid = job["job_id"]
    if job["cluster"] == "slurm":
        slurm.cancel(jid)
    elif not _signal_local(job, signal.SIGINT):  # what submitit's LocalJob.cancel sends to its controller
        if _local_state(job) == "UNKNOWN":
            print(f"roformer-submit cancel: not signalling pid {jid}: its record (written by an older "
                  "roformer-submit) has no start time, so it cannot be told from a process that reused the pid; "
                  f"check `ps -p {jid}` and stop it yourself", file=sys.stderr)
            return EXIT_FAILED
        print(f"job {jid} is not running (nothing to cancel)")
        return EXIT_OK
    print(f"cancelled job {jid}")
    return EXIT_OK


def logs(run_dir: Path, rank: int, lines: int) -> int:
    job = _last_job(run_dir)
    d = RunDir(run_dir).logs
    shown = 0
    for path in (d / f"rank{rank}.log", d / f"{job['job_id']}_{rank}_log.err", d / f"{job['job_id']}_{rank}_log.out"):
        if path.exists() and path.stat().st_size:
            print(f"==> {path} <==")
            print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
            shown += 1
    if not shown:
        print(f"no log of rank {rank} yet in {d}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def run_subcommand(argv: list[str]) -> int:
    p = CommandParser(prog=f"roformer-submit {argv[0]}", add_version=False)
    p.add_argument("run_dir", type=Path)
    if argv[0] == "logs":
        p.add_argument("--rank", type=int, default=0, help="whose log (default 0)")
        p.add_argument("-n", "--lines", type=int, default=50, help="lines from the end (default 50)")
    args = p.parse_args(argv[1:])
    run_dir = args.run_dir.resolve()
    if argv[0] == "status":
        return status(run_dir)
    if argv[0] == "cancel":
        return cancel(run_dir)
    return logs(run_dir, args.rank, args.lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return run_command(f"roformer-submit {argv[0]}", lambda: run_subcommand(argv))
    args = build_parser().parse_args(argv)
    return run_command("roformer-submit", lambda: submit(args))


if __name__ == "__main__":
    sys.exit(main())
