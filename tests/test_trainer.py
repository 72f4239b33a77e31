"""The DeepSpeed trainer on CPU with gloo: ZeRO equivalence, exact resume, crashes, elastic resume,
stop signals, non-finite losses, TensorBoard, HF export. Real DeepSpeed engines, real shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from roformer_dist.config import load_config
from roformer_dist.runtime.events import read_scalars
from roformer_dist.runtime.stop import EXIT_DONE, EXIT_REQUEUE
from roformer_dist.testing import run_distributed
from trainer_runs import (DEBUG, SCHEDULE, assert_traces_equal, make_cfg, records, reference_run, train,
                          trace)
from trainer_runs import cli_overrides as _cli_overrides
from trainer_runs import rank_pids as _rank_pids
from trainer_runs import run_cli as _run_cli
from trainer_runs import wait_for_step as _wait_for_step

STAGES_1 = "curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 8, steps: 8}]"


@pytest.fixture(scope="module")
def reference(small_shards, tmp_path_factory):
    """One uninterrupted 2-rank ZeRO-2 run through the three debug stages, shared by the resume tests."""
    return reference_run(tmp_path_factory, small_shards)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_two_ranks_equal_one_rank(small_shards, tmp_path, stage):
    """2 ranks x 1 loader worker see the same micro-batches as 1 rank x 2 workers with accumulation 2."""
    stages = STAGES_1.replace("steps: 8}", "steps: 8, micro_batch_size: 4}")
    one = make_cfg(small_shards, tmp_path / "one", stages, "trainer.stop_at_step=4", "data.num_workers=2",
                   f"deepspeed.zero_stage={stage}", world_size=1)
    two = make_cfg(small_shards, tmp_path / "two", stages, "trainer.stop_at_step=4", "data.num_workers=1",
                   f"deepspeed.zero_stage={stage}", world_size=2)
    train(one)
    train(two)
    # fp32; reductions over ranks vs over accumulation steps differ in summation order only
    assert_traces_equal(trace(tmp_path / "one"), trace(tmp_path / "two"), tol=1e-5)


def test_zero2_buckets_and_overlap_change_how_gradients_move_not_the_training(small_shards, tmp_path):
    """deepspeed.reduce_bucket_size / allgather_bucket_size / overlap_comm: 2 ranks with buckets of 20,000
    elements (the debug model's gradients in dozens of them) and the reduction overlapped with backward
    follow the default run (one bucket, no overlap)."""
    runs = {}
    for name, extra in (("default", ()), ("buckets", ("deepspeed.reduce_bucket_size=20000",
                                                      "deepspeed.allgather_bucket_size=20000",
                                                      "deepspeed.overlap_comm=true"))):
        runs[name] = tmp_path / name
        train(make_cfg(small_shards, runs[name], STAGES_1, "trainer.stop_at_step=4", "deepspeed.zero_stage=2",
                       *extra, world_size=2))
    assert_traces_equal(trace(runs["default"]), trace(runs["buckets"]), tol=1e-5)


def test_two_runs_of_the_same_recipe_log_the_same_figures_at_every_step(small_shards, tmp_path):
    """Reproducibility as a user meets it: ``roformer-train`` twice with the same config into two run directories
    (2 ranks, a DataLoader worker each, a stage switch, an asynchronous save and an eval on the way) logs the
    same loss, accuracy and lr at every step and the same eval losses, to the last bit; the weights are equal."""
    stages = ("curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 8, steps: 4}, "
              "{name: s256, seq_len: 256, global_batch_size: 4, steps: 4}]")
    runs = [tmp_path / "first", tmp_path / "second"]
    for run in runs:
        proc = _run_cli(_cli_overrides(small_shards, run, stages, "trainer.log_every=1", "trainer.save_every=4",
                                       "checkpoint.async=true", "trainer.eval_every=4"))
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out

    def figures(run):  # every record without its timings
        return [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")} for r in records(run)]

    assert [r["step"] for r in figures(runs[0])] == list(range(1, 9))
    assert figures(runs[0]) == figures(runs[1])
    evals = [{tag: values for tag, values in read_scalars(run / "tb").items() if tag.startswith("eval/")}
             for run in runs]
    assert [step for step, _ in evals[0]["eval/loss"]] == [4, 8]
    assert evals[0] == evals[1]
    weights = [torch.load(run / "checkpoints" / "step_00000008" / "mp_rank_00_model_states.pt",
                          weights_only=False)["module"] for run in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


# --------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("stage", [2, 3])
def test_stop_and_resume_equals_uninterrupted(small_shards, tmp_path, stage, reference):
    ref = reference
    if stage != 2:
        ref = tmp_path / "ref"
        assert train(make_cfg(small_shards, ref, "deepspeed.zero_stage=3")) == [0, 0]
    run = tmp_path / "run"
    # stop inside stage 2 (steps 7-12), then resume through stage 3 to the end
    assert train(make_cfg(small_shards, run, f"deepspeed.zero_stage={stage}",
                          "trainer.stop_at_step=8")) == [EXIT_DONE, EXIT_DONE]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    assert train(make_cfg(small_shards, run, f"deepspeed.zero_stage={stage}")) == [0, 0]
    assert_traces_equal(trace(ref), trace(run), tol=1e-6)
    assert trace(ref, "seq_len") == trace(run, "seq_len") == SCHEDULE


def test_stages_keep_the_global_batch(reference):
    """Sequences per step, as consumed and as DeepSpeed is configured, follow each stage's global batch."""
    cfg = load_config(DEBUG)
    expected = [st.global_batch_size for st in cfg.curriculum.stages for _ in range(st.steps)]
    assert trace(reference, "samples") == expected
    assert trace(reference, "global_batch") == expected
    # micro-batch 4 -> 4 -> 2 (2048-token budget) on 2 ranks: accumulation 1, 1, 1
    assert trace(reference, "accumulation") == [1] * 18


def test_tensorboard_has_contract_tags_and_continuous_steps(small_shards, tmp_path):
    from roformer_dist.runtime.events import read_scalars

    run = tmp_path / "run"
    cfg = make_cfg(small_shards, run, "trainer.log_every=1", "trainer.stop_at_step=8")
    train(cfg)
    train(make_cfg(small_shards, run, "trainer.log_every=1"))
    scalars = read_scalars(run / "tb")
    for tag in ("train/loss", "train/mlm_acc", "train/lr", "train/seq_len", "train/stage", "train/grad_norm",
                "train/loss_scale", "perf/tokens_per_s", "perf/samples_per_s", "perf/step_time_s",
                "perf/max_mem_gb", "eval/loss", "eval/mlm_acc"):
        assert tag in scalars, f"missing TensorBoard tag {tag}"
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == list(range(1, 19)), steps
    assert [v for _, v in scalars["train/seq_len"]] == SCHEDULE
    assert [v for _, v in scalars["train/stage"]] == [0] * 6 + [1] * 6 + [2] * 6
    for length in (128, 256, 512):
        assert f"eval/loss_{length}" in scalars and f"eval/mlm_acc_{length}" in scalars
    losses = [v for _, v in scalars["train/loss"]]
    assert_traces_equal(losses, trace(run), tol=1e-6)


def test_sigusr2_saves_and_requeue_status_then_resume_exact(small_shards, tmp_path, reference):
    run = tmp_path / "run"
    # slow each step a little so that the signal lands mid-run
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4", "trainer.log_every=1"),
                    env={"ROFORMER_STEP_DELAY_S": "0.3"})  # log_every=1: each step's record as it ends
    _wait_for_step(run, 2, proc)
    os.kill(_rank_pids(proc)[1], signal.SIGUSR2)   # one rank only: the ranks must agree
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_REQUEUE, out
    latest = (run / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    assert 2 <= stopped_at < 18
    assert len(trace(run)) == stopped_at
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)


def test_kill_9_between_checkpoints_resumes_from_last_complete(small_shards, tmp_path, reference):
    run = tmp_path / "run"
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4", "trainer.log_every=1"),
                    env={"ROFORMER_STEP_DELAY_S": "0.3"})  # log_every=1: each step's record as it ends
    _wait_for_step(run, 9, proc)
    os.kill(_rank_pids(proc)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    # checkpoints at 4, 6 (end of stage 1) and 8; killed after step 9, before the next one at 12
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "resuming from" in (run / "logs" / "rank0.log").read_text()
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)


def test_crash_inside_a_save_keeps_previous_latest(small_shards, tmp_path, reference):
    run = tmp_path / "run"
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4"),
                    env={"ROFORMER_CRASH_IN_SAVE_AT": "12"})
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000008"
    assert (ckpts / "step_00000012").is_dir() and not (ckpts / "step_00000012" / "COMPLETE").exists()
    proc = _run_cli(_cli_overrides(small_shards, run, "trainer.save_every=4"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    log = (run / "logs" / "rank0.log").read_text()
    assert "ignoring incomplete checkpoint" in log and "step_00000012" in log
    assert_traces_equal(trace(reference), trace(run), tol=1e-6)


# --------------------------------------------------------------------------- elastic


def _loaded_weights(rank, world_size, run):
    """Set up a trainer (which resumes ``run``, resolved by the test) and return the full fp32 weights it loaded."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner

    from roformer_dist.launch.build import build_trainer
    from roformer_dist.launch.entry import init_distributed
    from roformer_dist.runtime.process_group import DistEnv

    env = DistEnv.from_environ()
    cfg = run.cfg
    init_distributed(cfg, env)
    tr = build_trainer(run, env)
    params = dict(tr.engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=cfg.deepspeed.zero_stage == 3):
        weights = {k: v.detach().float().clone() for k, v in params.items()}
    tr.close()
    return weights, tr.state.step, tr.run.elastic


@pytest.mark.parametrize("stage, before, after", [(2, 2, 1), (3, 2, 1), (2, 1, 2)])
def test_elastic_resume_other_world_size(small_shards, tmp_path, stage, before, after):
    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    run = tmp_path / "run"
    cfg = make_cfg(small_shards, run, STAGES_1, f"deepspeed.zero_stage={stage}", "trainer.stop_at_step=3",
                   world_size=before)
    train(cfg)
    _, saved = load_checkpoint_weights(run / "checkpoints" / "step_00000003")
    resumed = make_cfg(small_shards, run, STAGES_1, f"deepspeed.zero_stage={stage}", world_size=after)
    from roformer_dist.launch.resolved import resolve_run

    weights, step, elastic = run_distributed(_loaded_weights, world_size=after, args=(resolve_run(resumed),),
                                             timeout=300)[0]
    assert step == 3 and elastic
    for name, w in weights.items():
        torch.testing.assert_close(w, saved[name], rtol=0, atol=0, msg=f"{name} changed across the conversion")
    # and training continues to the end on the new world size
    assert train(resumed) == [EXIT_DONE] * after
    assert len(trace(run)) == 8
    log = (run / "logs" / "rank0.log").read_text()
    assert f"world size changed {before} -> {after}" in log


# --------------------------------------------------------------------------- non-finite


def test_nan_loss_is_skipped_and_counted(small_shards, tmp_path):
    run = tmp_path / "run"
    cfg = make_cfg(small_shards, run, STAGES_1, "trainer.stop_at_step=5")
    assert train(cfg, env={"ROFORMER_INJECT_NAN_AT": "3"}) == [0, 0]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False, True, False, False]
    assert recs[2]["loss"] is None
    # every record says when its step ended and how long the runner took (bench/e2e.py times steps by them)
    times = [r["time"] for r in recs]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert all(0 < r["step_time_s"] <= b - a + 1e-3 for r, a, b in zip(recs[1:], times, times[1:]))
    # the skipped step changed nothing: weights after step 3 equal weights after step 2
    ref = tmp_path / "ref"
    cfg2 = make_cfg(small_shards, ref, STAGES_1, "trainer.stop_at_step=2")
    train(cfg2)
    from roformer_dist.checkpoint.store import read_trainer_state
    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    run3 = tmp_path / "run3"
    train(make_cfg(small_shards, run3, STAGES_1, "trainer.stop_at_step=3"), env={"ROFORMER_INJECT_NAN_AT": "3"})
    _, w2 = load_checkpoint_weights(ref / "checkpoints" / "step_00000002")
    _, w3 = load_checkpoint_weights(run3 / "checkpoints" / "step_00000003")
    for k in w2:
        torch.testing.assert_close(w3[k], w2[k], rtol=0, atol=0)
    assert read_trainer_state(run3 / "checkpoints" / "step_00000003", 0).trainer.nonfinite_total == 1


def test_too_many_nonfinite_losses_stop_with_checkpoint(small_shards, tmp_path):
    from roformer_dist.runtime.stop import EXIT_NONFINITE

    run = tmp_path / "run"
    cfg = make_cfg(small_shards, run, STAGES_1, "trainer.max_nonfinite_steps=2")
    assert train(cfg, env={"ROFORMER_INJECT_NAN_AT": "3,4"}) == [EXIT_NONFINITE] * 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert "consecutive non-finite" in (run / "logs" / "rank0.log").read_text()


# --------------------------------------------------------------------------- export


def test_to_hf_from_zero3_checkpoint_matches_our_logits(small_shards, tmp_path):
    transformers = pytest.importorskip("transformers")
    from roformer_dist.checkpoint.weights import load_checkpoint_weights
    from roformer_dist.nn.model import RoFormerForMaskedLM

    run = tmp_path / "run"
    train(make_cfg(small_shards, run, STAGES_1, "deepspeed.zero_stage=3", "trainer.stop_at_step=2"))
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.convert", "to-hf", "--checkpoint",
                        str(run / "checkpoints" / "step_00000002"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    mcfg, sd = load_checkpoint_weights(run / "checkpoints" / "step_00000002")
    ours = RoFormerForMaskedLM(mcfg)
    ours.load_state_dict(sd, strict=False)
    ours.eval()
    hf = transformers.RoFormerForMaskedLM.from_pretrained(out).eval()
    ids = torch.randint(5, mcfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- model parallelism


def test_tensor_x_pipeline_trains_like_one_rank_resumes_and_exports(small_shards, tmp_path):
    """4 ranks as tensor 2 x pipeline 2 (data 1, ZeRO-1) through the trainer and a two-stage curriculum:
    the loss trace of 1 rank, stop/resume, and a consolidated HF export with the 1-rank model's logits."""
    transformers = pytest.importorskip("transformers")
    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    stages = ("curriculum.stages=[{name: a, seq_len: 128, global_batch_size: 8, steps: 2, micro_batch_size: 4}, "
              "{name: b, seq_len: 256, global_batch_size: 8, steps: 2, micro_batch_size: 2}]")
    common = (stages, "deepspeed.zero_stage=1", "data.num_workers=1", "data.eval_shards=")
    one = make_cfg(small_shards, tmp_path / "one", *common, world_size=1)
    assert train(one) == [EXIT_DONE]
    tp_pp = tmp_path / "tp_pp"
    four = make_cfg(small_shards, tp_pp, *common, "parallel.tensor=2", "parallel.pipeline=2", world_size=4)
    assert train(replace_stop(four, 3)) == [EXIT_DONE] * 4   # stop inside stage b
    assert train(four) == [EXIT_DONE] * 4
    assert_traces_equal(trace(tmp_path / "one"), trace(tp_pp), tol=1e-4)
    assert trace(tp_pp, "seq_len") == [128, 128, 256, 256]
    assert trace(tp_pp, "accumulation") == [2, 2, 4, 4]

    _, plain = load_checkpoint_weights(tmp_path / "one" / "checkpoints" / "step_00000004")
    mcfg, merged = load_checkpoint_weights(tp_pp / "checkpoints" / "step_00000004")
    for name, w in plain.items():
        torch.testing.assert_close(merged[name], w, rtol=0, atol=1e-4, msg=name)
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.convert", "to-hf", "--checkpoint",
                        str(tp_pp / "checkpoints" / "step_00000004"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from roformer_dist.nn.model import RoFormerForMaskedLM

    ours = RoFormerForMaskedLM(mcfg)
    ours.load_state_dict(plain, strict=False)
    hf = transformers.RoFormerForMaskedLM.from_pretrained(out).eval()
    ids = torch.randint(5, mcfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours.eval()(ids).logits, rtol=0, atol=1e-3)


def replace_stop(cfg, step):
    from roformer_dist.config import replace

    return replace(cfg, **{"trainer.stop_at_step": step})
