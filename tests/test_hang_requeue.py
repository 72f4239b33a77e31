"""A hang's requeue when ``scontrol`` fails it (``launcher/hang_requeue.py``).

The local SLURM cluster's tests (tests/test_slurm.py, tests/test_multinode.py) cover the requeues that SLURM
takes. These cover the two failures it does not produce on demand: an ``scontrol`` that does not answer, and a
requeue that SLURM refuses. A stand-in ``scontrol`` first on PATH plays them; nothing else is replaced.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
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


SINFO = "#!/usr/bin/env bash\nprintf 'n1|debug*\\nn2|debug*\\nn3|debug*\\n'\n"
"""A stand-in ``sinfo -h -N -o %N|%P``: three nodes in the default partition."""


def _silent(hang: Path, rank: int, node: str) -> None:
    """Rank ``rank`` wrote its heartbeat on ``node`` and dumped no stack: it went silent."""
    (hang / f"rank{rank}.stack").unlink()
    (hang / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "node": node}))


def test_a_rank_is_silent_when_its_heartbeat_is_there_and_its_stack_is_not(tmp_path):
    hang = _hang_dir(tmp_path, world_size=4)
    _silent(hang, 1, "n2")
    (hang / "rank2.stack").unlink()
    (hang / "rank2.json").write_text('{"rank": 2, "no')  # cut short: no heartbeat to go by
    (hang / "rank3.stack").unlink()
    (hang / "rank3.json").unlink()  # never wrote one
    assert hang_requeue.silent_ranks(hang, 4) == {1: "n2"}


def test_an_exclusion_that_slurm_refuses_is_recorded_with_the_nodes_the_job_keeps(tmp_path, monkeypatch, capsys):
    """The requeue is taken but ``scontrol update ExcNodeList`` keeps failing: the record says which nodes the job
    excludes now (none) and why the suspect is not among them; the log line says it too."""
    _stand_in(tmp_path, monkeypatch, """case "$1 $2" in
  "show job") echo "JobId=4242 Partition=debug NumNodes=1 ExcNodeList=(null)";;
  "show hostnames") echo "$3" | tr , '\\n';;
  requeue*) exit 0;;
  update*) echo "Job is still running" >&2; exit 1;;
  *) exit 2;;
esac
""")
    (tmp_path / "bin" / "sinfo").write_text(SINFO)
    (tmp_path / "bin" / "sinfo").chmod(0o755)
    update = hang_requeue._update_exclusion
    monkeypatch.setattr(hang_requeue, "_update_exclusion", lambda job, nodes: update(job, nodes, timeout_s=0.3))
    hang = _hang_dir(tmp_path)
    _silent(hang, 1, "n2")
    hang_requeue.after_hang(hang, JOB, world_size=2, max_requeues=3, grace_s=0)
    [rec] = hang_requeue.records(hang)
    assert rec["requeued"] is True and rec["silent_ranks"] == [1] and rec["silent_nodes"] == ["n2"]
    assert rec["excluded"] == [] and rec["not_excluded"] == "scontrol update ExcNodeList failed: Job is still running"
    err = capsys.readouterr().err
    assert "excluded from the job now: n2" in err and "hang: scontrol update ExcNodeList failed" in err, err


def test_past_the_limit_the_job_ends_with_its_step_killed_and_exit_77(tmp_path, monkeypatch):
    """One hang requeue already made and slurm.max_hang_requeues 1: the task records the end, names the silent
    rank's node, kills the job step's tasks (``scancel --signal=KILL JOB.STEP``) and exits 77 (in a process of
    its own: it ends the process)."""
    _stand_in(tmp_path, monkeypatch, "exit 2\n")
    (tmp_path / "bin" / "scancel").write_text(f"#!/usr/bin/env bash\necho \"$@\" > {tmp_path / 'scancel.args'}\n")
    (tmp_path / "bin" / "scancel").chmod(0o755)
    hang = _hang_dir(tmp_path)
    _silent(hang, 0, "n3")
    (hang / hang_requeue.REQUEUES).write_text(json.dumps([{"job_id": JOB, "attempt": 0, "requeued": True}]))
    env = {**os.environ, "SLURM_RESTART_COUNT": "1", "SLURM_STEP_ID": "0"}
    r = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from launcher.hang_requeue import after_hang; "
                        f"after_hang(Path({str(hang)!r}), {JOB!r}, 2, 1, grace_s=0)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == hang_requeue.EXIT_HANG_LIMIT, r.stderr
    assert (f"hang: job {JOB} hung again after 1 hang requeue(s) (slurm.max_hang_requeues: 1): not requeued, the "
            "job ends. Nodes of the ranks that went silent: n3.") in r.stderr
    assert (tmp_path / "scancel.args").read_text().split() == ["--signal=KILL", f"{JOB}.0"]
    ended = hang_requeue.ended_record(hang, JOB)
    assert ended is not None and ended["attempt"] == 1 and ended["silent_nodes"] == ["n3"]


def test_a_hang_directory_that_cannot_be_written_still_gets_its_requeue(tmp_path, monkeypatch, capsys):
    """A full or vanished disk: the marker that makes one task act cannot be made, nor the record written; the
    task acts anyway (the requeue is what matters) and says that the decision went unrecorded."""
    _stand_in(tmp_path, monkeypatch, f"""case "$1 $2" in
  requeue*) echo "$2" > {tmp_path / 'requeued'};;
  *) exit 0;;
esac
""")
    hang = tmp_path / "gone" / "hang"  # no such directory
    hang_requeue.after_hang(hang, JOB, world_size=2, max_requeues=3, grace_s=0)
    assert (tmp_path / "requeued").read_text().strip() == JOB
    assert f"hang: could not record the decision in {hang / hang_requeue.REQUEUES}" in capsys.readouterr().err
