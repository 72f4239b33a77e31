"""Pure schedule: stage_at / lr_at table tests on the presets."""

import math

import pytest

from roformer_dist.config import OptimConfig, StageConfig, load_config
from roformer_dist.plan.curriculum import lr_at, schedule_phases, stage_at, stage_boundaries, total_steps


@pytest.fixture(scope="module")
def paper():
    return load_config(overrides=["model=base", "curriculum=paper_zh"]).curriculum.stages


@pytest.mark.parametrize("step, index, seq_len, batch", [
    (0, 0, 512, 256), (199_999, 0, 512, 256), (200_000, 1, 1536, 256), (212_499, 1, 1536, 256),
    (212_500, 2, 256, 256), (332_499, 2, 256, 256), (332_500, 3, 128, 512), (412_499, 3, 128, 512),
    (412_500, 4, 1536, 256), (422_499, 4, 1536, 256), (422_500, 5, 512, 512), (452_499, 5, 512, 512),
])
def test_stage_at_paper(paper, step, index, seq_len, batch):
    at = stage_at(paper, step)
    assert (at.index, at.stage.seq_len, at.stage.global_batch_size) == (index, seq_len, batch)


def test_paper_totals(paper):
    assert total_steps(paper) == 452_500
    assert stage_boundaries(paper) == [200_000, 212_500, 332_500, 412_500, 422_500, 452_500]
    with pytest.raises(ValueError, match="past the end"):
        stage_at(paper, 452_500)
    with pytest.raises(ValueError):
        stage_at(paper, -1)


def test_grow_preset_holds_tokens_per_stage_roughly_equal():
    stages = load_config(overrides=["model=base", "curriculum=grow_128_1536"]).curriculum.stages
    assert [s.seq_len for s in stages] == [128, 256, 512, 1024, 1536]
    tokens = [s.steps * s.global_batch_size * s.seq_len for s in stages]
    assert max(tokens) / min(tokens) < 1.05


def test_stable_decay_preset_decays_exactly_over_its_last_stage_at_the_lower_masking_rate():
    cfg = load_config(overrides=["model=base", "curriculum=stable_decay", "optim.schedule=wsd",
                                 "optim.decay_shape=1-sqrt", "optim.min_lr_ratio=0.02"])
    stages = cfg.curriculum.stages
    assert [s.seq_len for s in stages] == [128, 256, 512, 512]
    assert [s.mlm_probability for s in stages] == [0.3, 0.3, 0.3, 0.15]
    phases = {name: (lo, hi) for name, lo, hi, _ in schedule_phases(cfg.optim, stages)}
    last_start = stage_boundaries(stages)[-2]
    assert phases["decay"] == (last_start + 1, total_steps(stages))
    assert lr_at(cfg.optim, stages, last_start - 1) == cfg.optim.lr
    assert lr_at(cfg.optim, stages, last_start) < cfg.optim.lr


STAGES = (StageConfig(name="a", seq_len=128, global_batch_size=8, steps=10),
          StageConfig(name="b", seq_len=256, global_batch_size=8, steps=10),
          StageConfig(name="c", seq_len=512, global_batch_size=8, steps=10, lr=5e-4, warmup_steps=4))


@pytest.mark.parametrize("step, expected", [
    (0, 1e-3 * 1 / 5), (4, 1e-3), (5, 1e-3), (6, 1e-3 * (1 - 1 / 24)), (19, 1e-3 * (1 - 14 / 24)),
    (20, 5e-4 * 1 / 4), (23, 5e-4), (29, 5e-4),
])
def test_lr_linear_with_stage_rewarmup(step, expected):
    optim = OptimConfig(lr=1e-3, warmup_steps=5, schedule="linear")
    assert lr_at(optim, STAGES, step) == pytest.approx(expected)


def test_lr_cosine_and_constant_and_floor():
    stages = (StageConfig(seq_len=128, global_batch_size=8, steps=101),)
    cos = OptimConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(cos, stages, 0) == pytest.approx(1.0)
    assert lr_at(cos, stages, 50) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cos, stages, 100) == pytest.approx(0.1)
    const = OptimConfig(lr=2.0, warmup_steps=10, schedule="constant")
    assert lr_at(const, stages, 4) == pytest.approx(1.0)
    assert lr_at(const, stages, 100) == pytest.approx(2.0)
    lin = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(lin, stages, 100) == pytest.approx(0.0)
    assert all(lr_at(lin, stages, s) >= lr_at(lin, stages, s + 1) for s in range(100))


def test_every_lr_schedule_the_config_offers_has_a_shape():
    """A new schedule is one entry in curriculum.SCHEDULES and its name in config.LRSchedule."""
    from roformer_dist.config import DecayShape, LRSchedule, choices
    from roformer_dist.plan.curriculum import SCHEDULES

    assert set(SCHEDULES) == set(choices(LRSchedule)) - {"wsd"} | set(choices(DecayShape))
    for name, shape in SCHEDULES.items():
        assert shape(2.0, 0.2, 0.0) == 2.0, name             # the peak right after the warmup
        assert shape(2.0, 0.2, 1.0) in (0.2, 2.0), name      # the floor at the end (constant: the peak)


WSD_STAGES = (StageConfig(name="a", seq_len=128, global_batch_size=8, steps=12),
              StageConfig(name="b", seq_len=256, global_batch_size=4, steps=8))


@pytest.mark.parametrize("shape, fall", [
    ("linear", lambda p: 1 - p), ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ("1-sqrt", lambda p: 1 - math.sqrt(p)),
])
def test_wsd_warms_up_holds_the_peak_then_decays_over_its_last_steps_to_the_floor(shape, fall):
    """20 steps, 4 of warmup, a decay of 5: steps 0-3 climb, 4-14 hold 2.0, 15-19 fall (by the shape's
    formula, progress 1/5 ... 5/5) to 0.2 at the last step."""
    optim = OptimConfig(lr=2.0, warmup_steps=4, schedule="wsd", decay_steps=5, decay_shape=shape, min_lr_ratio=0.1)
    trace = [lr_at(optim, WSD_STAGES, s) for s in range(20)]
    expected = [2.0 * (s + 1) / 4 for s in range(4)] + [2.0] * 11 + [0.2 + 1.8 * fall(k / 5) for k in range(1, 6)]
    assert trace == pytest.approx(expected)
    assert trace[-1] == pytest.approx(0.2) and trace[14] == 2.0 > trace[15]
    by_fraction = OptimConfig(lr=2.0, warmup_steps=4, schedule="wsd", decay_fraction=0.25, decay_shape=shape,
                              min_lr_ratio=0.1)
    assert [lr_at(by_fraction, WSD_STAGES, s) for s in range(20)] == trace  # 25 % of 20 steps: the same 5


def test_the_schedule_line_names_each_phase_in_steps_and_tokens():
    from roformer_dist.plan.curriculum import describe_schedule

    optim = OptimConfig(lr=2.0, warmup_steps=4, schedule="wsd", decay_steps=5, min_lr_ratio=0.1)
    # tokens: stage a 8 x 128 = 1,024 a step (steps 1-12), stage b 4 x 256 = 1,024 a step (steps 13-20)
    assert describe_schedule(optim, WSD_STAGES) == (
        "lr schedule wsd (1-sqrt decay), peak 2, floor 0.2: warmup steps 1-4 (4,096 tokens), stable steps 5-15 "
        "(11,264 tokens), decay steps 16-20 (5,120 tokens)")
    lin = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear")
    # 10 x 1,024 + 10 x 2,048 + 10 x 4,096 tokens
    assert describe_schedule(lin, STAGES) == ("lr schedule linear, peak 1, floor 0: decay steps 1-30 (71,680 tokens)"
                                             "; stage(s) c set their own lr")


@pytest.mark.parametrize("overrides, match", [
    (["optim.decay_steps=19"], r"optim.decay_steps: the wsd decay \(19 steps\) and optim.warmup_steps \(4\) are "
                               r"longer than the run \(18 steps"),
    (["optim.decay_fraction=1.5"], r"optim.decay_fraction: expected a value in \(0, 1\], got 1.5"),
    (["optim.decay_shape=exp"], r"optim.decay_shape.*'exp'"),
    (["optim.decay_steps=-1"], r"optim.decay_steps"),
])
def test_bad_wsd_settings_are_refused_naming_the_key(overrides, match):
    from roformer_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config("configs/experiments/debug.yaml", overrides=["optim.schedule=wsd", *overrides])


def test_a_stage_lr_inside_the_wsd_decay_is_refused():
    from roformer_dist.config import replace, validate
    from roformer_dist.errors import ConfigError

    cfg = load_config("configs/experiments/debug.yaml", overrides=["optim.schedule=wsd", "optim.decay_steps=4"])
    stages = cfg.curriculum.stages
    validate(replace(cfg, **{"curriculum.stages": (replace(stages[0], lr=5e-4), *stages[1:])}))  # before it: fine
    last = replace(cfg, **{"curriculum.stages": (*stages[:2], replace(stages[2], lr=5e-4))})
    with pytest.raises(ConfigError, match=r"curriculum.stages\[2\] \(s512\).lr: the stage sets its own lr within "
                                          r"the wsd decay \(steps 15-18\)"):
        validate(last)
