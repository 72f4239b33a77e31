"""Multi-node launch on a real two-node SLURM cluster on localhost.

``slurm/local_cluster/start.sh --nodes 2`` runs two node daemons, n1 and n2, on 127.0.0.1 (one Port
each), so ``--nodes 2`` really spans two SLURM nodes: the rendezvous is the first node of the allocation,
ranks come from SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID. The module switches a one-node cluster to two
nodes for its tests and back afterwards (about 5 s each way).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from types import SimpleNamespace

import pytest

from launcher.hang_requeue import EXIT_HANG_LIMIT
from test_launcher import (BIN, DEBUG, ROOT, TOL, assert_trace_equal, data_overrides, job_env, job_id_of,
                           reference_run, submit_cmd, trace)
from test_slurm import (PROBLEM, sacct_attempts, saved_step, start_waiting_submit, stop_submit, wait_attempts,
                        wait_stepping, wait_until)

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))]

START = ROOT / "slurm" / "local_cluster" / "start.sh"


def node_names() -> set[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30).stdout
    return set(out.split())


@pytest.fixture(scope="module")
def two_nodes():
    """The two-node cluster: used as is when up, else switched to (as root) and switched back after."""
    if {"n1", "n2"} <= node_names():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("needs the two-node cluster: slurm/local_cluster/start.sh --nodes 2 (as root)")
    subprocess.run(["bash", str(START), "--nodes", "2"], check=True, capture_output=True, timeout=900)
    try:
        yield
    finally:
        subprocess.run(["bash", str(START), "--nodes", "1"], check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="module")
def reference(small_shards, tmp_path_factory):
    return reference_run(tmp_path_factory, small_shards)


@pytest.fixture(scope="module")
def two_node_run(two_nodes, small_shards, tmp_path_factory):
    """``roformer-submit --nodes 2 --tasks-per-node 1 --wait``, stopping at step 12; USR2 mid-run."""
    root = tmp_path_factory.mktemp("two_nodes")
    run_dir = root / "run"
    proc, job = start_waiting_submit(
        submit_cmd(small_shards, run_dir, "--profile", "local", "--nodes", "2", "--tasks-per-node", "1",
                   "trainer.stop_at_step=12", "--wait"),
        job_env(ROFORMER_STEP_DELAY_S="0.5"), root / "submit.out")
    try:
        wait_stepping(job, run_dir, past=1)
        subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True, timeout=30)
        wait_attempts(job, 2)
        first_save = saved_step(run_dir)
        rc = proc.wait(timeout=600)
    finally:
        stop_submit(proc, job)
    return SimpleNamespace(run_dir=run_dir, job=job, rc=rc, out=(root / "submit.out").read_text(),
                           first_save=first_save)


def test_two_node_job_survives_usr2_with_the_two_rank_local_trace(two_node_run, reference):
    r = two_node_run
    assert r.rc == 0 and "final state: COMPLETED (requeues: 1)" in r.out, r.out
    attempts = sacct_attempts(r.job)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    assert all(a["nodes"] == "n[1-2]" for a in attempts), f"both attempts must span n1 and n2: {attempts}"
    assert 1 <= r.first_save < 12
    assert_trace_equal(r.run_dir, reference, steps=12)

    logs = r.run_dir / "logs"
    starts = {rank: (logs / f"{r.job}_{rank}_log.err").read_text() for rank in (0, 1)}
    for rank, text in starts.items():
        lines = re.findall(rf"rank {rank}/2 \(node (\d)/2, local rank 0\), master (\S+):\d+, restart (\d)", text)
        assert {(n, m, a) for n, m, a in lines} == {(str(rank), "n1", "0"), (str(rank), "n1", "1")}, text[-2000:]
    assert (logs / "rank0.log").exists() and (logs / "rank1.log").exists(), "every rank writes its own log"
    ckpt = r.run_dir / "checkpoints" / (r.run_dir / "checkpoints" / "latest").read_text().strip()
    assert {p.name for p in ckpt.glob("trainer_state_rank*.pt")} == {"trainer_state_rank0.pt",
                                                                     "trainer_state_rank1.pt"}
    assert (ckpt / "COMPLETE").exists()


def test_two_node_checkpoint_resumes_on_one_node_with_one_task(two_node_run, small_shards, reference):
    """The elastic path: the 2-rank checkpoint of step 12 continues as a 1-rank job to the end."""
    run_dir = two_node_run.run_dir
    p = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "--nodes", "1",
                                  "--tasks-per-node", "1", "--wait"),
                       env=job_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and "final state: COMPLETED" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert "world size changed 2 -> 1" in log0, log0[-3000:]
    got, ref = trace(run_dir), trace(reference)  # trace(): continuous steps, no duplicates
    assert len(got) == 18
    assert max(abs(a - b) for a, b in zip(got[:12], ref[:12])) <= TOL, "the 2-node part is the 2-rank trace"
    attempts = sacct_attempts(job_id_of(p.stdout))
    assert [a["state"] for a in attempts] == ["COMPLETED"] and attempts[0]["nodes"] in ("n1", "n2")


def test_pretrain_sbatch_two_nodes_usr2_requeue_and_resume(two_nodes, small_shards, reference, tmp_path):
    """The no-submitit path: slurm/pretrain.sbatch on 2 nodes x 1 task; USR2 -> the ranks exit 75 -> the
    script requeues the job -> it resumes and stops at step 8 with the 2-rank local trace."""
    run_dir = tmp_path / "run"
    batch_out = tmp_path / "batch.out"
    p = subprocess.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=30",
                        "-o", str(batch_out), str(ROOT / "slurm" / "pretrain.sbatch"), str(DEBUG),
                        *data_overrides(small_shards, run_dir), "trainer.stop_at_step=8"],
                       env=job_env(ROFORMER_STEP_DELAY_S="0.5"), capture_output=True, text=True, check=True, timeout=60)
    job = p.stdout.strip().split(";")[0]
    try:
        wait_stepping(job, run_dir, past=1)
        subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True, timeout=30)
        wait_attempts(job, 2)
        wait_until(lambda: sacct_attempts(job)[-1]["state"] not in ("PENDING", "RUNNING", "REQUEUED"), 600,
                   "the requeued job to finish")
    finally:
        subprocess.run(["scancel", job], timeout=30)
    attempts = sacct_attempts(job)
    out = batch_out.read_text()
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], f"{attempts}\n{out}"
    assert "2 node(s) [n[1-2]], 2 rank(s), rendezvous n1:" in out and "requeueing" in out, out
    assert_trace_equal(run_dir, reference, steps=8)
    assert {f"sbatch-{job}-rank{r}.out" for r in (0, 1)} <= {x.name for x in (run_dir / "logs").iterdir()}


# ------------------------------------------------------------------------- a sick node: excluded, restarts bounded

def _hang_rank1(small_shards, run_dir, out, *overrides, hang_s=12):
    """A one-node, two-task job on the two-node cluster whose rank 1 is SIGSTOPped once it trained past a
    checkpoint (a frozen process: it dumps no stack); returns (roformer-submit's process, job id, node of the
    stop)."""
    proc, job = start_waiting_submit(
        submit_cmd(small_shards, run_dir, "--profile", "local", "--nodes", "1", "--tasks-per-node", "2",
                   f"dist.hang_timeout_s={hang_s}", *overrides, "--wait"),
        job_env(ROFORMER_STEP_DELAY_S="0.5"), out)
    try:
        wait_until(lambda: saved_step(run_dir) > 0, 300, f"job {job} to save a checkpoint")
        beat = json.loads((run_dir / "hang" / "rank1.json").read_bytes())
        os.kill(beat["pid"], signal.SIGSTOP)
    except BaseException:
        stop_submit(proc, job)
        raise
    return proc, job, beat["node"]


def test_a_hang_requeues_the_job_off_the_silent_ranks_node_and_it_resumes_on_the_other(
        two_nodes, small_shards, reference, tmp_path):
    run_dir = tmp_path / "run"
    proc, job, node = _hang_rank1(small_shards, run_dir, tmp_path / "submit.out")
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    assert rc == 0 and "final state: COMPLETED (requeues: 1)" in out, out
    other = ({"n1", "n2"} - {node}).pop()
    assert [(a["state"], a["nodes"]) for a in sacct_attempts(job)] == [("REQUEUED", node), ("COMPLETED", other)]
    (rec,) = json.loads((run_dir / "hang" / "requeues.json").read_text())
    assert rec["job_id"] == job and rec["silent_ranks"] == [1] and rec["silent_nodes"] == [node], rec
    assert rec["excluded"] == [node] and rec["requeued"] is True and "not_excluded" not in rec, rec
    err = (run_dir / "logs" / f"{job}_0_log.err").read_text(errors="replace")
    assert (f"hang: requeueing job {job} (1 of slurm.max_hang_requeues 3); nodes of the ranks that went silent: "
            f"{node}; excluded from the job now: {node}") in err, err[-3000:]
    assert f"host {socket.gethostname()} (SLURM node {node})" in next((run_dir / "hang").glob("report*.txt")).read_text()
    assert_trace_equal(run_dir, reference)
    status = subprocess.run([str(BIN / "roformer-submit"), "status", str(run_dir)], capture_output=True, text=True,
                            timeout=60)
    print(status.stdout)  # the block of docs/guides/operating.md, "Is it running?"
    page = (ROOT / "docs" / "guides" / "operating.md").read_text()
    block = page.split("<!-- status: tests/test_multinode.py -->\n```\n")[1].split("```")[0]
    assert _shape(block, "runs/base") == _shape(status.stdout, str(run_dir)), status.stdout


def _shape(status: str, run_dir: str) -> str:
    """``roformer-submit status`` output without what changes from run to run: the run directory, the job
    id, times and which of the two nodes was which."""
    status = status.replace(run_dir, "RUN")
    status = re.sub(r"job_id: \d+", "job_id: JOB", status)
    status = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", "TIME", status)
    return re.sub(r"\bn[12]\b", "NODE", status)


def test_a_hang_past_slurm_max_hang_requeues_ends_the_job_naming_the_node(two_nodes, small_shards, tmp_path):
    run_dir = tmp_path / "run"
    proc, job, node = _hang_rank1(small_shards, run_dir, tmp_path / "submit.out", "slurm.max_hang_requeues=0")
    try:
        rc = proc.wait(timeout=300)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    line = (f"hang: job {job} hung again after 0 hang requeue(s) (slurm.max_hang_requeues: 0): not requeued, the "
            f"job ends. Nodes of the ranks that went silent: {node}.")
    assert rc == EXIT_HANG_LIMIT and f"roformer-submit: {line}" in out and "requeues: 0" in out, out
    assert [a["state"] for a in sacct_attempts(job)] == ["FAILED"]
    (rec,) = json.loads((run_dir / "hang" / "requeues.json").read_text())
    assert rec["ended"] is True and rec["silent_nodes"] == [node] and "requeued" not in rec, rec


def test_an_exclude_list_that_leaves_no_node_is_refused_before_submitting(two_nodes, small_shards, tmp_path):
    p = subprocess.run(submit_cmd(small_shards, tmp_path / "run", "--profile", "local", "slurm.exclude=[n1,n2]"),
                       env=job_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "job_id" not in p.stdout, p.stdout + p.stderr
    assert ("slurm.exclude: leaves partition debug 0 of its 2 node(s) (n1, n2) for a job of 1: it would never "
            "start") in p.stderr, p.stderr
    p = subprocess.run(submit_cmd(small_shards, tmp_path / "run", "--profile", "local", "slurm.exclude=[n1]",
                                  "--dry-run"), env=job_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "#SBATCH --exclude=n1" in p.stdout, p.stdout + p.stderr
