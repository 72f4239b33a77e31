"""The ``trainer.profile`` window (roformer_dist/train/profiling.py): a real ``torch.profiler`` trace of a tiny
torch workload holds the window's steps and no others; other ranks, start_step 0 and windows outside the
run write nothing; and, through the trainer, a debug run leaves the trace under run_dir/profile/."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from roformer_dist.config import ProfileConfig
from roformer_dist.train.profiling import ProfileWindow


def _workload():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step


def drive(window: ProfileWindow, steps, first: int = 1) -> None:
    """The loop's calls: before_step(k), the step inside a ``step_k`` marker, after_step(k); close()."""
    step = _workload()
    for k in range(first, steps + 1):
        window.before_step(k)
        with torch.profiler.record_function(f"step_{k}"):
            step()
        window.after_step(k)
    window.close()


def event_names(trace: Path) -> set[str]:
    data = json.loads(trace.read_text())
    assert data["traceEvents"], "the trace holds no events"
    return {e.get("name", "") for e in data["traceEvents"]}


def test_window_traces_only_its_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="roformer_dist.train.profiling")
    drive(ProfileWindow(ProfileConfig(start_step=2, steps=2), tmp_path, rank=0), steps=6)
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["key_averages_steps_2-3.txt", "trace_steps_2-3.pt.trace.json"]
    names = event_names(out / "trace_steps_2-3.pt.trace.json")
    steps = {n for n in names if n.startswith("step_")}
    assert steps == {"step_2", "step_3"}
    assert {"optimizer_step_2", "optimizer_step_3"} <= names  # the window's own markers
    assert any(n.startswith("aten::") for n in names)  # the operators themselves
    table = (out / "key_averages_steps_2-3.txt").read_text()
    assert "self CPU time" in table and "aten::" in table
    assert any("ui.perfetto.dev" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("start, rank", [(0, 0), (2, 1)], ids=["start_step_0", "rank_1"])
def test_inert_windows_write_nothing(tmp_path, caplog, start, rank):
    drive(ProfileWindow(ProfileConfig(start_step=start, steps=2), tmp_path, rank=rank), steps=4)
    assert not (tmp_path / "profile").exists()
    assert not caplog.records


@pytest.mark.parametrize("first, last_step, why", [
    (4, None, "this run starts at step 4"),   # resumed past the window's start
    (1, None, "the run ended before it"),     # the run is shorter than start_step
    (1, 3, "the run ends at step 3"),         # said at construction when the last step is known
])
def test_window_outside_the_run_writes_nothing_and_says_so_once(tmp_path, caplog, first, last_step, why):
    window = ProfileWindow(ProfileConfig(start_step=3 if first == 4 else 5, steps=2), tmp_path, rank=0,
                           last_step=last_step)
    drive(window, steps=3 if first == 1 else 6, first=first)
    window.close()  # idempotent
    assert not (tmp_path / "profile").exists()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and why in said[0], said


def test_stop_inside_the_window_writes_the_steps_done(tmp_path, caplog):
    drive(ProfileWindow(ProfileConfig(start_step=2, steps=5), tmp_path, rank=0), steps=3)
    trace = tmp_path / "profile" / "trace_steps_2-3.pt.trace.json"
    assert {n for n in event_names(trace) if n.startswith("step_")} == {"step_2", "step_3"}
    assert any("cut short" in r.getMessage() for r in caplog.records)


def test_trainer_writes_the_profile_window(small_shards, tmp_path):
    """Through the trainer (2 gloo ranks, the debug config): steps 2-3 of a 4-step run are traced by rank 0."""
    from trainer_runs import make_cfg, records, train

    run = tmp_path / "run"
    cfg = make_cfg(small_shards, run, "trainer.stop_at_step=4", "trainer.profile.start_step=2",
                   "trainer.profile.steps=2")
    assert train(cfg) == [0, 0]
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
    out = run / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["key_averages_steps_2-3.txt", "trace_steps_2-3.pt.trace.json"]
    names = event_names(out / "trace_steps_2-3.pt.trace.json")
    assert {n for n in names if n.startswith("optimizer_step_")} == {"optimizer_step_2", "optimizer_step_3"}
