"""bench/gpu_check.sh, the GPU machine's one script, checked where there is no GPU: the shell parses,
every Python command in it parses its arguments, and its model-level backend check runs on CPU
(Triton under its interpreter, in the child process only)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


VARIABLES = {'"$BACKENDS"': "reference", '"$TRAIN_RUN"': "/tmp/run", '"$DATA/train"': "data/debug/train",
             '"$DATA/eval"': "data/debug/eval", "$RANKS": "2"}


def script_python_commands() -> list[list[str]]:
    """``run_step NAME "$PY" <args>`` commands of the script, continuation lines joined, variables filled."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        m = re.match(r'\s*run_step \S+ "\$PY" (.*)$', line)
        if m:
            args = m.group(1)
            for var, value in VARIABLES.items():
                args = args.replace(var, value)
            commands.append(shlex.split(args))
    return commands


def test_every_python_command_of_the_script_parses(monkeypatch):
    commands = script_python_commands()
    assert {c[0] for c in commands} >= {"bench/gpu_check.py", "bench/step.py", "bench/rotary.py",
                                        "bench/linear_attention.py"}
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    for script, *args in (c for c in commands if c[0].startswith("bench/")):
        module = importlib.import_module(Path(script).stem)
        try:
            module.parse_args(args)
        except SystemExit as e:  # argparse's exit on an unknown flag or a bad value
            raise AssertionError(f"{script} {' '.join(args)}: arguments rejected ({e})") from None


def test_training_step_of_the_script_is_a_valid_config():
    """The bf16 / ZeRO-2 / NCCL run: its overrides load and validate (at the 2 ranks of a 2-GPU machine)."""
    from roformer_dist.config import load_config

    (train,) = [c for c in script_python_commands() if c[:2] == ["-m", "roformer_dist.cli.train"]]
    assert train[2] == "--config"
    cfg = load_config(ROOT / train[3], train[4:])
    assert (cfg.deepspeed.precision, cfg.deepspeed.zero_stage, cfg.dist.backend) == ("bf16", 2, "nccl")
    assert cfg.trainer.stop_at_step == 8 and cfg.curriculum.stages[0].steps < 8  # two curriculum stages


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


def _fake_run(run: Path, profile_start: int, trace_events=None) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": 5.0 - k / 10}) + "\n"
                                               for k in (1, 2, 3)))
    (run / "config.yaml").write_text(f"deepspeed:\n  precision: bf16\ntrainer:\n  profile:\n"
                                     f"    start_step: {profile_start}\n    steps: 2\n")
    tb = SummaryWriter(str(run / "tb"))
    for k, (tok, mfu) in enumerate([(10.0, 0.1), (100.0, 0.3), (120.0, 0.4)], start=1):
        tb.add_scalar("perf/tokens_per_s", tok, k)
        tb.add_scalar("perf/mfu", mfu, k)
    tb.close()
    if trace_events is not None:
        (run / "profile").mkdir()
        (run / "profile" / "trace_steps_2-3.pt.trace.json").write_text(json.dumps({"traceEvents": trace_events}))
    return run


@pytest.mark.parametrize("profile_start, events, ok", [
    (0, None, True),                                  # no window asked, none there
    (2, [{"name": "aten::mm", "cat": "cpu_op"}], True),  # CPU-only trace: fine where there is no GPU
    (2, None, False),                                 # a window asked for and no trace: the check fails
])
def test_train_report_prints_mfu_and_checks_the_profile(tmp_path, monkeypatch, capsys, profile_start, events, ok):
    """train-report on a made-up run: the trainer's perf/mfu (its median after the warm-up step), the peak
    beside it (none on CPU) and the profile window's trace."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    gpu_check = importlib.import_module("gpu_check")
    run = _fake_run(tmp_path / "run", profile_start, events)
    assert gpu_check.main(["train-report", str(run)]) == (0 if ok else 1)
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith('{"bench"')]
    assert line["mfu"] == pytest.approx(0.35) and line["precision"] == "bf16" and line["peak_tflops"] is None
    assert (line["profile_trace"] is not None) == (events is not None) and line["ok"] is ok
