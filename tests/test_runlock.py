"""The run-directory lock with real processes: a holder that runs, one that was killed (stale), a
requeued SLURM job taking its own lock back, and the record-only mode of filesystems without locks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from roformer_dist.errors import RunLockedError
from roformer_dist.runtime.runlock import HOLDER_FILE, LOCK_FILE, Holder, RunLock, decide, holder_alive

HOLD = textwrap.dedent("""
    import sys, time
    from roformer_dist.runtime.runlock import RunLock
    lock = RunLock(sys.argv[1], use_flock=sys.argv[2] == "flock").acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def start_holder(run_dir, mode="flock", env=None):
    """A separate process that takes the lock of ``run_dir`` and keeps it; returns once it holds it."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), mode, "--resume"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    line = p.stdout.readline()
    assert line.strip() == "held", p.stderr.read()
    return p


@pytest.fixture
def holder_proc():
    procs = []

    def start(*a, **kw):
        procs.append(start_holder(*a, **kw))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_second_launch_is_refused_naming_the_holder(tmp_path, holder_proc):
    p = holder_proc(tmp_path)
    with pytest.raises(RunLockedError) as info:
        RunLock(tmp_path).acquire()
    msg = str(info.value)
    assert f"{tmp_path} is in use by another run" in msg
    assert f"pid {p.pid} on host {socket.gethostname()}" in msg and "since 20" in msg
    assert "-c" in msg and "--resume" in msg  # the holder's command line
    record = json.loads((tmp_path / HOLDER_FILE).read_text())
    assert record["pid"] == p.pid  # the refused launch changed nothing


def test_killed_holder_leaves_a_stale_lock_that_is_taken_over(tmp_path, holder_proc, capsys):
    p = holder_proc(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (tmp_path / HOLDER_FILE).exists()  # SIGKILL: no clean-up ran
    with RunLock(tmp_path) as lock:
        assert lock.holder.pid == os.getpid()
        assert json.loads((tmp_path / HOLDER_FILE).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"taking over a stale run lock of pid {p.pid}" in err and "not running" in err
    assert not (tmp_path / HOLDER_FILE).exists() and (tmp_path / LOCK_FILE).exists()  # released


def test_requeued_slurm_job_takes_its_own_lock_back(tmp_path, holder_proc, monkeypatch, capsys):
    # the previous attempt of job 4242 still holds the file lock (a node whose lease has not expired)
    holder_proc(tmp_path, env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = RunLock(tmp_path, requeue_grace_s=0.5).acquire()
    try:
        assert "taking back the run lock of SLURM job 4242 from its attempt 0" in capsys.readouterr().err
        record = json.loads((tmp_path / HOLDER_FILE).read_text())
        assert (record["slurm_job_id"], record["slurm_attempt"], record["pid"]) == ("4242", 1, os.getpid())
    finally:
        lock.release()
    # the same attempt twice (a second launch inside the job) is refused
    holder_proc(tmp_path / "b", env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    with pytest.raises(RunLockedError, match="SLURM job 4242 attempt 1"):
        RunLock(tmp_path / "b").acquire()


def test_record_only_mode_without_file_locks(tmp_path, holder_proc, capsys):
    p = holder_proc(tmp_path, mode="record")
    with pytest.raises(RunLockedError, match=f"pid {p.pid}"):
        RunLock(tmp_path, use_flock=False).acquire()
    p.kill()
    p.wait()
    with RunLock(tmp_path, use_flock=False):
        assert "taking over a stale run lock" in capsys.readouterr().err


def test_another_hosts_record_cannot_be_proven_stale_without_slurm(tmp_path):
    them = Holder(host="node-that-is-not-here", pid=12345, since="2024-01-01T00:00:00+0000",
                  command="roformer-train --config x.yaml")
    (tmp_path / HOLDER_FILE).write_text(json.dumps(them.__dict__))
    with pytest.raises(RunLockedError) as info:
        RunLock(tmp_path, use_flock=False).acquire()
    assert "node-that-is-not-here" in str(info.value) and f"delete {tmp_path / HOLDER_FILE}" in str(info.value)


def test_decisions_for_every_case(tmp_path):
    me = Holder.of_this_process()
    rec = tmp_path / HOLDER_FILE
    other = Holder("h", 1, "t", "cmd")
    assert decide(lock_free=True, holder=None, me=me, alive=None, record_path=rec).take
    assert not decide(lock_free=False, holder=None, me=me, alive=None, record_path=rec).take
    assert not decide(lock_free=False, holder=other, me=me, alive=True, record_path=rec).take
    assert decide(lock_free=True, holder=other, me=me, alive=False, record_path=rec).take
    assert not decide(lock_free=True, holder=other, me=me, alive=True, record_path=rec).take
    assert not decide(lock_free=True, holder=other, me=me, alive=None, record_path=rec).take
    job = Holder("h", 1, "t", "cmd", slurm_job_id="7", slurm_attempt=0)
    me7 = Holder("h2", 2, "t", "cmd", slurm_job_id="7", slurm_attempt=1)
    d = decide(lock_free=False, holder=job, me=me7, alive=True, record_path=rec)
    assert d.take and d.wait_for_lock


def test_a_reused_pid_is_not_a_live_holder():
    me = Holder.of_this_process()
    assert holder_alive(me) is True
    assert holder_alive(Holder(me.host, me.pid, me.since, me.command, pid_start=(me.pid_start or 0) + 1)) is False
    assert holder_alive(Holder(me.host, 2**22 + 17, me.since, me.command)) is False


@pytest.mark.slurm
def test_holder_of_a_finished_slurm_job_is_stale(tmp_path):
    if subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        pytest.skip("the local SLURM cluster is not running (slurm/local_cluster/start.sh)")
    gone = Holder(host="node-that-is-not-here", pid=1, since="t", command="c", slurm_job_id="987654321")
    assert holder_alive(gone) is False
    (tmp_path / HOLDER_FILE).write_text(json.dumps(gone.__dict__))
    with RunLock(tmp_path):
        pass


def test_the_kernel_releases_the_lock_with_its_holder(tmp_path, holder_proc):
    """While a holder runs the lock stays taken, however long; it is free the moment the holder ends."""
    p = holder_proc(tmp_path)
    time.sleep(0.2)
    with pytest.raises(RunLockedError):
        RunLock(tmp_path).acquire()
    p.terminate()  # no clean-up in the holder: the kernel drops the lock with the process
    p.wait()
    RunLock(tmp_path).acquire().release()
