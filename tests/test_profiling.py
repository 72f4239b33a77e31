"""The ``trainer.profile`` window (roformer_dist/observe/profiling.py): a real ``torch.profiler`` trace of a tiny
torch workload holds the window's steps and no others; other ranks, start_step 0 and windows outside the
run write nothing; and, through the trainer, a debug run leaves the trace under run_dir/profile/."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from roformer_dist.config import ProfileConfig
from roformer_dist.observe.profiling import ProfileWindow


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


WINDOW_FILES = ["key_averages_steps_2-3.txt", "phases_steps_2-3.json", "phases_steps_2-3.txt",
                "trace_steps_2-3.pt.trace.json"]


def test_window_traces_only_its_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="roformer_dist.observe.profiling")
    drive(ProfileWindow(ProfileConfig(start_step=2, steps=2), tmp_path, rank=0), steps=6)
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == WINDOW_FILES
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
    assert sorted(p.name for p in out.iterdir()) == WINDOW_FILES
    names = event_names(out / "trace_steps_2-3.pt.trace.json")
    assert {n for n in names if n.startswith("optimizer_step_")} == {"optimizer_step_2", "optimizer_step_3"}
    # where a step goes: every phase ran in each step, inside it, and they account for most of it
    table = json.loads((out / "phases_steps_2-3.json").read_text())
    assert table["steps"] == [2, 3] and "gpu" not in table
    rows = {r["phase"]: r for r in table["phases"]}
    assert list(rows) == ["data", "forward", "backward", "optimizer", "other"]
    assert all(rows[p]["wall_ms"] > 0 for p in ("data", "forward", "backward", "optimizer"))
    assert sum(r["wall_ms"] for r in rows.values()) == pytest.approx(table["step_ms"], rel=1e-6)
    assert rows["forward"]["wall_ms"] + rows["backward"]["wall_ms"] > rows["other"]["wall_ms"]
    text = (out / "phases_steps_2-3.txt").read_text()
    assert text.startswith("where a step goes: steps 2-3 (2 steps)") and "backward" in text


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_step_table_attributes_device_time_to_the_phase_that_launched_it():
    """A GPU trace of two 100 us steps written out by hand: kernels belong to the phase running on the host at
    their launch (also a launch from another thread, as autograd's), NCCL is counted apart, a kernel launched
    before the window is left out, busy time is the union of what ran on the device."""
    from roformer_dist.runtime.phases import format_step_table, step_table

    events = [_x("optimizer_step_5", "user_annotation", 0, 100), _x("optimizer_step_6", "user_annotation", 100, 100),
              _x("cudaLaunchKernel", "cuda_runtime", -50, 2, correlation=1),      # before the window
              _x("gemm", "kernel", 1, 10, tid=7, correlation=1)]
    for base in (0, 100):
        events += [_x("phase: data", "user_annotation", base + 0, 10),
                   _x("phase: forward", "user_annotation", base + 10, 30),
                   _x("phase: backward", "user_annotation", base + 40, 40),
                   _x("phase: optimizer", "user_annotation", base + 80, 15),
                   _x("cudaLaunchKernel", "cuda_runtime", base + 12, 3, correlation=base + 10),
                   _x("fwd_gemm", "kernel", base + 15, 20, tid=7, correlation=base + 10),
                   _x("cudaLaunchKernel", "cuda_runtime", base + 45, 3, tid=2, correlation=base + 11),  # autograd
                   _x("bwd_gemm", "kernel", base + 48, 30, tid=7, correlation=base + 11),
                   _x("cudaLaunchKernel", "cuda_runtime", base + 50, 3, tid=2, correlation=base + 12),
                   _x("ncclKernel_ReduceScatter", "kernel", base + 60, 25, tid=8, correlation=base + 12),
                   _x("cudaMemcpyAsync", "cuda_runtime", base + 82, 2, correlation=base + 13),
                   _x("Memcpy DtoD", "gpu_memcpy", base + 86, 4, tid=7, correlation=base + 13)]
    table = step_table(events)
    assert table["steps"] == [5, 6] and table["step_ms"] == pytest.approx(0.1)
    rows = {r["phase"]: r for r in table["phases"]}
    expected = {"data": (10, 0, 0), "forward": (30, 20, 0), "backward": (40, 55, 25), "optimizer": (15, 4, 0),
                "other": (5, 0, 0)}
    for name, (wall, gpu, nccl) in expected.items():
        assert rows[name]["wall_ms"] == pytest.approx(wall / 1000), name
        assert rows[name]["gpu_ms"] == pytest.approx(gpu / 1000), name
        assert rows[name]["nccl_ms"] == pytest.approx(nccl / 1000), name
    g = table["gpu"]
    busy = 20 + (85 - 48) + 4   # the NCCL kernel overlaps the backward GEMM: 48-85 once
    assert g["busy_ms"] == pytest.approx(busy / 1000) and g["idle_ms"] == pytest.approx((100 - busy) / 1000)
    assert g["kernels_per_step"] == 3 and g["launch_host_ms"] == pytest.approx(9 / 1000)
    text = format_step_table(table)
    assert "GPU busy 0.06 ms a step (61.0%)" in text and "3 kernels a step" in text
    assert step_table([_x("gemm", "kernel", 0, 1)]) is None
