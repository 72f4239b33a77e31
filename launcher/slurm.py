"""What the CLI asks SLURM: a job's state (through requeues), its requeue count, cancel.

A requeued job keeps its id; ``sacct -D`` lists one record per attempt (REQUEUED, PREEMPTED, ... then the
current one), so the requeue count is the number of records minus one. ``squeue`` is asked first for
the live state because accounting lags behind the controller by a moment.

Every job id is checked (:func:`check_job_id`: digits, or ``<job>_<element>`` for an array element)
before it reaches a command, and is passed as ``--jobs=ID`` or after ``--``: an id read from a damaged
or forged ``jobs.jsonl`` such as ``--user=x`` must not become an option of ``scancel``.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Callable, Optional

from roformer_dist.errors import ConfigError
from roformer_dist.runtime.runlock import SLURM_JOB_ID

# States after which a job will not run again (a PREEMPTED job that SLURM requeues is back in squeue).
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


# Pending reasons after which SLURM will not start the job without someone changing the job or the
# cluster (squeue's %r; see the "JOB REASON CODES" of squeue(1)).
NEVER_STARTS = {
    "PartitionConfig": "the request does not fit the partition's configuration (CPUs, nodes, memory or GPUs)",
    "PartitionNodeLimit": "more nodes than the partition allows",
    "PartitionTimeLimit": "a longer time limit than the partition allows",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "BadConstraints": "the constraints cannot be satisfied by any node",
    "ReqNodeNotAvail": "a required node is down, drained or not responding",
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "DependencyNeverSatisfied": "a dependency can never be satisfied",
}
_LIMIT_REASON = re.compile(r"^(QOS|Assoc)\w*Max\w*PerJob\w*$")


def check_job_id(job_id: object) -> str:
    """``job_id`` if it is a SLURM job id (``runlock.SLURM_JOB_ID``), else ConfigError."""
    if not isinstance(job_id, str) or not SLURM_JOB_ID.fullmatch(job_id):
        raise ConfigError(f"{job_id!r} is not a SLURM job id (expected digits, or <job>_<element> for an element "
                          "of a job array)")
    return job_id


class Unschedulable(RuntimeError):
    """SLURM says the job cannot start as submitted; the message gives SLURM's reason."""


def never_starts(reason: str) -> Optional[str]:
    """Why a pending reason means the job will not start (None when it may still start)."""
    word = reason.split(",")[0].strip()
    if word in NEVER_STARTS:
        return NEVER_STARTS[word]
    if _LIMIT_REASON.match(word):
        return "the request exceeds a per-job limit of the QOS or association"
    return None


def pending_reason(job_id: str) -> str:
    """squeue's reason for a job that waits (``Resources``, ``Priority``, ``PartitionConfig``, ...), or ''."""
    out = _run(["squeue", "-h", f"--jobs={check_job_id(job_id)}", "-o", "%T|%r"]).strip()
    st, _, reason = out.partition("|")
    return reason.strip() if st.strip() == "PENDING" else ""


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _state_word(state: str) -> str:
    return state.split()[0].rstrip("+") if state.strip() else ""  # "CANCELLED by 0" -> CANCELLED


def attempts(job_id: str) -> list[dict]:
    """One record per attempt of the job (``sacct -D``), oldest first."""
    out = _run(["sacct", "-D", "-X", "-n", "-P", f"--jobs={check_job_id(job_id)}",
                "-o", "JobID,State,Start,End,Elapsed,ExitCode,NodeList"])
    keys = ("job_id", "state", "start", "end", "elapsed", "exit_code", "nodes")
    recs = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]
    for r in recs:
        r["state"] = _state_word(r["state"])
    return [r for r in recs if r["job_id"] == job_id]


def partition_nodes(partition: str = "") -> list[str]:
    """The node names of ``partition`` ('' = the default one; ``sinfo``), [] when SLURM does not answer."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N|%P"])
    nodes = []
    for line in out.splitlines():
        node, _, part = line.partition("|")
        if partition and part.rstrip("*") == partition or not partition and part.endswith("*"):
            nodes.append(node.strip())
    return sorted(set(nodes))


def nodes_left(partition: str, excluded) -> tuple[list[str], list[str]]:
    """(the nodes of ``partition``, those of them not in ``excluded``); both [] when SLURM does not answer."""
    nodes = partition_nodes(partition)
    return nodes, [n for n in nodes if n not in set(excluded)]


def requeue_count(job_id: str) -> int:
    return max(0, len(attempts(job_id)) - 1)


def state(job_id: str) -> str:
    """The job's state now: squeue while the controller has it, else the last accounting record."""
    live = _state_word(_run(["squeue", "-h", f"--jobs={check_job_id(job_id)}", "-o", "%T"]))
    if live and live not in FINAL:
        return live
    recs = attempts(job_id)
    if recs:
        return recs[-1]["state"]
    return live or "UNKNOWN"


def is_final(st: str) -> bool:
    return st in FINAL


def wait(job_id: str, poll_s: float = 3.0, report: Optional[Callable[[str], None]] = None,
         timeout_s: Optional[float] = None, unschedulable_after_s: float = 10.0) -> str:
    """Follow the job through requeues until it ends; returns the final state.

    A final state must be seen twice in a row: between an attempt's end and its requeue, accounting can
    briefly show the old attempt's end state. A job that stays pending for ``unschedulable_after_s``
    with a reason that means it will never start (:data:`NEVER_STARTS`) raises :class:`Unschedulable`."""
    check_job_id(job_id)
    last, finals, start = None, 0, time.monotonic()
    stuck_since: Optional[float] = None
    while True:
        st = state(job_id)
        if st != last and report:
            report(st)
        last = st
        finals = finals + 1 if is_final(st) else 0
        if finals >= 2:
            return st
        reason = pending_reason(job_id) if st == "PENDING" else ""
        why = never_starts(reason) if reason else None
        if why is None:
            stuck_since = None
        else:
            stuck_since = stuck_since if stuck_since is not None else time.monotonic()
            if time.monotonic() - stuck_since >= unschedulable_after_s:
                raise Unschedulable(f"job {job_id} cannot start: SLURM's pending reason is {reason} ({why})")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job {job_id} still {st} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", "--", check_job_id(job_id)], check=True, timeout=60)
