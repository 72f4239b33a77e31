"""Pure schedule: stage_at / lr_at table tests on the presets."""

import math

import pytest

from roformer_dist.config import OptimConfig, StageConfig, load_config
from roformer_dist.train.curriculum import lr_at, stage_at, stage_boundaries, total_steps


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
    from roformer_dist.config import LRSchedule, choices
    from roformer_dist.train.curriculum import SCHEDULES

    assert set(SCHEDULES) == set(choices(LRSchedule))
    for name, shape in SCHEDULES.items():
        assert shape(2.0, 0.2, 0.0) == 2.0, name             # the peak right after the warmup
        assert shape(2.0, 0.2, 1.0) in (0.2, 2.0), name      # the floor at the end (constant: the peak)
