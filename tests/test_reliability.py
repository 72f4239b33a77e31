"""`roformer-train` under hostile conditions, with real processes, signals, files and filesystems:

- every way of stopping a run (``timeout``, Ctrl-C, SIGTERM to the launcher, USR2 to the group) saves one
  complete checkpoint and exits 75; a second Ctrl-C aborts at once (130); a SIGKILLed launcher leaves
  no rank behind; a second launch on the same run directory is refused while the first runs, a stale
  lock is taken over; after all of it the loss trace equals the uninterrupted run's, step by step;
- damaged checkpoints are named, marked BAD and skipped; a changed model is refused before anything in
  the run directory changes; a failing eval comes after its step's save;
- a full disk, a read-only checkpoint directory, a bad ``--config`` and a corrupt shard give messages
  and their exit statuses, not tracebacks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roformer_dist.checkpoint import store as ckpt
from roformer_dist.errors import EXIT_ABORTED, EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA, EXIT_LOCKED, EXIT_STORAGE
from roformer_dist.runtime.runlock import HOLDER_FILE
from roformer_dist.runtime.stop import EXIT_DONE, EXIT_REQUEUE
from roformer_dist.testing import DistributedTestError
from trainer_runs import (SCHEDULE, assert_traces_equal, children, cli_overrides, copy_run, finish, flip_byte,
                          live_group_members, make_cfg, rank_pids, reference_run, run_cli, steps_done, train, trace,
                          wait_for_group_gone, wait_for_step)

SLOW = {"ROFORMER_STEP_DELAY_S": "1.0"}  # the signals land between steps; few steps per launch
SCHEDULED_SAVES = {4, 6, 8, 12, 16, 18}  # trainer.save_every=4 and the stage ends of the debug curriculum
NO_TRACEBACK = ("Traceback", "KeyboardInterrupt", "resource_tracker", "Logging error")


@pytest.fixture(scope="module")
def reference(small_shards, tmp_path_factory):
    return reference_run(tmp_path_factory, small_shards)


def latest_step(run_dir) -> int:
    tag = ckpt.read_latest(Path(run_dir) / "checkpoints")
    return ckpt.step_of(tag) if tag else 0


def assert_clean_output(out):
    for word in NO_TRACEBACK:
        assert word not in out, f"{word!r} in the output:\n{out[-4000:]}"


def assert_stopped_and_saved(proc, run_dir, rc, out):
    """Exit 75, no traceback, one complete checkpoint at the last recorded step, lock released, nothing left."""
    assert rc == EXIT_REQUEUE, out[-4000:]
    assert_clean_output(out)
    step = latest_step(run_dir)
    assert step == steps_done(run_dir) and step > 0, (step, steps_done(run_dir))
    assert ckpt.is_complete(Path(run_dir) / "checkpoints" / ckpt.tag_for(step))
    trace(run_dir)  # every step once, in order
    assert not (Path(run_dir) / HOLDER_FILE).exists()
    assert wait_for_group_gone(proc.pid) == []


def sig_ignored(pid) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {s for s in range(1, 64) if mask >> (s - 1) & 1}
    return set()


@pytest.mark.slow
def test_every_stop_saves_and_the_run_ends_as_if_uninterrupted(small_shards, tmp_path, reference):
    run = tmp_path / "run"
    # log_every=1: a step's record is written as the step ends (the losses are read at log steps only), so that
    # waiting for a step's record means the run is there
    over = cli_overrides(small_shards, run, "trainer.save_every=4", "trainer.log_every=1")

    # 1. a second launch on the same run directory is refused naming the holder (while the first starts);
    #    then SIGTERM to the first launcher alone
    a = run_cli(over, SLOW)
    deadline = time.monotonic() + 120
    while not (run / HOLDER_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    rc, out = finish(run_cli(over), timeout=120)
    assert rc == EXIT_LOCKED, out
    assert f"{run} is in use by another run: pid {a.pid} on host {socket.gethostname()}" in out
    assert "since 20" in out and f"run_dir={run}" in out and "Traceback" not in out
    assert json.loads((run / HOLDER_FILE).read_text())["pid"] == a.pid  # the refused launch changed nothing
    wait_for_step(run, 1, a)
    os.kill(a.pid, signal.SIGTERM)
    assert_stopped_and_saved(a, run, *finish(a))

    # 2. `timeout 8`: SIGTERM to the whole group (launcher, ranks, DataLoader workers), wherever the run is (a few
    #    steps in after a ~5 s start: the later stops need steps left of the 18)
    before = steps_done(run)
    t = run_cli(over, SLOW, prefix=("timeout", "--preserve-status", "-s", "TERM", "8"))
    rc, out = finish(t)
    assert_stopped_and_saved(t, run, rc, out)
    assert steps_done(run) >= before

    # 3. USR2 to the group (SLURM's time-limit warning); the DataLoader workers ignore stop signals
    c = run_cli(over, SLOW)
    wait_for_step(run, steps_done(run) + 1, c)
    workers = [w for r in rank_pids(c) for w in children(r)  # (each rank's multiprocessing resource tracker left out)
               if b"resource_tracker" not in Path(f"/proc/{w}/cmdline").read_bytes()]
    assert workers, "no DataLoader worker processes found"
    for w in workers:
        assert {signal.SIGTERM, signal.SIGINT, signal.SIGUSR2} <= sig_ignored(w)
    os.killpg(c.pid, signal.SIGUSR2)
    assert_stopped_and_saved(c, run, *finish(c))

    # 4. Ctrl-C: SIGINT to the group
    d = run_cli(over, SLOW)
    wait_for_step(run, steps_done(run) + 1, d)
    os.killpg(d.pid, signal.SIGINT)
    assert_stopped_and_saved(d, run, *finish(d))

    # 5. Ctrl-C twice: abort at once, nothing claimed
    saved = latest_step(run)
    e = run_cli(over, SLOW)
    wait_for_step(run, saved + 1, e)
    os.killpg(e.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(e.pid, signal.SIGINT)
    t0 = time.monotonic()
    rc, out = finish(e, timeout=60)
    assert rc == EXIT_ABORTED and time.monotonic() - t0 < 10, out[-3000:]
    assert "interrupted twice: aborting without saving" in out and "saved step" not in out
    assert_clean_output(out)
    assert wait_for_group_gone(e.pid) == []
    now = latest_step(run)  # only a save the schedule made before the abort
    assert now == saved or now in SCHEDULED_SAVES and saved < now <= steps_done(run)
    assert ckpt.is_complete(run / "checkpoints" / ckpt.tag_for(now))
    assert not (run / HOLDER_FILE).exists()

    # 6. SIGKILL to the launcher: its ranks die with it (no orphans); its lock record stays behind
    launched = time.time()
    f = run_cli(over, SLOW)
    wait_for_step(run, latest_step(run) + 1, f, newer_than=launched)
    ranks = rank_pids(f)
    os.kill(f.pid, signal.SIGKILL)
    finish(f, timeout=60)
    assert wait_for_group_gone(f.pid) == [], live_group_members(f.pid)
    assert not any(Path(f"/proc/{r}").exists() for r in ranks)
    assert json.loads((run / HOLDER_FILE).read_text())["pid"] == f.pid

    # 7. the next launch takes the stale lock over and finishes: the trace of the uninterrupted run
    assert steps_done(run) < 18
    rc, out = finish(run_cli(over))
    assert rc == EXIT_DONE, out[-4000:]
    assert f"taking over a stale run lock of pid {f.pid}" in out
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)
    assert trace(run, "seq_len") == SCHEDULE


def test_resume_with_another_model_is_refused_before_anything_changes(small_shards, tmp_path, reference):
    run = copy_run(reference, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc, out = finish(run_cli(cli_overrides(small_shards, run, "model.hidden_size=96", "parallel.tensor=2")), 120)
    assert rc == EXIT_CHECKPOINT, out
    assert out.count("cannot resume from") == 1  # one message with every difference
    for line in ("model.hidden_size: 64 in the checkpoint, 96 now",
                 "parameter embeddings.word_embeddings.weight: [4000, 64] in the checkpoint, [4000, 96] now",
                 "parallel: tensor 1 x pipeline 1 in the checkpoint, tensor 2 x pipeline 1 now"):
        assert line in out, out
    assert_clean_output(out)
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # config.yaml, checkpoints, metrics: untouched


def _corrupt_first_shard(shard_dir: Path, dst: Path, seed: int = 1234, total_slots: int = 1) -> str:
    """A copy of a shard set whose first shard in slot 0's epoch-0 order is truncated; returns its name."""
    from data_pipeline.loader import shard_sizes
    from data_pipeline.slots import deal

    shutil.copytree(shard_dir, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    first = deal(seed, 0, shard_sizes(manifest), total_slots)[0][0].shard
    name = manifest["shards"][first]["name"]
    path = dst / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return name


def test_damaged_checkpoints_fall_back_and_a_failing_eval_loses_nothing(small_shards, tmp_path, reference):
    """2 ranks (run_rank, no launcher) agree on the fallback; the eval of the last step fails after its save."""
    run = copy_run(reference, tmp_path / "run")
    cks = run / "checkpoints"
    state = cks / "step_00000018" / "trainer_state_rank0.pt"
    state.write_bytes(state.read_bytes()[:200])
    (cks / "step_00000016" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (cks / "latest").write_bytes(b"\x9c\xff garbage")
    bad_eval = _corrupt_first_shard(small_shards.eval_dir, tmp_path / "eval")
    cfg = make_cfg(small_shards, run, "trainer.save_every=4", f"data.eval_shards={tmp_path / 'eval'}")
    with pytest.raises(DistributedTestError) as info:
        train(cfg)
    err = str(info.value)
    assert "DataError: eval at step 18 (the checkpoint of this step is saved)" in err and bad_eval in err
    log = (run / "logs" / "rank0.log").read_text()
    assert "step_00000018 is damaged" in log and "trainer_state_rank0.pt: 200 bytes" in log
    assert "step_00000016 is damaged" in log and "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in log
    assert "not UTF-8" in log and "resuming from" in log and "step_00000012" in log
    # marked, kept and moved aside when their steps were saved again; nothing deleted
    for step in (16, 18):
        aside = cks / f"step_{step:08d}.bad"
        assert "missing" in (aside / "BAD").read_text() or "bytes" in (aside / "BAD").read_text()
    assert (cks / "step_00000018.bad" / "mp_rank_00_model_states.pt").exists()
    # the eval failed after the save of step 18: nothing lost, the trace of the uninterrupted run
    assert ckpt.read_latest(cks) == "step_00000018" and ckpt.is_complete(cks / "step_00000018")
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)


def test_a_flipped_byte_is_caught_by_verify_to_hf_and_resume_and_the_checkpoint_before_is_used(
        small_shards, tmp_path, reference, capsys):
    from roformer_dist.cli.convert import main as convert

    optim = Path("checkpoints") / "step_00000018" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    run = copy_run(reference, tmp_path / "run")
    flip_byte(run / optim)
    size = (run / optim).stat().st_size
    assert size == (reference / optim).stat().st_size

    # roformer-convert verify: reports, names the file and the fallback, changes nothing
    assert convert(["verify", str(run)]) == EXIT_CHECKPOINT
    out = capsys.readouterr()
    assert "step_00000018  DAMAGED" in out.out and "zero_pp_rank_0_mp_rank_00_optim_states.pt: its content changed" \
        in out.out and "step_00000016  ok: 5 files" in out.out and "a resume would take: step_00000016" in out.out
    assert "1 damaged checkpoint(s)" in out.err and not ckpt.is_bad(run / "checkpoints" / "step_00000018")

    # to-hf from the run directory: the checkpoint before, the damaged one marked BAD
    assert convert(["to-hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--check-docs", "0"]) == 0
    assert json.loads((tmp_path / "hf" / "roformer_export.json").read_text())["step"] == 16
    assert "its content changed" in (run / "checkpoints" / "step_00000018" / "BAD").read_text()

    # resume, on a fresh copy: from step 16, and the run ends as the uninterrupted one
    run2 = copy_run(reference, tmp_path / "run2")
    flip_byte(run2 / optim)
    assert train(make_cfg(small_shards, run2, "trainer.save_every=4")) == [EXIT_DONE, EXIT_DONE]
    log = (run2 / "logs" / "rank0.log").read_text()
    assert "step_00000018 is damaged" in log and "its content changed since it was saved" in log
    assert "resuming from" in log and "step_00000016" in log
    assert_traces_equal(trace(reference), trace(run2), tol=1e-6)


def test_corrupt_training_shard_is_a_data_error(small_shards, tmp_path):
    name = _corrupt_first_shard(small_shards.dir, tmp_path / "train")
    run = tmp_path / "run"
    rc, out = finish(run_cli(cli_overrides(small_shards, run, f"data.shards={tmp_path / 'train'}",
                                           "dist.world_size=1", "data.eval_shards=")))
    assert rc == EXIT_DATA, out[-4000:]
    assert "roformer-train: training step 1:" in out and name in out
    assert_clean_output(out)


# --------------------------------------------------------------------------- filesystems and paths


def mount_tmpfs(path: Path, size: str, read_only: bool = False):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750" + (",ro" if read_only else ""), "tmpfs",
                        str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def mounts():
    done = []
    yield done
    for path in reversed(done):
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_a_save_then_resume(small_shards, tmp_path, reference, mounts, mode):
    """The same outcome whether the save is written in the step loop or by the background writers."""
    one_checkpoint = sum(f.stat().st_size for f in (reference / "checkpoints" / "step_00000012").iterdir())
    disk = tmp_path / "disk"
    mount_tmpfs(disk, str(int(one_checkpoint * 1.6) + 2**20))  # room for one checkpoint, not for two
    mounts.append(disk)
    run = disk / "run"
    over = cli_overrides(small_shards, run, "trainer.save_every=4", f"checkpoint.async={mode == 'async'}")
    rc, out = finish(run_cli(over))
    assert rc == EXIT_STORAGE, out[-4000:]
    assert "saving checkpoint step_00000006: cannot write" in out and str(run / "checkpoints") in out
    assert "No space left on device (ENOSPC)" in out
    assert_clean_output(out)
    assert ckpt.read_latest(run / "checkpoints") == "step_00000004"
    assert not ckpt.is_complete(run / "checkpoints" / "step_00000006")
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    rc, out = finish(run_cli([*over, "trainer.stop_at_step=8"]))
    assert rc == EXIT_DONE, out[-4000:]
    assert_traces_equal(trace(reference)[:8], trace(run), tol=1e-6)


def test_read_only_checkpoints_and_bad_config_paths_are_messages(small_shards, tmp_path, mounts):
    run = tmp_path / "run"
    cks = run / "checkpoints"
    if os.geteuid() == 0:
        mount_tmpfs(cks, "64k", read_only=True)
        mounts.append(cks)
        reason = "Read-only file system (EROFS)"
    else:
        cks.mkdir(parents=True)
        cks.chmod(0o555)
        reason = "Permission denied (EACCES)"
    rc, out = finish(run_cli(cli_overrides(small_shards, run)), timeout=120)
    assert rc == EXIT_STORAGE, out
    assert f"checking that the checkpoint directory is writable: cannot write {cks}" in out and reason in out
    assert_clean_output(out)
    assert not (run / "config.yaml").exists() and not (run / HOLDER_FILE).exists()

    rc, out = finish(run_cli(cli_overrides(small_shards, run), config=tmp_path), timeout=120)
    assert rc == EXIT_CONFIG and f"--config: {tmp_path} is a directory" in out, out
    rc, out = finish(run_cli(cli_overrides(small_shards, run), config=tmp_path / "nope.yaml"), timeout=120)
    assert rc == EXIT_CONFIG and "nope.yaml: no such file" in out, out
    assert_clean_output(out)


def test_a_bug_is_a_traceback_not_bad_config(monkeypatch, small_shards, tmp_path):
    """Only our error classes become messages and statuses; any other exception propagates (exit 1)."""
    from roformer_dist.cli import train as train_cli
    from roformer_dist.launch import resolved

    def broken(cfg, resumed=None):
        raise ValueError("an internal bug")

    monkeypatch.setattr(resolved, "resolve_data", broken)  # where the launch is resolved
    with pytest.raises(ValueError, match="an internal bug"):
        train_cli.main(["--config", str(Path(__file__).parent.parent / "configs/experiments/debug.yaml"),
                        *cli_overrides(small_shards, tmp_path / "run")])


def _run_then_report_signals(rank, world_size, cfg):
    from roformer_dist.launch.entry import run_rank

    code = run_rank(cfg)
    return code, {s: signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGUSR2, signal.SIGTERM)}


def test_a_completed_run_ignores_late_stop_signals(small_shards, tmp_path):
    """A time-limit or preemption signal after the last save has nothing to save: it must not kill the
    rank while it tears down (SLURM would record the finished job as FAILED)."""
    from roformer_dist.testing import run_distributed

    cfg = make_cfg(small_shards, tmp_path / "run", "trainer.stop_at_step=1")
    (code, ignored), _ = run_distributed(_run_then_report_signals, world_size=2, args=(cfg,), timeout=300)
    assert code == EXIT_DONE and all(ignored.values()), ignored

    # what that buys, for real: USR2 sent from outside, every 0.2 ms, over the exit of a process whose run is
    # complete (without the call, one lands after Python put the default action back: killed, status 140)
    script = ("import os, subprocess, sys, time\n"
              "from roformer_dist.runtime.stop import StopFlag, ignore_late_stop_signals\n"
              "StopFlag.install()\n"
              "ignore_late_stop_signals()\n"
              "storm = 'import os, sys, time\\nwhile True:\\n    os.kill(int(sys.argv[1]), 12)\\n    time.sleep(0.0002)'\n"
              "subprocess.Popen([sys.executable, '-c', storm, str(os.getpid())],\n"
              "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              "time.sleep(0.3)\n"
              "sys.exit(0)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])


def test_a_stopped_rank_ends_the_launch_within_the_hang_timeout_with_a_report_and_the_next_launch_resumes(
        small_shards, tmp_path):
    from roformer_dist.errors import EXIT_HANG

    run = tmp_path / "run"
    watched = cli_overrides(small_shards, run, "trainer.log_every=1", "trainer.save_every=4")
    proc = run_cli([*watched, "dist.hang_timeout_s=6"], env=SLOW)
    wait_for_step(run, 5, proc)
    stopped = json.loads((run / "hang" / "rank1.json").read_bytes())["pid"]
    t0 = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)  # frozen: no socket error, nothing a collective would notice for 30 minutes
    rc, out = finish(proc, timeout=120)
    assert rc == EXIT_HANG, out[-4000:]
    assert time.monotonic() - t0 < 6 + 30
    assert_clean_output(out)
    report = (run / "hang" / "report.txt").read_text()
    assert "hang: no progress for 6 s (dist.hang_timeout_s)" in out and report in out
    # the rank that stopped comes first (furthest behind), without a stack; rank 0 dumped where it waited
    assert report.index("rank 1:") < report.index("rank 0:")
    assert "no stack dumped (the process is stopped" in report.split("rank 1:")[1].splitlines()[0]
    stack = (run / "hang" / "rank0.stack").read_text()
    assert "no progress for" in stack and "distributed" in stack and "Thread" in stack
    assert wait_for_group_gone(proc.pid) == []  # the stopped rank was ended with the launch
    # the next launch resumes from the newest checkpoint (step 4) and goes on
    rc, out = finish(run_cli([*watched, "trainer.stop_at_step=6"]))
    assert rc == EXIT_DONE and "resuming from" in out and "step 4" in out, out[-4000:]
    assert len(trace(run)) == 6  # every step once, in order
