"""The encoder recipe on real ranks: a warmup-stable-decay schedule resumed in each of its phases, and per-stage
masking rates with evaluation at a fixed rate.

- ``optim.schedule: wsd`` on the debug run (18 steps: warmup 1-4, stable 5-14, decay 15-18), stopped in the
  warmup, the stable phase and the decay and resumed each time, records the uninterrupted run's LR trace and
  losses bit for bit, and that trace is the schedule's formula.
- Stages masking 30 %, 25 %, 15 % with evaluation at 15 %: every eval scores the same predicted positions as a
  run that trains at 15 % throughout (the unigram baseline at those positions is equal), while training itself
  differs; the stage switch says the rate changed, and a resume that changes a stage's rate says so.
- Decay branches (``--fork CHECKPOINT --decay STEPS``) from a stable checkpoint: below.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from roformer_dist.config import fork_overrides, replace
from roformer_dist.errors import ConfigError
from roformer_dist.launch.resolved import resolve_run
from roformer_dist.observe.length_report import evaluate_checkpoint
from roformer_dist.runtime.events import read_scalars
from roformer_dist.runtime.stop import EXIT_DONE
from trainer_runs import flip_byte, make_cfg, records, train

WSD = ("optim.schedule=wsd", "optim.warmup_steps=4", "optim.decay_steps=4", "optim.decay_shape=1-sqrt",
       "optim.min_lr_ratio=0.1", "optim.lr=0.002", "trainer.log_every=1", "trainer.save_every=1")


def test_wsd_stopped_in_warmup_stable_and_decay_resumes_to_the_same_lr_trace_and_losses(small_shards, tmp_path):
    def run(name, *extra):
        cfg = make_cfg(small_shards, tmp_path / name, *WSD, *extra, world_size=1)
        assert train(cfg) == [EXIT_DONE]
        return records(tmp_path / name)

    full = run("full")
    peak, floor = 0.002, 0.0002
    formula = [peak * s / 4 for s in range(1, 5)] + [peak] * 10 + \
        [floor + (peak - floor) * (1 - math.sqrt(k / 4)) for k in range(1, 5)]
    assert len(full) == 18 and all(math.isclose(r["lr"], x, rel_tol=1e-9) for r, x in zip(full, formula))
    for stop_at in (3, 9, 16, 0):  # in the warmup, the stable phase, the decay; then to the end
        resumed = run("resumed", f"trainer.stop_at_step={stop_at}")
    assert [(r["step"], r["lr"], r["loss"]) for r in resumed] == [(r["step"], r["lr"], r["loss"]) for r in full]
    log = (tmp_path / "full" / "logs" / "rank0.log").read_text()
    assert "lr schedule wsd (1-sqrt decay), peak 0.002, floor 0.0002: warmup steps 1-4" in log
    assert "stable steps 5-14" in log and "decay steps 15-18" in log


def _masked_cfg(shards, run_dir, rates, *extra):
    cfg = make_cfg(shards, run_dir, "trainer.eval_every=6", "trainer.save_every=6", "data.eval_mlm_probability=0.15",
                   *extra, world_size=1)
    return replace(cfg, **{"curriculum.stages": tuple(replace(st, mlm_probability=r)
                                                      for st, r in zip(cfg.curriculum.stages, rates))})


def test_stage_masking_rates_train_while_evaluation_masks_at_its_own_fixed_rate(small_shards, tmp_path):
    high = tmp_path / "high"
    cfg = _masked_cfg(small_shards, high, (0.3, 0.25, 0.15), "trainer.stop_at_step=12")
    assert train(cfg) == [EXIT_DONE]
    # resumed at 12 with the last stage's rate changed: logged; the eval rate is unchanged
    assert train(_masked_cfg(small_shards, high, (0.3, 0.25, 0.2))) == [EXIT_DONE]
    plain = tmp_path / "plain"
    assert train(_masked_cfg(small_shards, plain, (None, None, None))) == [EXIT_DONE]

    a, b = read_scalars(high / "tb"), read_scalars(plain / "tb")
    unigram = sorted(k for k in a if k.startswith("eval/unigram_loss"))
    assert unigram and [a[k] for k in unigram] == [b[k] for k in unigram]  # the same positions scored
    assert [s for s, _ in a["eval/loss"]] == [6, 12, 18]
    assert [r["loss"] for r in records(high)][:6] != [r["loss"] for r in records(plain)][:6]  # trained otherwise
    log = (high / "logs" / "rank0.log").read_text()
    assert "stage 's256': masking 0.25 of the tokens (was 0.3)" in log
    assert "resuming with a changed setting: curriculum.stages[2].mlm_probability: 0.15 in the checkpoint, 0.2 now" \
        in log
    assert "evaluation masks 0.15 of the tokens; the chosen become [MASK], a random token, unchanged in shares " \
           "0.8/0.1/0.1" in log
    assert "masking 0.3, rope_theta" in log and "masking 0.2, rope_theta" in log  # each launch's stage plans


PARENT = ("optim.schedule=constant", "optim.warmup_steps=4", "optim.lr=0.002", "optim.min_lr_ratio=0.1",
          "trainer.log_every=1", "trainer.save_every=2", "checkpoint.keep_last=20")


def _tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_decay_branches_from_one_stable_checkpoint_carry_its_state_and_leave_it_alone(small_shards, tmp_path):
    """A constant-lr parent (18 steps) branched at step 10 into a 4-step 1-sqrt decay (stopped at 12 and
    restarted) and a 6-step linear one: each branch's step 11 computes the parent's step 11 bit for bit (the
    weights, Adam's moments, the data position and the RNG carried), its lr then falls by the formula to the
    floor at its last step, and the parent's files are untouched."""
    parent = tmp_path / "parent"
    assert train(make_cfg(small_shards, parent, *PARENT, world_size=1)) == [EXIT_DONE]
    before = _tree_digest(parent)
    at10 = parent / "checkpoints" / "step_00000010"

    def branch(name, decay, shape, *extra):
        cfg = make_cfg(small_shards, tmp_path / name, *PARENT, *fork_overrides(str(at10), decay, shape), *extra,
                       world_size=1)
        assert train(cfg) == [EXIT_DONE]
        return records(tmp_path / name)

    branch("sqrt", 4, "1-sqrt", "trainer.stop_at_step=12")
    sqrt = branch("sqrt", 4, "1-sqrt")  # the restart takes the branch point from parent.json
    linear = branch("linear", 6, "linear")
    assert _tree_digest(parent) == before
    full = {r["step"]: r for r in records(parent)}
    assert [r["step"] for r in sqrt] == [11, 12, 13, 14] and [r["step"] for r in linear] == list(range(11, 17))
    assert sqrt[0]["loss"] == linear[0]["loss"] == full[11]["loss"]
    assert sqrt[1]["loss"] != full[12]["loss"]  # the decayed lr of step 11 changed the weights
    peak, floor = 0.002, 0.0002
    assert all(math.isclose(r["lr"], floor + (peak - floor) * (1 - math.sqrt(k / 4)), rel_tol=1e-9)
               for k, r in enumerate(sqrt, 1))
    assert all(math.isclose(r["lr"], floor + (peak - floor) * (1 - k / 6), rel_tol=1e-9)
               for k, r in enumerate(linear, 1))
    record = json.loads((tmp_path / "sqrt" / "parent.json").read_text())
    assert (record["kind"], record["path"], record["step"], record["decay_steps"], record["decay_shape"]) == \
        ("checkpoint", str(at10), 10, 4, "1-sqrt")
    log = (tmp_path / "sqrt" / "logs" / "rank0.log").read_text()
    assert f"(step 12, written by 1 rank(s)); decay branch of {at10} at step 10: 4 steps of 1-sqrt decay" in log
    report = evaluate_checkpoint(tmp_path / "linear", [128], batches=1)
    assert report.step == 16 and report.origin == f"decay branch of {at10} at step 10: 6 steps of linear decay"

    # a checkpoint of the warmup (lr 0.001 at step 2) is no branch point; nor is a decay without a parent
    early = make_cfg(small_shards, tmp_path / "early", *PARENT, *fork_overrides(str(parent / "checkpoints" /
                                                                                    "step_00000002"), 4))
    with pytest.raises(ConfigError, match=r"init.decay_steps: a decay branch starts from the parent's stable "
                                          r"learning rate, but at step 2 .* the parent ran at lr 0.001"):
        resolve_run(early, read_only=True)
    with pytest.raises(ConfigError, match="--decay/--decay-shape: a decay branch needs --fork PARENT"):
        fork_overrides(None, 4)

    # a dry run of a branch from the parent run, whose newest checkpoint is damaged: it plans the branch from the
    # checkpoint before and marks nothing in the parent (a launch would mark it BAD)
    flip_byte(parent / "checkpoints" / "step_00000018" / "trainer_state_rank0.pt")
    damaged = _tree_digest(parent)
    newest = make_cfg(small_shards, tmp_path / "newest", *PARENT, *fork_overrides(str(parent), 2), world_size=1)
    assert resolve_run(newest, read_only=True).resume.branch.step == 16
    assert _tree_digest(parent) == damaged and not (tmp_path / "newest").exists()


@pytest.mark.parametrize("override, match", [
    ("data.eval_mlm_probability=1.5", r"data.eval_mlm_probability: expected a masking rate in \(0, 1\), got 1.5"),
    ("data.mlm_probability=0", r"data.mlm_probability: expected a masking rate in \(0, 1\), got 0"),
    ("data.mask_replace=[0.8,0.2]", r"data.mask_replace: expected three shares >= 0 .* got \[0.8, 0.2\]"),
    ("data.mask_replace=[0.8,0.3,0.1]", r"data.mask_replace: .*that sum to 1, got \[0.8, 0.3, 0.1\]"),
])
def test_bad_masking_settings_are_refused_naming_the_key(override, match):
    from roformer_dist.config import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("configs/experiments/debug.yaml", overrides=[override])


def test_a_bad_stage_masking_rate_is_refused_naming_the_stage():
    from roformer_dist.config import load_config, validate

    cfg = load_config("configs/experiments/debug.yaml")
    stages = cfg.curriculum.stages
    with pytest.raises(ConfigError, match=r"curriculum.stages\[1\] \(s256\).mlm_probability: expected a masking "
                                          r"rate in \(0, 1\), got 1.0"):
        validate(replace(cfg, **{"curriculum.stages": (stages[0], replace(stages[1], mlm_probability=1.0),
                                                       stages[2])}))
