"""Sinks (``roformer_dist.observe.sinks``): every sink of the table gives back what it was given, drops what came
after a resumed step, and holds every event of a checkpoint's steps once that checkpoint commits, even when
the launch is killed right after (the fault campaign's guarantee, per sink).

A new sink adds its entry to ``VIEWS``: what of its read-back must equal an uninterrupted run's. A sink whose
optional package (``SINKS[name].package``) is not installed is skipped, with the ``pip install`` line.

The killed-launch test guards the outcome, not the mechanism: TensorBoard's writer thread often has its
events on disk within a second on its own (the test passed here with ``TensorBoardSink.flush`` disabled);
``tests/test_faults.py`` (a mixture run with many more tags, killed at several points) is the one that
caught the missing flush once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from roformer_dist.errors import ConfigError
from roformer_dist.observe.metrics import MetricsWriter, run_sinks
from roformer_dist.observe.sinks import SINKS, SinkContext, check_sinks, open_sinks
from trainer_runs import cli_overrides, run_cli, wait_for_group_gone


def _jsonl_view(read, upto):
    return {step: (r["loss"], r["mlm_acc"]) for step, r in read.items() if step <= upto}


def _tags_view(read, upto):
    # tag -> [(step, value)]; perf/* are measurements (their values differ between runs); every other tag must
    # match step for step
    return {tag: [(s, v) for s, v in events if s <= upto] for tag, events in read.items() if not tag.startswith("perf/")}


VIEWS = {"jsonl": _jsonl_view, "tensorboard": _tags_view, "wandb": _tags_view, "mlflow": _tags_view}

OPTIONAL = [n for n in SINKS if getattr(SINKS[n], "package", None)]
INSTALLED = [n for n in SINKS if n not in OPTIONAL or importlib.util.find_spec(SINKS[n].package)]


def _needs_package(name):
    if name not in INSTALLED:
        package, extra = SINKS[name].package, SINKS[name].extra
        pytest.skip(f"the {package} package is not installed: pip install 'roformer-dist[{extra}]'")


def test_every_sink_has_a_view_for_these_tests():
    assert set(VIEWS) == set(SINKS)


@pytest.mark.parametrize("name", list(SINKS))
def test_a_sink_gives_back_what_it_was_given_and_a_resume_drops_what_came_after(name, tmp_path):
    _needs_package(name)
    sink = SINKS[name](SinkContext(tmp_path))
    for step in range(1, 5):
        sink.log_record({"step": step, "loss": 1.0 / step, "mlm_acc": step / 10})
        sink.log_scalars(step, {"train/loss": 1.0 / step})
    sink.log_text("config", "text", 0)
    sink.flush()  # flushed, not closed: what a kill after a checkpoint leaves
    first = VIEWS[name](type(sink).read(tmp_path), 4)
    assert len(first if name == "jsonl" else first["train/loss"]) == 4
    sink.close()
    resumed = SINKS[name](SinkContext(tmp_path, resume_step=2))
    resumed.log_record({"step": 3, "loss": 9.0, "mlm_acc": 0.9})
    resumed.log_scalars(3, {"train/loss": 9.0})
    resumed.close()
    view = VIEWS[name](type(resumed).read(tmp_path), 4)
    if name == "jsonl":
        assert view == {1: (1.0, 0.1), 2: (0.5, 0.2), 3: (9.0, 0.9)}
    else:
        assert [s for s, _ in view["train/loss"]] == [1, 2, 3] and view["train/loss"][-1] == (3, 9.0)


def test_sinks_are_chosen_by_name_and_unknown_ones_are_refused_by_the_key():
    assert check_sinks(["tensorboard", "jsonl", "tensorboard"]) == ("tensorboard", "jsonl")
    with pytest.raises(ConfigError, match="logging.sinks: unknown sink.*'neptune'.*known: jsonl, tensorboard, wandb"):
        check_sinks(["neptune"])
    with pytest.raises(ConfigError, match="logging.sinks"):
        open_sinks(["nowhere"], SinkContext("."))


def test_a_run_always_keeps_its_record_and_tensorboard_can_be_left_out(tmp_path):
    from roformer_dist.config import load_config

    assert run_sinks(load_config(overrides=["logging.tensorboard=false"])) == ("jsonl",)
    assert run_sinks(load_config()) == ("jsonl", "tensorboard")
    assert run_sinks(load_config(overrides=["logging.sinks=[tensorboard]"])) == ("jsonl", "tensorboard")
    with pytest.raises(ConfigError, match="logging.sinks: unknown sink.*'comet'"):
        run_sinks(load_config(overrides=["logging.sinks=[jsonl, comet]"]))
    for bad in ("[jsonl, jsonl]", "['']"):
        with pytest.raises(ConfigError, match=r"logging\.sinks"):
            load_config(overrides=[f"logging.sinks={bad}"])
    writer = MetricsWriter(tmp_path, 0, 0, ("jsonl",))
    writer.step_record({"step": 1, "loss": 2.0, "mlm_acc": 0.1})
    writer.scalars(1, {"train/loss": 2.0, "train/grad_norm": None})  # None values are left out
    writer.close()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
    assert MetricsWriter(tmp_path, 1, 0).sinks == []  # other ranks write nothing


@pytest.mark.parametrize("name", OPTIONAL)
def test_a_sink_whose_package_is_missing_is_refused_when_the_config_is_checked(name, monkeypatch):
    from roformer_dist.config import load_config

    cfg = load_config(overrides=[f"logging.sinks=[tensorboard, {name}]"])
    monkeypatch.setattr(SINKS[name], "package", "roformer_dist_no_such_package")
    # run_sinks is what roformer-train checks before any rank starts; opening the sink checks again
    refused = rf"logging\.sinks: the '{name}' sink needs .*: pip install 'roformer-dist\[{name}\]'"
    with pytest.raises(ConfigError, match=refused):
        run_sinks(cfg)
    with pytest.raises(ConfigError, match=r"logging\.sinks: .*pip install"):
        open_sinks([name], SinkContext("."))


def test_wandb_sync_uploads_only_the_segments_read_gives_back(tmp_path):
    import json

    _needs_package("wandb")
    sink = SINKS["wandb"](SinkContext(tmp_path))
    for step in (1, 2):
        sink.log_scalars(step, {"train/loss": float(step)})
    sink.flush()  # the checkpoint of step 2
    sink.log_scalars(3, {"train/loss": 3.0})
    sink.run.finish()  # stands in for the kill: step 3's segment is on disk but was never listed
    resumed = SINKS["wandb"](SinkContext(tmp_path, resume_step=2))
    resumed.log_scalars(3, {"train/loss": 30.0})
    resumed.close()
    assert type(resumed).read(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 30.0)]}
    listed = {s["dir"] for s in json.loads((tmp_path / "wandb_run.json").read_text())["segments"]}
    # what `wandb sync <dir>/wandb` picks up (its latest-run link aside)
    synced = {p.parent.name for p in (tmp_path / "wandb").glob("*/*.wandb") if not p.parent.is_symlink()}
    assert synced == listed and len(listed) == 2


@pytest.fixture(scope="module")
def killed_after_a_checkpoint(small_shards, tmp_path_factory):
    """(run killed right after `latest` names step 4, the same run stopped at step 4), with every installed sink."""
    base = tmp_path_factory.mktemp("sinks")
    common = ("trainer.save_every=4", "trainer.log_every=2", "trainer.eval_every=4",
              f"logging.sinks=[{', '.join(INSTALLED)}]")
    # W&B offline and MLflow's store in the run directory, whatever the environment says
    quiet = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""}
    out = {}
    for name, extra, env in (("killed", (), {**quiet, "ROFORMER_FAULT_AT": "save.after_latest@1:kill-group@0"}),
                             ("reference", ("trainer.stop_at_step=4",), quiet)):
        proc = run_cli(cli_overrides(small_shards, base / name, *common, *extra), env)
        text, _ = proc.communicate(timeout=300)
        assert wait_for_group_gone(proc.pid) == []
        assert proc.returncode == (-9 if name == "killed" else 0), text[-3000:]
        out[name] = base / name
    assert (out["killed"] / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SINKS))
def test_every_sink_holds_a_checkpoints_steps_when_the_launch_is_killed_right_after(name, killed_after_a_checkpoint):
    _needs_package(name)
    runs, read, view = killed_after_a_checkpoint, SINKS[name].read, VIEWS[name]
    want = view(read(runs["reference"]), 4)
    assert want, "the reference run wrote nothing to this sink"
    assert view(read(runs["killed"]), 4) == want


def test_deepspeed_is_imported_without_mlflow_which_still_imports_afterwards():
    """DeepSpeed's autotuner imports mlflow when it is installed (a second in every rank); the project's one
    way of importing DeepSpeed hides it for that import only."""
    pytest.importorskip("mlflow")
    code = ("import sys; from roformer_dist.runtime.deepspeed_import import import_deepspeed; import_deepspeed(); "
            "print('mlflow' in sys.modules); import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "mlflow"]


def test_mlflow_keeps_a_run_in_sqlite_and_a_run_directory_with_a_file_store_keeps_that(tmp_path, monkeypatch):
    """The default store is the one MLflow 3 supports (a SQLite file in the run directory), read back by MLflow's
    own client without MLFLOW_ALLOW_FILE_STORE, as `mlflow ui` would; a run directory that already has a file
    store (this sink's default before) goes on in it."""
    _needs_package("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    new = tmp_path / "new"
    for resume_step, steps in ((0, (1, 2, 3)), (2, (3,))):                  # a launch, then a resume from step 2
        sink = SINKS["mlflow"](SinkContext(new, resume_step))
        for step in steps:
            sink.log_scalars(step, {"train/loss": 10.0 * step + resume_step})
        sink.close()
    assert (new / "mlflow.db").is_file() and not (new / "mlruns").exists()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    client = MlflowClient(tracking_uri=f"sqlite:///{new / 'mlflow.db'}")
    history = client.get_metric_history(sink.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 10.0), (2, 20.0), (3, 32.0)]
    assert client.get_run(sink.run_id).data.metrics["train/loss"] == 32.0  # the latest value, taken again
    old = tmp_path / "old"
    (old / "mlruns").mkdir(parents=True)
    sink = SINKS["mlflow"](SinkContext(old))
    sink.log_scalars(1, {"train/loss": 1.5})
    sink.close()
    assert not (old / "mlflow.db").exists() and any((old / "mlruns").rglob("train/loss"))
    assert SINKS["mlflow"].read(old) == {"train/loss": [(1, 1.5)]}


def test_the_sinks_settings_come_from_the_config_before_the_environment(tmp_path, monkeypatch):
    from roformer_dist.config import load_config

    cfg = load_config(overrides=[f"logging.mlflow.tracking_uri={tmp_path / 'store'}", "logging.mlflow.experiment=cfg",
                                 "logging.wandb.project=from-config"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    if "mlflow" in INSTALLED:
        from mlflow.tracking import MlflowClient

        sink = SINKS["mlflow"](SinkContext(tmp_path / "run", 0, cfg.logging))
        sink.log_scalars(1, {"train/loss": 1.5})
        sink.close()
        client = MlflowClient(tracking_uri=str(tmp_path / "store"))  # MLflow's own reader, on the configured store
        run = client.get_run(sink.run_id)
        assert client.get_experiment(run.info.experiment_id).name == "cfg"
        assert [m.value for m in client.get_metric_history(sink.run_id, "train/loss")] == [1.5]
        assert not (tmp_path / "run" / "mlruns").exists()
    if "wandb" in INSTALLED:
        sink = SINKS["wandb"](SinkContext(tmp_path / "wb", 0, cfg.logging))
        sink.log_scalars(1, {"train/loss": 1.5})
        assert sink.run.project == "from-config" and sink.run.offline  # offline, the default mode
        sink.close()
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config(overrides=["logging.wandb.mode=offlne"])
