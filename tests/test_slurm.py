"""roformer-submit against the real localhost SLURM cluster (``slurm/local_cluster/start.sh``; `make test`
starts it when run as root). Nothing is mocked: sbatch, srun, the time-limit signal, preemption by the
`high` partition, `scontrol requeue`, sacct, and the real trainer on 2 gloo ranks.

The runs use the debug config with one step delay (``ROFORMER_STEP_DELAY_S``) so that signals land
mid-run; every interrupted job must end with the loss trace of one uninterrupted local run (fp32, 1e-6).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from test_launcher import BIN, assert_trace_equal, job_env, job_id_of, reference_run, submit_cmd



def cluster_problem() -> str | None:
    """Why the SLURM tests cannot run here, or None."""
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (no sinfo); start the local cluster: slurm/local_cluster/start.sh (as root)"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if p.returncode != 0:
        return f"the SLURM controller does not answer ({p.stderr.strip()[:200]}); run slurm/local_cluster/start.sh"
    if not re.search(r"idle|mixed|allocated", p.stdout):
        return f"no SLURM node is up (sinfo: {p.stdout.split()})"
    if subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, timeout=30).returncode != 0:
        return "SLURM accounting (sacct / slurmdbd) is not available; slurm/local_cluster/start.sh sets it up"
    return None


PROBLEM = cluster_problem()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))]


# --------------------------------------------------------------------------- helpers (also used by test_multinode)


def wait_until(cond, timeout: float, what: str, poll: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def sacct_attempts(job_id: str) -> list[dict]:
    """One record per attempt of the job, oldest first (``sacct -D``)."""
    out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,ElapsedRaw,NodeList"],
                         capture_output=True, text=True, timeout=30).stdout
    recs = [dict(zip(("id", "state", "elapsed", "nodes"), x.split("|"))) for x in out.splitlines() if x.strip()]
    for r in recs:
        r["state"] = r["state"].split()[0]
    return [r for r in recs if r["id"] == job_id]


def squeue_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def last_step(run_dir: Path) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    step = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line)["step"]
            except ValueError:  # a line being written
                pass
    return step


def saved_step(run_dir: Path) -> int:
    latest = Path(run_dir) / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("_")[-1]) if latest.exists() else 0


def wait_stepping(job_id: str, run_dir: Path, past: int, timeout: float = 300) -> None:
    """Until this attempt of the job runs and has trained beyond step ``past``."""
    wait_until(lambda: squeue_state(job_id) == "RUNNING" and last_step(run_dir) > past, timeout,
               f"job {job_id} to train past step {past}")


def wait_attempts(job_id: str, n: int, timeout: float = 180) -> None:
    wait_until(lambda: len(sacct_attempts(job_id)) >= n, timeout, f"job {job_id} to be requeued ({n} attempts)")


def stop_submit(proc: subprocess.Popen, job: str) -> None:
    """A failed test's clean-up: ``roformer-submit --wait`` killed and its job cancelled, if still running."""
    if proc.poll() is None:
        proc.kill()
        subprocess.run(["scancel", job], timeout=30)


def start_waiting_submit(cmd: list[str], env: dict, out: Path) -> tuple[subprocess.Popen, str]:
    """Run ``roformer-submit ... --wait`` in the background; returns the process and the job id it printed."""
    f = open(out, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    f.close()

    def job_id():
        if proc.poll() not in (None, 0):
            raise AssertionError(f"roformer-submit failed:\n{out.read_text()}")
        m = re.search(r"^job_id: (\d+)$", out.read_text(), re.M)
        return m.group(1) if m else None

    return proc, wait_until(job_id, 120, "the job_id line")


def submit_status(run_dir: Path) -> str:
    p = subprocess.run([str(BIN / "roformer-submit"), "status", str(run_dir)], capture_output=True, text=True,
                       env=job_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def preempt(job_id: str) -> str:
    """Submit a job to the `high` partition that needs the whole node of ``job_id``: SLURM preempts it
    (PreemptMode=REQUEUE, preempt_send_user_signal: USR2 now, kill and requeue after GraceTime)."""
    node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    assert node, f"job {job_id} runs on no node"
    out = subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", node, "-N", "1", "--exclusive",
                          "-o", "/dev/null", "--wrap", "sleep 1"], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    return out.strip().split(";")[0]


@pytest.fixture(scope="module")
def reference(small_shards, tmp_path_factory):
    return reference_run(tmp_path_factory, small_shards)


# --------------------------------------------------------------------------- tests


def test_bad_config_submits_nothing_to_slurm(small_shards, tmp_path):
    name = f"bad-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / name
    p = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "deepspeed.zero_stage=7"),
                       env=job_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "deepspeed.zero_stage" in p.stderr, p.stdout + p.stderr
    assert "job_id" not in p.stdout and not run_dir.exists()
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "--name", f"roformer-{name}", "-S", "now-1hour"],
                           capture_output=True, text=True, timeout=30).stdout
    assert sacct.strip() == "", "a bad config must not reach SLURM"


def test_usr2_preemption_and_three_requeues_end_with_the_uninterrupted_trace(small_shards, reference, tmp_path):
    """A 1-node, 2-task debug job, followed by ``--wait``. Attempt 1 gets ``scancel --signal=USR2 --full``
    (what SLURM does before a time limit), attempt 2 is preempted by a job in the `high` partition,
    attempt 3 gets USR2 again; each time the ranks save, the job is requeued (same id) and resumes. The
    4th attempt completes with the loss trace of the uninterrupted local run; `--wait` returns COMPLETED
    and `status` reports the 3 requeues."""
    run_dir = tmp_path / "run"
    proc, job = start_waiting_submit(submit_cmd(small_shards, run_dir, "--profile", "local", "--wait"),
                                     job_env(ROFORMER_STEP_DELAY_S="0.5"), tmp_path / "submit.out")
    preemptor = None
    try:
        saved = 0
        for n, how in enumerate(("usr2", "preempt", "usr2"), start=1):
            wait_stepping(job, run_dir, past=saved)
            if how == "usr2":
                subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True, timeout=30)
            else:
                preemptor = preempt(job)
            wait_attempts(job, n + 1)
            assert saved_step(run_dir) > saved, f"interruption {n} ({how}) saved no new checkpoint"
            saved = saved_step(run_dir)
        rc = proc.wait(timeout=600)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    assert rc == 0, out
    assert "final state: COMPLETED (requeues: 3)" in out, out

    attempts = sacct_attempts(job)
    assert [a["state"] for a in attempts][-1] == "COMPLETED" and len(attempts) == 4, attempts
    assert all(a["state"] in ("REQUEUED", "PREEMPTED") for a in attempts[:3]), attempts
    assert sacct_attempts(preemptor)[-1]["state"] == "COMPLETED", "the high-priority job must have run"
    status = submit_status(run_dir)
    assert "requeues: 3" in status and "state: COMPLETED" in status and "progress: step 18/18" in status, status

    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert log0.count("stop requested") == 3 and log0.count("resuming from") == 3, log0[-3000:]
    assert_trace_equal(run_dir, reference)


def test_an_outside_scontrol_requeue_saves_and_resumes_without_a_traceback(small_shards, reference, tmp_path):
    """``scontrol requeue`` of a running job (an operator, or a preemption with PreemptMode=REQUEUE): SLURM
    signals the tasks, the ranks save, and rank 0's own requeue is refused (the job is being requeued
    already). That refusal is expected, not a crash (found by bench/chaos.py --slurm requeue): the next
    attempt resumes and ends with the uninterrupted trace."""
    run_dir = tmp_path / "run"
    proc, job = start_waiting_submit(submit_cmd(small_shards, run_dir, "--profile", "local", "--wait"),
                                     job_env(ROFORMER_STEP_DELAY_S="0.5"), tmp_path / "submit.out")
    try:
        wait_stepping(job, run_dir, past=2)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        rc = proc.wait(timeout=600)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    assert rc == 0 and "final state: COMPLETED (requeues: 1)" in out, out
    errs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*_log.err")}
    assert not [name for name, text in errs.items() if "Traceback" in text], errs
    assert any("is being requeued by SLURM already" in text for text in errs.values()), errs
    assert_trace_equal(run_dir, reference)


def test_a_hung_rank_ends_the_attempt_within_the_hang_timeout_and_the_requeued_job_completes(
        small_shards, reference, tmp_path):
    """Rank 1 of a running job is SIGSTOPped (a frozen process: no socket error, nothing a collective notices
    for dist.timeout_s). Rank 0's hang watchdog ends the attempt within ``dist.hang_timeout_s`` (exit 76) and
    requeues the job (``launcher/hang_requeue.after_hang``: on one node, nothing excluded); SLURM kills the stopped task with the step. The next attempt
    (same job id) resumes from the newest checkpoint and ends with the uninterrupted trace: the job
    COMPLETES, never FAILED, and nothing is lost beyond the steps since that checkpoint."""
    hang_s = 12
    run_dir = tmp_path / "run"
    proc, job = start_waiting_submit(
        submit_cmd(small_shards, run_dir, "--profile", "local", f"dist.hang_timeout_s={hang_s}", "--wait"),
        job_env(ROFORMER_STEP_DELAY_S="0.5"), tmp_path / "submit.out")
    try:
        # a checkpoint to resume from, and steps beyond it that the hang loses
        wait_until(lambda: squeue_state(job) == "RUNNING" and saved_step(run_dir) > 0
                   and last_step(run_dir) > saved_step(run_dir), 300, f"job {job} to train past a checkpoint")
        stopped = json.loads((run_dir / "hang" / "rank1.json").read_bytes())["pid"]
        t0 = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)
        wait_until(lambda: next((run_dir / "hang").glob("report*.txt"), None), hang_s + 30, "the hang report")
        detected = time.monotonic() - t0
        saved = saved_step(run_dir)  # the newest checkpoint when the attempt ended
        wait_attempts(job, 2, timeout=hang_s + 60)
        requeued = time.monotonic() - t0
        # SLURM ended the stopped task with the requeued attempt (a stopped process still dies of SIGKILL)
        wait_until(lambda: not Path(f"/proc/{stopped}").exists(), 60, f"the stopped rank (pid {stopped}) to end")
        rc = proc.wait(timeout=600)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    assert detected < hang_s + 15, f"the hang was reported {detected:.0f} s after the stop"
    assert requeued < hang_s + 45, f"the job was requeued {requeued:.0f} s after the stop"
    assert rc == 0 and "final state: COMPLETED (requeues: 1)" in out, out
    attempts = sacct_attempts(job)
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"], attempts
    print(f"hang reported {detected:.1f} s and the job requeued {requeued:.1f} s after the stop")
    err0 = (run_dir / "logs" / f"{job}_0_log.err").read_text(errors="replace")
    assert "DUE TO JOB REQUEUE" in err0 and "task 0: Exited with exit code 76" in err0, err0[-3000:]  # EXIT_HANG
    err1 = (run_dir / "logs" / f"{job}_1_log.err").read_text(errors="replace")  # woken by SLURM's kill, peer gone
    assert "Traceback" not in err1 and "triggered an exception" not in err1, err1[-3000:]

    text = "".join(p.read_text() for p in (run_dir / "hang").glob("report*.txt"))  # set aside by attempt 2
    assert f"hang: no progress for {hang_s} s (dist.hang_timeout_s)" in text, text
    assert "no stack dumped (the process is stopped" in text.split("rank 1:")[1].splitlines()[0], text
    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert f"no progress for {hang_s} s" in log0 and log0.count("resuming from") == 1, log0[-3000:]
    assert f"(step {saved}," in log0.split("resuming from")[1].splitlines()[0], log0[-3000:]
    assert_trace_equal(run_dir, reference)


def test_time_limit_signal_requeues_and_the_job_completes(small_shards, reference, tmp_path):
    """A 2-minute limit, a run longer than that (18 steps of >= 7 s, so even a quiet machine cannot finish
    before the signal), USR2 30 s before the limit (SLURM may send it up to ~30 s earlier still): the job saves,
    is requeued before the limit (no TIMEOUT), and completes exactly. The requeued attempt steps at full speed
    (``ROFORMER_STEP_DELAY_ATTEMPTS``)."""
    run_dir = tmp_path / "run"
    p = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "--time", "2",
                                  "slurm.signal_delay_s=30", "--wait"),
                       env=job_env(ROFORMER_STEP_DELAY_S="7", ROFORMER_STEP_DELAY_ATTEMPTS="1"),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = job_id_of(p.stdout)
    attempts = sacct_attempts(job)
    states = [a["state"] for a in attempts]
    assert len(states) >= 2 and states[-1] == "COMPLETED", attempts
    assert set(states[:-1]) == {"REQUEUED"}, f"requeued by the signal, never killed by the limit: {attempts}"
    assert all(int(a["elapsed"]) < 120 for a in attempts), attempts
    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert "stop requested (signal SIGUSR2)" in log0, log0[-3000:]
    assert_trace_equal(run_dir, reference)
    logs = subprocess.run([str(BIN / "roformer-submit"), "logs", str(run_dir), "-n", "20"], capture_output=True,
                          text=True, env=job_env(), timeout=60)
    assert logs.returncode == 0 and "rank0.log <==" in logs.stdout and "done: 18 steps" in logs.stdout, logs.stdout


def test_cancel_ends_the_job_and_wait_returns_its_final_state(small_shards, tmp_path):
    run_dir = tmp_path / "run"
    proc, job = start_waiting_submit(submit_cmd(small_shards, run_dir, "--profile", "local", "--wait"),
                                     job_env(ROFORMER_STEP_DELAY_S="2"), tmp_path / "submit.out")
    try:
        wait_until(lambda: squeue_state(job) == "RUNNING", 120, "the job to run")
        status = submit_status(run_dir)
        assert f"job_id: {job} (slurm)" in status and "state: RUNNING" in status and "requeues: 0" in status
        p = subprocess.run([str(BIN / "roformer-submit"), "cancel", str(run_dir)], capture_output=True, text=True,
                           env=job_env(), timeout=60)
        assert p.returncode == 0 and f"cancelled job {job}" in p.stdout, p.stderr
        rc = proc.wait(timeout=120)
    finally:
        stop_submit(proc, job)
    out = (tmp_path / "submit.out").read_text()
    assert rc == 1 and "final state: CANCELLED" in out, out
    wait_until(lambda: squeue_state(job) in ("", "CANCELLED"), 60, "the job to leave the queue")
    assert sacct_attempts(job)[-1]["state"] == "CANCELLED"
    assert "state: CANCELLED" in submit_status(run_dir)


def test_local_cluster_counts_the_machines_cpus_whatever_omp_num_threads_says():
    """Cluster environments often export OMP_NUM_THREADS=1; `nproc` honours it, and a node configured with
    CPUs=1 leaves every 2-task job pending forever (PartitionConfig)."""
    if os.geteuid() != 0:
        pytest.skip("start.sh needs root")
    start = Path(__file__).resolve().parent.parent / "slurm" / "local_cluster" / "start.sh"
    nodes = sorted(set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                                      timeout=30).stdout.split()))
    num_nodes = "2" if {"n1", "n2"} <= set(nodes) else "1"
    p = subprocess.run(["bash", str(start), "--nodes", num_nodes], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "restarting" not in p.stdout, f"the config changed under OMP_NUM_THREADS=1:\n{p.stdout}"
    cpus = len(os.sched_getaffinity(0))
    for node in nodes:
        info = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30).stdout
        assert f"CPUTot={cpus} " in info, info


def test_wait_reports_a_job_that_can_never_start_with_slurms_reason(small_shards, tmp_path):
    """The `short` partition allows 2 minutes; a 5-minute job pends forever (PartitionTimeLimit)."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    p = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "--partition", "short", "--time", "5",
                                  "--wait"), env=job_env(), capture_output=True, text=True, timeout=300)
    job = job_id_of(p.stdout)
    try:
        assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
        assert f"job {job} cannot start" in p.stderr and "PartitionTimeLimit" in p.stderr, p.stderr
        assert f"roformer-submit cancel {run_dir}" in p.stderr, p.stderr
        assert time.monotonic() - t0 < 120, "reported promptly, not after waiting"
        assert squeue_state(job) == "PENDING"
        status = submit_status(run_dir)
        assert "state: PENDING (reason: PartitionTimeLimit)" in status and "cannot start as submitted" in status, status
        # the run directory has a queued job: a second submission is refused and changes nothing
        config = (run_dir / "config.yaml").read_bytes()
        again = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "trainer.seed=7"),
                               env=job_env(), capture_output=True, text=True, timeout=120)
        assert again.returncode == 6, again.stdout[-2000:] + again.stderr[-2000:]
        assert f"already has SLURM job {job} (PENDING)" in again.stderr, again.stderr
        assert (run_dir / "config.yaml").read_bytes() == config
    finally:
        subprocess.run(["scancel", job], timeout=30)
