"""A SLURM job whose hang watchdog ended an attempt (``runtime/heartbeat.py``, exit 76): keep the job off the nodes
that went silent, and bound the restarts.

Every task whose watchdog fired calls :func:`after_hang`; the first of an attempt acts, the others return (an
exclusive marker file per job and attempt in ``<run_dir>/hang/``). It reads the ranks' heartbeat files: a rank that
dumped no stack (a stopped process, one stuck outside Python: a GPU or NIC that hangs) is *silent*, and its SLURM
node is the suspect. Then:

- within ``slurm.max_hang_requeues`` requeues of this job: the job is requeued and the suspects are added to its
  excluded nodes (``scontrol update JobId=... ExcNodeList=...``, merged with those there, ``slurm.exclude``
  included: SLURM takes it once the job no longer runs, so right after the requeue, while the task is being
  ended) unless that would leave the partition fewer nodes than the job needs (then none is added, and the
  log says why); the next attempt starts elsewhere and resumes from the newest checkpoint;
- a requeue that SLURM refuses (or an ``scontrol`` that does not answer within 30 s) is recorded as not
  requeued, with its reason, and the job ends with the attempt;
- past it: one line names the count and the suspects, and the job ends (its step's tasks are killed: a silent
  task would otherwise hold the job until its time limit); ``roformer-submit --wait`` exits with
  :data:`EXIT_HANG_LIMIT`.

Each decision is appended to ``<run_dir>/hang/requeues.json`` (a list: time, job, attempt, silent ranks and
nodes, excluded nodes, requeued, not requeued or ended), which ``roformer-submit`` reads back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from data_pipeline.atomic import atomic_write_text
from launcher.slurm import nodes_left

__all__ = ["EXIT_HANG_LIMIT", "REQUEUES", "after_hang", "silent_ranks", "records", "ended_record"]

EXIT_HANG_LIMIT = 77
"""``roformer-submit --wait``: the job hung more than ``slurm.max_hang_requeues`` times and was ended."""
REQUEUES = "requeues.json"


def silent_ranks(hang_dir: Path, world_size: int) -> dict[int, str]:
    """Rank -> its SLURM node (or host) for each rank whose heartbeat file exists but that dumped no stack."""
    out = {}
    for r in range(world_size):
        if (hang_dir / f"rank{r}.stack").exists():
            continue
        try:
            rec = json.loads((hang_dir / f"rank{r}.json").read_bytes().strip())
        except (OSError, ValueError):
            continue
        out[r] = rec.get("node") or rec.get("host", "")
    return out


def records(hang_dir: Path) -> list[dict]:
    """The decisions taken so far (``requeues.json``; [] when there is none or it cannot be read)."""
    try:
        data = json.loads((hang_dir / REQUEUES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def ended_record(hang_dir: Path, job_id: str) -> Optional[dict]:
    """The record of job ``job_id`` ended for the limit, if it was."""
    return next((r for r in records(hang_dir) if r.get("job_id") == job_id and r.get("ended")), None)


def _scontrol(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """``scontrol ARGS``; one that cannot start or does not answer within ``timeout_s`` is a failed call
    (return code 1, the reason in ``stderr``): a hang's decision goes on without what it would have said."""
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(["scontrol", *args], 1, "", f"scontrol {' '.join(args)}: {e}")


def _hostnames(expression: str) -> list[str]:
    """``n[1-3],m1`` -> its node names (``scontrol show hostnames``)."""
    if not expression or expression == "(null)":
        return []
    out = _scontrol("show", "hostnames", expression).stdout.split()
    return out or expression.split(",")


def _job_fields(job_id: str) -> dict[str, str]:
    fields = {}
    for word in _scontrol("show", "job", "-o", job_id).stdout.split():
        key, eq, value = word.partition("=")
        if eq:
            fields.setdefault(key, value)
    return fields


def _exclusion(job_id: str, suspects: list[str]) -> tuple[list[str], str]:
    """The job's excluded nodes with ``suspects`` added, and why none were added ('' when they were)."""
    job = _job_fields(job_id)
    excluded = _hostnames(job.get("ExcNodeList", ""))
    new = sorted(set(suspects) - set(excluded))
    if not new:
        return excluded, "" if suspects else "no rank went silent (each dumped its stack): no node is suspect"
    partition = job.get("Partition", "")
    needed = int(job.get("NumNodes", "1").split("-")[0] or 1)
    _, left = nodes_left(partition, [*excluded, *new])
    if len(left) < needed:
        return excluded, (f"excluding {', '.join(new)} would leave partition {partition or '(default)'} "
                          f"{len(left)} node(s) for a job of {needed}: not excluded")
    return sorted(set(excluded) | set(new)), ""


def _update_exclusion(job_id: str, nodes: list[str], timeout_s: float = 5.0) -> str:
    """Set the requeued job's excluded nodes (SLURM takes it once the job is no longer running: right after
    the requeue, while this task is being ended); returns why it failed, or ''."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}")
        if r.returncode == 0:
            return ""
        if time.monotonic() > deadline:
            return f"scontrol update ExcNodeList failed: {(r.stderr or r.stdout).strip()}"
        time.sleep(0.2)


def _append(hang_dir: Path, record: dict, replace_last: bool = False) -> None:
    """Add ``record`` to ``requeues.json`` (or put it in place of the last one)."""
    kept = records(hang_dir)
    if replace_last:
        kept = kept[:-1]
    try:
        atomic_write_text(hang_dir / REQUEUES, json.dumps(kept + [record], indent=1) + "\n")
    except OSError as e:  # a full disk: the decision still stands, the log says it
        print(f"hang: could not record the decision in {hang_dir / REQUEUES}: {e}", file=sys.stderr, flush=True)


def after_hang(hang_dir: Path, job_id: str, world_size: int, max_requeues: int, grace_s: float = 10.0) -> None:
    """See the module docstring; returns to the watchdog (which exits 76) unless the job ends here. ``grace_s``:
    how long the ranks whose watchdogs fire later (their last step ended later) have to dump their stacks
    before those that did not count as silent."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    try:
        os.close(os.open(hang_dir / f"requeue.{job_id}.{attempt}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
    except FileExistsError:
        return  # another task of this attempt acts
    except OSError:
        pass  # a full disk: act anyway
    deadline = time.monotonic() + grace_s
    while silent_ranks(hang_dir, world_size) and time.monotonic() < deadline:
        time.sleep(0.5)
    silent = silent_ranks(hang_dir, world_size)
    suspects = sorted({node for node in silent.values() if node})
    done = sum(1 for r in records(hang_dir) if r.get("job_id") == job_id and r.get("requeued"))
    record = {"time": time.time(), "job_id": job_id, "attempt": int(attempt), "silent_ranks": sorted(silent),
              "silent_nodes": suspects}
    named = ", ".join(suspects) or "none (every rank dumped its stack)"
    if done >= max_requeues:
        line = (f"hang: job {job_id} hung again after {done} hang requeue(s) (slurm.max_hang_requeues: "
                f"{max_requeues}): not requeued, the job ends. Nodes of the ranks that went silent: {named}. "
                f"Add bad nodes to slurm.exclude and submit the same command again to resume.")
        _append(hang_dir, {**record, "ended": True, "message": line})
        print(line, file=sys.stderr, flush=True)
        step = os.environ.get("SLURM_STEP_ID")
        if step is not None:  # the silent tasks too (this one with them)
            subprocess.run(["scancel", "--signal=KILL", f"{job_id}.{step}"], capture_output=True, timeout=30,
                           check=False)
        os._exit(EXIT_HANG_LIMIT)
    excluded, why = _exclusion(job_id, suspects)
    record = {**record, "excluded": excluded, "requeued": True, **({"not_excluded": why} if why else {})}
    _append(hang_dir, record)  # before the requeue, which ends this task: the count must hold it
    print(f"hang: requeueing job {job_id} ({done + 1} of slurm.max_hang_requeues {max_requeues}); nodes of the "
          f"ranks that went silent: {named}; excluded from the job now: {', '.join(excluded) or 'none'}"
          + (f" ({why})" if why else ""), file=sys.stderr, flush=True)
    r = _scontrol("requeue", str(job_id))
    if r.returncode != 0:  # the job ends with this attempt: the record and the log say so
        failed = f"scontrol requeue failed: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}"
        _append(hang_dir, {**record, "requeued": False, "not_requeued": failed}, replace_last=True)
        print(f"hang: {failed}; submit the same command again to resume", file=sys.stderr, flush=True)
        return
    failed = _update_exclusion(job_id, excluded) if excluded and not why else ""
    if failed:
        _append(hang_dir, {**record, "excluded": _hostnames(_job_fields(job_id).get("ExcNodeList", "")),
                           "not_excluded": failed}, replace_last=True)
        print(f"hang: {failed}", file=sys.stderr, flush=True)
