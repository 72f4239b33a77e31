"""What the CLI asks SLURM: a job's state (through requeues), its requeue count, cancel.

A requeued job keeps its id; ``sacct -D`` lists one record per attempt (REQUEUED, PREEMPTED, ... then the
current one), so the requeue count is the number of records minus one. ``squeue`` is asked first for
the live state because accounting lags behind the controller by a moment.
"""

from __future__ import annotations

import subprocess
import time
from typing import Callable, Optional

# States after which a job will not run again (a PREEMPTED job that SLURM requeues is back in squeue).
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _state_word(state: str) -> str:
    return state.split()[0].rstrip("+") if state.strip() else ""  # "CANCELLED by 0" -> CANCELLED


def attempts(job_id: str) -> list[dict]:
    """One record per attempt of the job (``sacct -D``), oldest first."""
    out = _run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id,
                "-o", "JobID,State,Start,End,Elapsed,ExitCode,NodeList"])
    keys = ("job_id", "state", "start", "end", "elapsed", "exit_code", "nodes")
    recs = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]
    for r in recs:
        r["state"] = _state_word(r["state"])
    return [r for r in recs if r["job_id"] == job_id]


def requeue_count(job_id: str) -> int:
    return max(0, len(attempts(job_id)) - 1)


def state(job_id: str) -> str:
    """The job's state now: squeue while the controller has it, else the last accounting record."""
    live = _state_word(_run(["squeue", "-h", "-j", job_id, "-o", "%T"]))
    if live and live not in FINAL:
        return live
    recs = attempts(job_id)
    if recs:
        return recs[-1]["state"]
    return live or "UNKNOWN"


def is_final(st: str) -> bool:
    return st in FINAL


def wait(job_id: str, poll_s: float = 3.0, report: Optional[Callable[[str], None]] = None,
         timeout_s: Optional[float] = None) -> str:
    """Follow the job through requeues until it ends; returns the final state.

    A final state must be seen twice in a row: between an attempt's end and its requeue, accounting can
    briefly show the old attempt's end state."""
    last, finals, start = None, 0, time.monotonic()
    while True:
        st = state(job_id)
        if st != last and report:
            report(st)
        last = st
        finals = finals + 1 if is_final(st) else 0
        if finals >= 2:
            return st
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job {job_id} still {st} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=True, timeout=60)
