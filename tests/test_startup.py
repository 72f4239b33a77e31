"""Ranks that start fast, and what that must not change.

- ``roformer-train`` starts its ranks before it resolves the run (they import meanwhile); a launch refused while
  resolving ends them unused: nothing of its process group is left.
- DeepSpeed's Muon modules are stand-ins in this project's processes: building a ZeRO engine imports no inductor.
- ``run_distributed`` forks its ranks from a preloaded server; the ranks still see the caller's environment as
  it is at the call, and write where the caller writes (pytest's capture of the current test).
- The preload (``roformer_dist.launch.preload``) touches no CUDA entry point: a server that did could not fork a
  rank that uses a GPU.
- The launcher resolves a fresh run without importing torch: on 2 cores its import would compete with the ranks'.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from roformer_dist.errors import EXIT_DATA
from roformer_dist.testing import run_distributed
from trainer_runs import DEBUG, cli_overrides, finish, run_cli, wait_for_group_gone

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_a_launch_refused_while_resolving_ends_its_ranks_unused(small_shards, tmp_path):
    """The ranks were started first; the shard set does not exist: the data error, once, and no process left."""
    over = cli_overrides(small_shards, tmp_path / "run")
    over[0] = f"data.shards={tmp_path / 'no_such_set'}"
    proc = run_cli(over)
    code, out = finish(proc, timeout=120)
    assert code == EXIT_DATA, out
    assert out.count(str(tmp_path / "no_such_set")) >= 1 and "Traceback" not in out, out
    assert wait_for_group_gone(proc.pid) == []
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_launcher_resolves_and_writes_a_fresh_run_without_torch(small_shards, tmp_path):
    """What ``roformer-train``'s own process does before it hands the run to its ranks, done here in a fresh
    interpreter: the config, the sinks, the shard sets, the stage plans, the run directory. No torch (nor
    DeepSpeed) is imported; a resume reads its trainer state, a torch file, and imports it then."""
    over = cli_overrides(small_shards, tmp_path / "run")
    p = _python(f"""
        import sys
        from roformer_dist.checkpoint.store import check_writable
        from roformer_dist.config import load_config
        from roformer_dist.launch.resolved import resolve_run
        from roformer_dist.observe.metrics import run_sinks

        cfg = load_config({str(DEBUG)!r}, {over!r})
        run_sinks(cfg)
        run = resolve_run(cfg)
        check_writable(run.run_dir.checkpoints, "the checkpoint directory")
        run.write()
        print("RESULT", "torch" in sys.modules, "deepspeed" in sys.modules, len(run.stages))
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("RESULT")[1].split() == ["False", "False", "3"], p.stdout
    assert (tmp_path / "run" / "resolved_run.json").is_file()


def test_a_zero_engine_is_built_without_deepspeeds_muon(tmp_path):
    """``import_deepspeed`` puts stand-ins in for DeepSpeed's Muon modules; a ZeRO-2 engine then builds without
    importing inductor's compiler (which the real Muon module's import-time compiles pulled in), and whatever would
    run Muon raises, naming the stand-in. Without DS_ACCELERATOR, the accelerator is said, not guessed: cpu here."""
    r = _python(f"""
        import os, sys
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{_port()}")
        os.environ.pop("DS_ACCELERATOR", None)
        from roformer_dist.runtime.deepspeed_import import MUON_MODULES, import_deepspeed
        deepspeed = import_deepspeed()
        accelerator = os.environ.get("DS_ACCELERATOR")
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        from roformer_dist.config import load_config, stage_plans
        from roformer_dist.nn.model import RoFormerForMaskedLM
        from roformer_dist.parallel.engine import build_engine
        cfg = load_config("configs/experiments/debug.yaml", ["model.vocab_size=500", "dist.world_size=1"])
        engine = build_engine(cfg, RoFormerForMaskedLM(cfg.model), stage_plans(cfg, 1)[0])
        stand_in = sys.modules[MUON_MODULES[1]].MuonWithAuxAdam
        refused = []
        for call in (stand_in, sys.modules[MUON_MODULES[0]].muon_update):
            try:
                call()
            except NotImplementedError as e:
                refused.append("is a stand-in" in str(e))
        print("RESULT", type(engine.optimizer).__name__, "torch._inductor.compile_fx" in sys.modules,
              "is not loaded" in (stand_in.__doc__ or ""), accelerator, refused)
        dist.destroy_process_group()
        """)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "RESULT DeepSpeedZeroOptimizer False True cpu [True, True]" in r.stdout, r.stdout[-2000:]


def _port() -> int:
    from roformer_dist.runtime.ports import free_port

    return free_port()


def _rank_sees(rank, world_size):
    print(f"rank {rank} says hello", flush=True)
    return os.environ.get("STARTUP_TEST_VALUE"), "STARTUP_TEST_GONE" in os.environ


def test_forked_ranks_take_the_callers_environment_and_output_as_they_are_now(monkeypatch, capfd):
    monkeypatch.setenv("STARTUP_TEST_GONE", "1")
    run_distributed(_rank_sees, world_size=2)  # the fork server is running from here on
    monkeypatch.setenv("STARTUP_TEST_VALUE", "set after the server started")
    monkeypatch.delenv("STARTUP_TEST_GONE")
    capfd.readouterr()
    assert run_distributed(_rank_sees, world_size=2) == [("set after the server started", False)] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out


def test_the_preload_touches_no_cuda_entry_point():
    """Every CUDA query torch has, watched while the preload imports (as on a GPU, where DeepSpeed is left to
    the ranks, and on CPU, where it is imported too): none is called."""
    watch = """
        import torch, torch.cuda
        calls = []
        for owner, name in [(torch.cuda, "is_available"), (torch.cuda, "device_count"), (torch.cuda, "_lazy_init"),
                            (torch.cuda, "init"), (torch.cuda, "current_device"), (torch.cuda, "get_device_properties"),
                            (torch.cuda, "get_device_capability"), (torch._C, "_cuda_getDeviceCount")]:
            real = getattr(owner, name, None)
            if real is None:
                continue  # a CPU build of torch has no CUDA bindings at all
            def spy(*a, _real=real, _name=name, **k):
                calls.append(_name)
                return _real(*a, **k)
            setattr(owner, name, spy)
        import roformer_dist.launch.preload
        import sys
        print("CALLS", calls, "deepspeed" in sys.modules)
        """
    on_gpu = _python(watch, DS_ACCELERATOR="cuda")
    assert on_gpu.returncode == 0, on_gpu.stderr[-3000:]
    assert "CALLS [] False" in on_gpu.stdout, on_gpu.stdout[-2000:]
    on_cpu = _python(watch, DS_ACCELERATOR="cpu")
    assert "CALLS [] True" in on_cpu.stdout, on_cpu.stdout[-2000:] + on_cpu.stderr[-2000:]
