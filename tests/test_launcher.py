"""roformer-submit without a cluster: flags -> sbatch script, validation before anything is queued,
run-directory bookkeeping (against stand-in `sbatch`/`srun` that only record their calls), and
``--cluster local`` running the real trainer through submitit's local executor.

The helpers at the top are shared with test_slurm.py and test_multinode.py (the real-SLURM tests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs" / "experiments" / "debug.yaml"
BIN = Path(sys.executable).parent  # the venv's bin: roformer-submit, roformer-train
# Same for the reference run and every job, so that their loss traces are comparable step for step.
COMMON = ("data.eval_batches=2", "trainer.eval_every=0", "trainer.log_every=1")
TOL = 1e-6  # fp32 loss traces


def job_env(**extra: str) -> dict:
    """Environment for roformer-submit / roformer-train / sbatch (SLURM jobs inherit it)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the venv's bin first: its ninja builds DeepSpeed's JIT ops
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def data_overrides(shards, run_dir) -> list[str]:
    return [f"data.shards={shards.dir}", f"data.eval_shards={shards.eval_dir}", f"run_dir={run_dir}", *COMMON]


def submit_cmd(shards, run_dir, *args: str) -> list[str]:
    return [str(BIN / "roformer-submit"), "--config", str(DEBUG), *data_overrides(shards, run_dir), *args]


def job_id_of(stdout: str) -> str:
    m = re.search(r"^job_id: (\S+)$", stdout, re.M)
    assert m, f"no 'job_id: <id>' line in:\n{stdout}"
    return m.group(1)


def records(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trace(run_dir) -> list[float]:
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "steps must be continuous, no duplicates"
    return [r["loss"] for r in recs]


def assert_trace_equal(run_dir, reference_dir, steps=None):
    got, ref = trace(run_dir), trace(reference_dir)
    ref = ref if steps is None else ref[:steps]
    assert len(got) == len(ref), f"{len(got)} steps vs {len(ref)} in the reference"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= TOL, f"step {i + 1}: loss {a} vs reference {b}"


def reference_run(tmp_path_factory, shards) -> Path:
    """One uninterrupted 2-rank run of the debug config by ``roformer-train`` (the trainer's own spawner),
    made once per session and shared by the launcher, SLURM and multi-node tests."""
    run_dir = tmp_path_factory.getbasetemp() / "launcher_reference"
    done = run_dir / "REFERENCE_DONE"
    if not done.exists():
        cmd = [str(BIN / "roformer-train"), "--config", str(DEBUG), *data_overrides(shards, run_dir)]
        p = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"reference run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        done.touch()
    return run_dir


# --------------------------------------------------------------------------- stand-in sbatch


@pytest.fixture
def fake_slurm(tmp_path):
    """`sbatch` and `srun` on PATH that record their arguments; sbatch answers as SLURM does."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    calls = tmp_path / "sbatch_calls.txt"
    (bindir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'Submitted batch job 4242'\n")
    (bindir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = job_env(PATH=f"{bindir}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return env, calls


def run_submit(args: list[str], env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def shard_stub(small_shards):
    """Shard sets for everything but training: the session's small real ones (``--dry-run`` resolves them)."""
    return small_shards


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(shard_stub, tmp_path, fake_slurm):
    env, calls = fake_slurm
    run_dir = tmp_path / "run"
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--nodes", "2", "--tasks-per-node", "1",
                              "--cpus-per-task", "1", "--time", "7", "--partition", "debug", "--account", "acct",
                              "--qos", "normal", "--constraint", "fast", "--mem", "3G", "--dry-run"), env)
    assert p.returncode == 0, p.stderr
    script = p.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=1",
                 "#SBATCH --time=7", "#SBATCH --partition=debug", "#SBATCH --account=acct", "#SBATCH --qos=normal",
                 "#SBATCH --constraint=fast", "#SBATCH --mem=3GB", "#SBATCH --signal=USR2@30",
                 "#SBATCH --requeue", 'export DS_ACCELERATOR="cpu"'):
        assert line in script.splitlines(), f"{line!r} missing from:\n{script}"
    assert re.search(r"^trap .* USR2$", script, re.M), "the batch shell must survive `scancel --signal=USR2 --full`"
    assert re.search(rf"^srun .*{re.escape(str(run_dir / 'logs'))}", script, re.M), "submitit folder = run_dir/logs"
    assert not calls.exists(), "--dry-run must not call sbatch"
    assert not run_dir.exists(), "--dry-run must not create the run directory"


def test_gpu_profile_runs_one_rank_per_gpu(shard_stub, tmp_path, fake_slurm):
    env, _ = fake_slurm
    # debug's stages have global batches 8/8/4; 2 nodes x 2 GPUs = 4 ranks fits them all
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--profile", "example_gpu", "--nodes", "2",
                              "--gpus-per-node", "2", "--dry-run"), env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "#SBATCH --gpus-per-node=2" in lines and "#SBATCH --ntasks-per-node=2" in lines
    assert "module load cuda/12.4 nccl/2.21" in lines
    assert any(x.startswith("export NCCL_IB_HCA=") for x in lines)
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--profile", "example_gpu", "--gpus-per-node", "2",
                              "--tasks-per-node", "1", "--dry-run"), env)
    assert p.returncode == 2 and "slurm.tasks_per_node" in p.stderr


@pytest.mark.parametrize("args, key", [
    (["deepspeed.zero_stage=7"], "deepspeed.zero_stage"),
    (["trainer.no_such_key=1"], "trainer.no_such_key"),
    (["--nodes", "3", "--tasks-per-node", "1"], "global_batch_size"),  # 8 sequences do not split over 3 ranks
    (["--time", "1", "slurm.signal_delay_s=60"], "slurm.signal_delay_s"),  # the signal would come at the limit
    (["--profile", "no_such_cluster"], "slurm"),
    (["--mem", "lots"], "slurm.mem_gb"),
    (["data.shards=/nonexistent/shards"], "data.shards"),
], ids=["bad-value", "unknown-key", "world-size", "signal-delay", "profile", "mem", "shards"])
def test_bad_config_exits_non_zero_naming_the_key_and_submits_nothing(shard_stub, tmp_path, fake_slurm, args, key):
    env, calls = fake_slurm
    run_dir = tmp_path / "run"
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", *args), env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert key in p.stderr, p.stderr
    assert not calls.exists(), "a bad config must not reach sbatch"
    assert not run_dir.exists()


def test_submit_creates_run_dir_records_job_id_and_prints_it(shard_stub, tmp_path, fake_slurm):
    env, calls = fake_slurm
    run_dir = tmp_path / "run"
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--nodes", "2", "--tasks-per-node", "2"),
                   env)
    assert p.returncode == 0, p.stderr
    assert job_id_of(p.stdout) == "4242"
    assert (run_dir / "logs" / "job_id").read_text().strip() == "4242"
    assert json.loads((run_dir / "logs" / "jobs.jsonl").read_text().splitlines()[-1])["job_id"] == "4242"
    assert len(calls.read_text().splitlines()) == 1
    script = (run_dir / "logs" / "4242_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["dist"]["world_size"] == 4, "the job's world size is nodes x tasks per node"
    assert saved["run_dir"] == str(run_dir)


def test_shard_sets_at_urls_are_queued_as_given(shard_stub, tmp_path, fake_slurm):
    """A URL is not a path: it reaches the job unchanged (the job reads and checks it when it starts)."""
    env, calls = fake_slurm
    run_dir = tmp_path / "run"
    url, eval_url = "https://data.example.org/zh/train", "pipe:aws s3 cp s3://bucket/zh/eval/{name} -"
    p = run_submit([str(BIN / "roformer-submit"), "--config", str(DEBUG), f"data.shards={url}",
                    f"data.eval_shards={eval_url}", f"run_dir={run_dir}", "--profile", "local"], env)
    assert p.returncode == 0, p.stderr
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["data"]["shards"], saved["data"]["eval_shards"]) == (url, eval_url)
    assert len(calls.read_text().splitlines()) == 1


def test_submit_refuses_a_run_dir_held_by_a_running_run(shard_stub, tmp_path, fake_slurm):
    """A run holds the directory's lock: submitting there changes nothing (its config.yaml stays) and exits 6."""
    env, calls = fake_slurm
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the running run's config\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom roformer_dist.runtime.runlock import RunLock\n"
                               f"RunLock({str(run_dir)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(120)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local"), env)
        assert p.returncode == 6, p.stdout + p.stderr
        assert f"pid {holder.pid}" in p.stderr and "in use by another run" in p.stderr, p.stderr
        assert (run_dir / "config.yaml").read_text() == "the running run's config\n"
        assert not calls.exists(), "nothing may be submitted"
    finally:
        holder.kill()
        holder.wait()


def test_subcommands_need_a_submitted_run(tmp_path):
    for sub in ("status", "cancel", "logs"):
        p = run_submit([str(BIN / "roformer-submit"), sub, str(tmp_path)], job_env())
        assert p.returncode == 2 and "no job was submitted" in p.stderr


def test_no_sbatch_means_local_and_slurm_is_refused(shard_stub, tmp_path):
    env = job_env(PATH=str(BIN))  # no sbatch on PATH
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--dry-run"), env)
    assert p.returncode == 0 and "--cluster local" in p.stdout
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--cluster", "slurm"), env)
    assert p.returncode == 1 and "no sbatch" in p.stderr


# --------------------------------------------------------------------------- --cluster local, real trainer


@pytest.mark.slow
def test_cluster_local_runs_the_same_job_here(small_shards, tmp_path, tmp_path_factory):
    """The submitit job (TrainJob) on this machine through submitit's local executor: 2 tasks, stop at 6."""
    reference = reference_run(tmp_path_factory, small_shards)
    run_dir = tmp_path / "local"
    p = run_submit(submit_cmd(small_shards, run_dir, "--cluster", "local", "--profile", "local",
                              "trainer.stop_at_step=6"), job_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "final state: COMPLETED" in p.stdout
    assert_trace_equal(run_dir, reference, steps=6)
    assert (run_dir / "logs" / "rank0.log").exists() and (run_dir / "logs" / "rank1.log").exists()
    st = run_submit([str(BIN / "roformer-submit"), "status", str(run_dir)], job_env())
    assert st.returncode == 0 and "progress: step 6/18" in st.stdout, st.stdout
