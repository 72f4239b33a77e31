"""A hang's requeue when ``scontrol`` fails it (``launcher/hang_requeue.py``).

The local SLURM cluster's tests (tests/test_slurm.py, tests/test_multinode.py) cover the requeues that SLURM
takes. These cover the two failures it does not produce on demand: an ``scontrol`` that does not answer, and a
requeue that SLURM refuses. A stand-in ``scontrol`` first on PATH plays them; nothing else is replaced.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from launcher import hang_requeue

JOB = "4242"


def _stand_in(tmp_path: Path, monkeypatch, body: str) -> None:
    """An executable ``scontrol`` running ``body`` (bash) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text("#!/usr/bin/env bash\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _hang_dir(tmp_path: Path, world_size: int = 2) -> Path:
    """A hang directory whose ranks all wrote a heartbeat and dumped their stacks (none went silent)."""
    d = tmp_path / "run" / "hang"
    d.mkdir(parents=True)
    for r in range(world_size):
        (d / f"rank{r}.json").write_text(json.dumps({"rank": r, "node": "n1"}))
        (d / f"rank{r}.stack").write_text("stack\n")
    return d


def test_an_scontrol_that_does_not_answer_is_a_failed_call(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, "sleep 30\n")
    r = hang_requeue._scontrol("show", "job", "-o", JOB, timeout_s=0.5)
    assert r.returncode == 1 and "timed out after 0.5 seconds" in r.stderr, r
    assert r.stdout == ""


def test_an_scontrol_that_is_not_there_is_a_failed_call(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no scontrol anywhere
    r = hang_requeue._scontrol("requeue", JOB)
    assert r.returncode == 1 and "No such file or directory" in r.stderr, r


def test_a_refused_requeue_is_recorded_as_not_requeued_and_said(tmp_path, monkeypatch, capsys):
    """SLURM refuses the requeue (a job submitted with --no-requeue): after_hang records the attempt as not
    requeued with SLURM's reason, says to submit again, and returns to the watchdog (exit 76) rather than
    leaving a record that claims a requeue."""
    _stand_in(tmp_path, monkeypatch, """case "$1 $2" in
  "show job") echo "JobId=4242 JobName=x Partition=debug NumNodes=1 ExcNodeList=(null)";;
  "show hostnames") echo "$3" | tr , '\\n';;
  requeue*) echo "Requested operation is presently disabled for job 4242" >&2; exit 1;;
  *) exit 2;;
esac
""")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    hang = _hang_dir(tmp_path)
    hang_requeue.after_hang(hang, JOB, world_size=2, max_requeues=3, grace_s=0)
    err = capsys.readouterr().err
    assert ("hang: scontrol requeue failed: Requested operation is presently disabled for job 4242; submit the "
            "same command again to resume") in err, err
    [rec] = hang_requeue.records(hang)
    assert rec["requeued"] is False and rec["job_id"] == JOB and rec["silent_ranks"] == []
    assert rec["not_requeued"] == "scontrol requeue failed: Requested operation is presently disabled for job 4242"
    assert hang_requeue.ended_record(hang, JOB) is None  # not ended for the limit: a resubmission resumes

    # a second task of the same attempt finds the decision taken and does nothing
    hang_requeue.after_hang(hang, JOB, world_size=2, max_requeues=3, grace_s=0)
    assert len(hang_requeue.records(hang)) == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize("job_line", ["", "JobId=4242 Partition=debug NumNodes=1 ExcNodeList=n7"])
def test_a_requeue_taken_by_slurm_is_recorded_as_requeued(tmp_path, monkeypatch, capsys, job_line):
    """The same path when ``scontrol requeue`` succeeds; with ``scontrol show job`` answering nothing (a job
    SLURM no longer lists), and with a job that already excludes a node."""
    _stand_in(tmp_path, monkeypatch, f"""case "$1 $2" in
  "show job") echo "{job_line}";;
  "show hostnames") echo "$3" | tr , '\\n';;
  requeue*) exit 0;;
  *) exit 2;;
esac
""")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    hang = _hang_dir(tmp_path)
    hang_requeue.after_hang(hang, JOB, world_size=2, max_requeues=3, grace_s=0)
    [rec] = hang_requeue.records(hang)
    assert rec["requeued"] is True and "not_requeued" not in rec and rec["attempt"] == 1
    assert rec["excluded"] == (["n7"] if job_line else [])
    assert "hang: requeueing job 4242 (1 of slurm.max_hang_requeues 3)" in capsys.readouterr().err
