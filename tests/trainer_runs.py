"""Helpers shared by the trainer tests: configs, runs on gloo ranks, the `roformer-train` command, loss
traces, and one uninterrupted reference run per session.

The reference is the debug experiment (2 ranks, ZeRO-2, three stages 128 -> 256 -> 512, 18 steps)
with checkpoints every 4 steps; every test that stops and resumes that configuration compares its
loss trace with it, step by step.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roformer_dist.testing import (copy_built_op, live_group_members, rank_processes,  # noqa: F401 (re-exported)
                                   run_distributed)
from roformer_dist.config import load_config
from roformer_dist.runtime.stop import children  # noqa: F401  (re-exported to the tests)

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs" / "experiments" / "debug.yaml"
# The debug curriculum (configs/curriculum/debug.yaml): s128 steps 1-6, s256 7-12, s512 13-18.
SCHEDULE = [128] * 6 + [256] * 6 + [512] * 6
REFERENCE_OVERRIDES = ("trainer.save_every=4",)


def make_cfg(shards, run_dir, *overrides, world_size=2):
    return load_config(DEBUG, [f"data.shards={shards.dir}", f"data.eval_shards={shards.eval_dir}",
                               f"run_dir={run_dir}", f"dist.world_size={world_size}", "trainer.save_every=0",
                               "trainer.eval_every=0", "data.eval_batches=2", *overrides])


def _run(rank, world_size, cfg, env):
    os.environ.update(env)
    from roformer_dist.launch.entry import run_rank

    return run_rank(cfg)


def train(cfg, env=None, timeout=300):
    """Run the trainer on cfg.dist.world_size gloo ranks in fresh processes; returns each rank's status."""
    return run_distributed(_run, world_size=cfg.dist.world_size, args=(cfg, env or {}), timeout=timeout)


def records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def trace(run_dir, key="loss"):
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "steps must be continuous, no duplicates"
    return [r[key] for r in recs]


def assert_traces_equal(a, b, tol):
    assert len(a) == len(b), f"{len(a)} steps vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol, f"step {i + 1}: {x} vs {y}"


def reference_run(tmp_path_factory, shards) -> Path:
    """The uninterrupted reference run, made once per session (a marker file says it is complete)."""
    from roformer_dist.runtime.stop import EXIT_DONE

    run_dir = tmp_path_factory.getbasetemp() / "trainer_reference"
    done = run_dir / "REFERENCE_DONE"
    if not done.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        assert train(make_cfg(shards, run_dir, *REFERENCE_OVERRIDES)) == [EXIT_DONE, EXIT_DONE]
        done.touch()
    return run_dir


def flip_byte(path: Path, at=None) -> None:
    """Flip one bit of ``path``'s byte ``at`` (default: a third into the file, in a checkpoint archive's tensor
    data, ahead of its index: the file still loads; only its content hash tells)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 3 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("REFERENCE_DONE"))
    return dst


# --------------------------------------------------------------------------- the command


def cli_overrides(shards, run_dir, *extra):
    return [f"data.shards={shards.dir}", f"data.eval_shards={shards.eval_dir}", f"run_dir={run_dir}",
            "trainer.eval_every=0", "data.eval_batches=2", "trainer.save_every=0", *extra]


def run_cli(overrides, env=None, prefix=(), config=DEBUG, **kw):
    """`roformer-train` (as ``python -m``) in its own process group and session, as a shell would start it; with
    the interpreter's fault handler on, so that :func:`finish` can have its processes print their stacks."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "roformer_dist.cli.train", "--config", str(config),
                             *overrides], env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **kw)


def finish(proc, timeout=240) -> tuple[int, str]:
    """Wait for a :func:`run_cli` launch to end: (exit status, output). One still running after ``timeout`` s gets
    SIGABRT (each process prints every thread's stack), then SIGKILL, and the test fails with that output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        time.sleep(5)
        with contextlib.suppress(ProcessLookupError):  # all gone on the SIGABRT already
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the launch ran past {timeout} s; its output and stacks:\n{out[-12000:]}")
    return proc.returncode, out


def steps_done(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_step(run_dir, step, proc, timeout=240, newer_than: float = 0.0):
    """Wait until metrics.jsonl records ``step`` (written after ``newer_than``, a time.time(): lines a
    killed run left behind do not count until the resumed run has rewritten the file). Records are written
    when the steps' losses are read, at log steps: a run watched step by step sets trainer.log_every=1."""
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if steps_done(run_dir) >= step and (not newer_than or path.stat().st_mtime > newer_than):
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def rank_pids(proc, world_size=2):
    """The rank processes of roformer-train ``proc``, in rank order (``testing.rank_processes``), waited for."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = rank_processes(proc.pid)
        if len(pids) == world_size:
            return pids
        time.sleep(0.2)
    raise AssertionError("rank processes not found")


def wait_for_group_gone(pgid, timeout=20.0) -> list[str]:
    """Wait until nothing of process group ``pgid`` runs; returns what still runs at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = live_group_members(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
