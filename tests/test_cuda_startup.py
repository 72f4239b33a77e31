"""Start-up on any CUDA image, checked on CPU.

- ``TORCH_CUDA_ARCH_LIST`` as images set it (``9.0a``, ``+PTX``, lists) is rewritten into what DeepSpeed's
  op builder reads; DeepSpeed's own builder code (``compute_capability_args``, a real ``load``) refuses the
  raw values and takes the rewritten ones.
- The optimizer: torch's fused AdamW on CUDA (nothing compiled), torch's AdamW on CPU as before, DeepSpeed's
  ops only where a setting asks for one; DeepSpeed takes a fused torch AdamW under ZeRO 1-3 in bf16.
- An op build that fails is one line naming the op, the variables and the fix, with exit status 7 and no
  traceback, through the real ``roformer-train`` (a compiler that fails, a fresh TORCH_EXTENSIONS_DIR).
- ``bench/optimizer.py --tiny`` runs (on CUDA the same script times both optimizers).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from roformer_dist.config import load_config, stage_plans
from roformer_dist.errors import EXIT_ENVIRONMENT, EXIT_STATUS_HELP, ConfigError, EnvironmentSetupError, exit_status
from roformer_dist.parallel.engine import CPU_ADAM, FUSED_LAMB, OptimizerChoice, build_failure, choose_optimizer, \
    deepspeed_config
from roformer_dist.runtime.cuda_arch import normalize_arch_list, prepare_for_deepspeed, unreadable_entries
from roformer_dist.testing import run_distributed
from trainer_runs import cli_overrides, copy_built_op, run_cli, wait_for_group_gone

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------ TORCH_CUDA_ARCH_LIST

ARCH_LISTS = [  # (set by an image, what DeepSpeed is given); the second None: unchanged
    ("9.0a", "9.0"),
    ("9.0+PTX", None),
    ("8.0;8.6;9.0a", "8.0;8.6;9.0"),
    ("9.0a+PTX", "9.0+PTX"),
    ("8.0 8.6 9.0a", "8.0;8.6;9.0"),
    ("8.0 8.6  9.0", "8.0;8.6;9.0"),  # two spaces: DeepSpeed's non-JIT reading takes an empty entry
    (" 9.0\t", "9.0"),
    ("7.5;8.0;8.6;8.9;9.0+PTX", None),
    ("10.0a", "10.0"),
    ("12.0f", "12.0"),
    ("10.0a;10.0f;12.0a", "10.0;12.0"),
    ("9.0a;9.0", "9.0"),
    ("9.0;9.0+PTX", "9.0+PTX"),
    ("", None),
    ("sm_90", None),  # no compute capability: left for the build to fail on, naming the variable
    ("8.0;sm_90a", None),
]


@pytest.mark.parametrize("raw,expected", ARCH_LISTS)
def test_arch_lists_are_rewritten_into_what_deepspeed_reads(raw, expected):
    new, changes = normalize_arch_list(raw)
    assert new == (raw if expected is None else expected)
    assert bool(changes) == (expected is not None), changes
    assert normalize_arch_list(new) == (new, [])  # once is enough
    assert unreadable_entries(raw) == [e for e in raw.replace(";", " ").split() if e.startswith("sm_")]


@pytest.mark.parametrize("raw,expected", [(r, e) for r, e in ARCH_LISTS if r.strip() and "sm_" not in r])
def test_deepspeeds_builder_refuses_the_raw_suffixes_and_reads_the_rewritten_lists(raw, expected, monkeypatch):
    """DeepSpeed 0.19.8's own parsing (``CUDAOpBuilder.compute_capability_args``, no CUDA needed once the
    variable is set), as a JIT build runs it and as a pre-compiled install does."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    def parse(value: str, jit: bool):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        builder = FusedAdamBuilder()
        builder.jit_mode, builder._jit_arch_list = jit, None
        flags = builder.compute_capability_args()
        return flags, os.environ["TORCH_CUDA_ARCH_LIST"]  # DeepSpeed writes back what torch is to build

    new, _ = normalize_arch_list(raw)
    for jit in (True, False):
        flags, written = parse(new, jit)
        assert written.replace("+PTX", "").split(";") == [e.replace("+PTX", "") for e in new.split(";")]
        assert jit or flags and all(f.startswith("-gencode=arch=compute_") for f in flags)
        if any(e.split("+")[0][-1] in "af" for e in re.split(r"[;\s]+", raw) if e):
            with pytest.raises(ValueError, match="invalid literal for int"):
                parse(raw, jit)


def test_prepare_for_deepspeed_rewrites_for_the_block_logs_one_line_and_restores(caplog):
    environ = {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"}
    with caplog.at_level(logging.INFO, logger="roformer_dist.runtime.cuda_arch"):
        with prepare_for_deepspeed(environ) as changes:
            assert environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0" and changes == ["9.0a -> 9.0"]
    assert environ == {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"}  # torch's own builds read the image's value
    (record,) = caplog.records
    assert "'8.0;9.0a' read as '8.0;9.0'" in record.getMessage() and "\n" not in record.getMessage()
    caplog.clear()
    for environ in ({}, {"TORCH_CUDA_ARCH_LIST": "9.0"}):
        before = dict(environ)
        with caplog.at_level(logging.INFO), prepare_for_deepspeed(environ) as changes:
            assert changes == [] and environ == before
    assert caplog.records == []


REAL_BUILD = textwrap.dedent("""
    import os, sys
    from deepspeed.ops.op_builder.fused_lamb import FusedLambBuilder
    from roformer_dist.parallel.engine import FUSED_LAMB, _build
    try:
        FusedLambBuilder().load()
        print("RAW ok")
    except Exception as e:
        print("RAW", type(e).__name__, e)
    print("OURS", _build(FUSED_LAMB, FusedLambBuilder()))
    print("AFTER", os.environ["TORCH_CUDA_ARCH_LIST"])
""")


@pytest.mark.parametrize("arch", ["9.0a", "8.0;9.0a+PTX", "sm_90"])
def test_a_real_deepspeed_cuda_op_build_gets_past_the_arch_list(arch, tmp_path):
    """DeepSpeed's real JIT build of a CUDA op (its fused LAMB) on this CPU machine: with the image's value it
    stops at parsing the arch list (every rank's traceback on the H200 image); through ``_build`` it gets
    past it and stops at the next thing this machine lacks (CUDA_HOME), in one line naming the variables.
    A list it cannot read either is named as such."""
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu",
           "CUDA_HOME": ""}
    out = subprocess.run([sys.executable, "-c", REAL_BUILD], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT).stdout
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if " " in line}
    assert lines["RAW"].startswith("ValueError invalid literal for int() with base 10"), out
    ours = lines["OURS"]
    assert ours.startswith("DeepSpeed's fused LAMB (op fused_lamb, for optim.name: lamb) could not be built: "), ours
    assert f"TORCH_CUDA_ARCH_LIST={arch};" in ours and "CUDA_HOME=" in ours and "optim.name: adamw" in ours, ours
    if arch == "sm_90":
        assert "TORCH_CUDA_ARCH_LIST holds 'sm_90', which is no compute capability" in ours, ours
    else:
        assert "invalid literal" not in ours and "CUDA_HOME" in ours.split(";")[0], ours
    assert lines["AFTER"] == arch  # restored for anything else the process builds
    assert (tmp_path / "fused_lamb.build-error.log").exists()


def test_the_build_failure_message_is_one_line_naming_the_variables_and_the_fix(monkeypatch):
    monkeypatch.setenv("CXX", "/opt/broken/g++")
    compiler_output = ("Error building extension 'cpu_adam': [1/3] /opt/broken/g++ -c cpu_adam.cpp -o cpu_adam.o\n"
                       "FAILED: cpu_adam.o\n/opt/broken/g++ -Werror -c cpu_adam.cpp -o cpu_adam.o\n"
                       "cpu_adam.cpp:1:10: fatal error: omp.h: No such file or directory\n"
                       "ninja: build stopped: subcommand failed.\n")
    msg = build_failure(CPU_ADAM, "cpu_adam", RuntimeError(compiler_output))
    assert "\n" not in msg
    assert msg.startswith("DeepSpeed's CPU Adam (op cpu_adam, for deepspeed.offload_optimizer: cpu) could not be "
                          "built: cpu_adam.cpp:1:10: fatal error: omp.h: No such file or directory; "
                          "CXX=/opt/broken/g++")
    assert "fix: set CXX to a working C++ compiler" in msg and "or set deepspeed.offload_optimizer: none" in msg
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda-12.8")
    msg = build_failure(FUSED_LAMB, "fused_lamb", OSError("nvcc: not found"))
    assert "\n" not in msg and "CUDA_HOME=/usr/local/cuda-12.8, TORCH_CUDA_ARCH_LIST=9.0a;" in msg
    assert "or set optim.name: adamw" in msg
    assert exit_status(EnvironmentSetupError(msg)) == EXIT_ENVIRONMENT == 7
    assert "\n  7 " in EXIT_STATUS_HELP


# ------------------------------------------------------------------------------------ the optimizer

def _cfg(*overrides: str):
    return load_config(None, ["model=debug", "model.vocab_size=512", "dist.world_size=1", "optim.warmup_steps=0",
                              "curriculum.stages=[{name: s, seq_len: 32, global_batch_size: 2, steps: 2}]",
                              *overrides])


def test_the_optimizer_on_cuda_is_torchs_fused_adamw_and_deepspeeds_ops_only_where_asked():
    default, offload, lamb = _cfg(), _cfg("deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"), \
        _cfg("optim.name=lamb", "deepspeed.zero_stage=0")
    assert choose_optimizer(default, cuda=True) == OptimizerChoice(None, True)
    assert choose_optimizer(default, cuda=False) == OptimizerChoice(None, False)  # CPU: as before
    for cuda in (True, False):
        assert choose_optimizer(offload, cuda) == OptimizerChoice(CPU_ADAM, False)
        assert choose_optimizer(lamb, cuda) == OptimizerChoice(FUSED_LAMB, False)
    with pytest.raises(ConfigError, match="deepspeed.zero_stage: 2 does not go with optim.name lamb"):
        _cfg("optim.name=lamb", "deepspeed.zero_stage=2")  # DeepSpeed's untested-optimizer assertion, said first
    assert "optimizer" not in deepspeed_config(default, stage_plans(default, 1)[0])  # on this CPU machine
    assert deepspeed_config(offload, stage_plans(offload, 1)[0])["optimizer"]["type"] == "AdamW"
    assert choose_optimizer(default, True).describe() == "torch AdamW (fused)"


def _zero_steps(rank, world_size, fused):
    """Two steps of the debug model under ZeRO 1, 2 and 3 in bf16, with the torch AdamW build_engine makes."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner
    import torch

    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.engine import param_groups, torch_optimizer

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    out = {}
    for stage in (1, 2, 3):
        cfg = _cfg(f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16")
        torch.manual_seed(0)
        model = RoFormerForMaskedLM(cfg.model)
        optimizer = torch_optimizer(cfg, param_groups(model, cfg.optim.weight_decay), fused)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=deepspeed_config(cfg, stage_plans(cfg, 1)[0]))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(5, 512, (2, 32), generator=g)
        losses = []
        for _ in range(2):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        states = [s for s in optimizer.state.values() if "exp_avg" in s]
        out[stage] = {"wrapped": engine.optimizer.optimizer is optimizer, "fused": optimizer.defaults["fused"],
                      "master": sorted({str(s["exp_avg"].dtype) for s in states}), "losses": losses,
                      "steps": sorted({float(s["step"]) for s in states})}
        engine.destroy()
    return out


def test_deepspeed_takes_a_fused_torch_adamw_under_zero_1_2_3_in_bf16():
    """What build_engine hands DeepSpeed on CUDA, run on CPU (torch's fused AdamW has a CPU kernel too): DeepSpeed
    keeps it as ZeRO's inner optimizer, steps it on fp32 master partitions (ZeRO-3 one sub-group at a time),
    and the losses follow the unfused optimizer's (another kernel: not bit-equal)."""
    fused, = run_distributed(_zero_steps, world_size=1, args=(True,), timeout=240)
    plain, = run_distributed(_zero_steps, world_size=1, args=(False,), timeout=240)
    for stage in (1, 2, 3):
        f, p = fused[stage], plain[stage]
        assert f["wrapped"] and f["fused"] is True and p["fused"] is None, (stage, f, p)
        assert f["master"] == ["torch.float32"] and f["steps"] == [2.0], (stage, f)
        assert f["losses"][0] == p["losses"][0] and abs(f["losses"][1] - p["losses"][1]) < 1e-3, (stage, f, p)


# ------------------------------------------------------------------------------------ a build that fails

FAILING_CXX = """#!/bin/sh
# a C++ compiler that answers torch's checks (-v, --version) but fails to compile {what}
for arg in "$@"; do
  case "$arg" in
    -c) case "$*" in {pattern}) echo "broken-cxx: error: cannot compile this source" >&2; exit 1;; esac;;
  esac
done
exec {real} "$@"
"""


def _failing_compiler(tmp_path: Path, pattern: str, what: str, name: str = "broken-c++") -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAILING_CXX.format(pattern=pattern, what=what, real=shutil.which("c++")))
    path.chmod(0o755)
    return path


def _train_with_broken_compiler(small_shards, tmp_path, env: dict, *overrides: str):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"), **env}  # fresh: nothing cached
    proc = run_cli(cli_overrides(small_shards, tmp_path / "run", "trainer.stop_at_step=2", *overrides), env)
    out, _ = proc.communicate(timeout=300)
    assert wait_for_group_gone(proc.pid) == []
    return proc.returncode, out


def test_roformer_train_whose_op_build_fails_says_so_in_one_line_with_status_7(small_shards, tmp_path):
    """Two ranks, a fresh TORCH_EXTENSIONS_DIR, a compiler that compiles nothing: the first op DeepSpeed
    builds on CPU (its shared-memory collectives) fails on rank 0; both ranks raise the same one line (rank
    1 waits for rank 0's build instead of racing it), printed once, exit 7, no traceback."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    cxx = _failing_compiler(tmp_path, "*", "anything")
    rc, out = _train_with_broken_compiler(small_shards, tmp_path, {"CXX": str(cxx)})
    said = [line for line in out.splitlines() if "could not be built" in line]
    assert rc == EXIT_ENVIRONMENT and "Traceback" not in out, out[-4000:]
    assert len(said) == 1 and said[0].startswith("roformer-train: DeepSpeed's shared-memory collectives (op "
                                                 "deepspeed_shm_comm, "), out[-4000:]
    assert "broken-cxx: error: cannot compile this source" in said[0] and f"CXX={tmp_path}" in said[0], said
    log = tmp_path / "torch_extensions" / "deepspeed_shm_comm.build-error.log"
    assert f"the build's output: {log}" in said[0] and "broken-cxx: error" in log.read_text()


@pytest.mark.slow
def test_roformer_train_with_offload_whose_cpu_adam_fails_to_build_says_so_in_one_line(small_shards, tmp_path):
    """The optimizer's op, through the trainer's engine: ZeRO-Offload asks for DeepSpeed's CPU Adam, whose
    build fails (the compiler, `c++` first on PATH, fails on its sources only). The collectives' op comes
    first: copied built from this environment's extensions directory where an earlier launch built it (ninja
    finds it up to date: the same compiler command), else built for real here (~30 s)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    cxx = _failing_compiler(tmp_path, "*cpu_adam*", "DeepSpeed's CPU Adam", name="c++")
    copy_built_op("deepspeed_shm_comm", tmp_path / "torch_extensions")
    path = f"{cxx.parent}{os.pathsep}{os.environ['PATH']}"
    rc, out = _train_with_broken_compiler(small_shards, tmp_path, {"PATH": path}, "deepspeed.offload_optimizer=cpu")
    said = [line for line in out.splitlines() if "could not be built" in line]
    assert rc == EXIT_ENVIRONMENT and "Traceback" not in out, out[-4000:]
    assert len(said) == 1 and said[0].startswith(
        "roformer-train: DeepSpeed's CPU Adam (op cpu_adam, for deepspeed.offload_optimizer: cpu) could not be built: "
        "broken-cxx: error: cannot compile this source;"), out[-4000:]
    assert "or set deepspeed.offload_optimizer: none" in said[0]


# ------------------------------------------------------------------------------------ the bench

def test_bench_optimizer_tiny_times_ours_and_says_why_the_baseline_is_skipped_on_cpu():
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    r = subprocess.run([sys.executable, "bench/optimizer.py", "--tiny", "--device", "cpu"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    tail = f"\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-3000:]}"
    assert r.returncode == 0, tail
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"bench": "optimizer"')]
    assert [(x["zero_stage"], x["dtype"]) for x in lines] == [(1, "bf16"), (2, "bf16"), (3, "bf16")], tail
    for x in lines:
        assert x["ours"] > 0 and x["ours_kernel_s"] > 0 and x["ours_impl"] == "torch AdamW", x
        assert x["baseline"] is None and x["ratio"] is None and "timed on CUDA only" in x["skipped"], x
    assert "baseline (DeepSpeed FusedAdam) skipped:" in r.stdout and "FusedAdam/ours" in r.stdout, tail


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU side is above)")
def test_on_cuda_ours_builds_nothing_and_fused_adam_builds_under_an_arch_suffix(tmp_path):
    """On a GPU, an image's ``TORCH_CUDA_ARCH_LIST=9.0a`` and a fresh TORCH_EXTENSIONS_DIR: the engine's
    optimizer (torch's fused AdamW, ZeRO 1-3, bf16) compiles nothing; DeepSpeed's FusedAdam, the bench's
    baseline, builds through ``load_op`` (the suffix read as 9.0) and is timed, or, without nvcc, is skipped
    with the one-line build error naming CUDA_HOME. About a minute for the build."""
    ext = tmp_path / "torch_extensions"
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), "TORCH_CUDA_ARCH_LIST": "9.0a",
           "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cuda"}
    r = subprocess.run([sys.executable, "bench/optimizer.py", "--tiny", "--device", "cuda"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    tail = f"\n--- stdout ---\n{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-3000:]}"
    assert r.returncode == 0 and "Traceback" not in r.stderr, tail
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"bench": "optimizer"')]
    assert [x["zero_stage"] for x in lines] == [1, 2, 3], tail
    for x in lines:
        assert x["ours_impl"] == "torch AdamW (fused)" and x["ours"] > 0, x
        assert x["ratio"] is not None or "CUDA_HOME" in x["skipped"], x
    built = sorted(p.name for p in ext.iterdir() if p.is_dir()) if ext.exists() else []
    assert set(built) <= {"fused_adam"}, built  # ours compiled nothing
