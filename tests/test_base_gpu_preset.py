"""configs/experiments/base_gpu.yaml, the preset a GPU user starts from: loaded by the real config loader it is
the base model in bf16 under ZeRO-2 on NCCL, one stage at 512 tokens without gradient accumulation, packed
documents kept apart and no dropout; and its micro-batch is the largest power of two that the dry run's memory
estimate lets into an 80 GB GPU (twice that does not fit there, and does on a 141 GB part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from roformer_dist.config import load_config, stage_plans
from roformer_dist.errors import EXIT_CONFIG

PRESET = Path(__file__).resolve().parent.parent / "configs" / "experiments" / "base_gpu.yaml"


def test_the_preset_is_the_base_model_in_bf16_under_zero2_on_nccl():
    cfg = load_config(PRESET)
    m = cfg.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads) == (768, 12, 12)
    assert m.hidden_dropout_prob == m.attention_probs_dropout_prob == 0
    assert (cfg.deepspeed.precision, cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer) == ("bf16", 2, "none")
    assert cfg.dist.backend == "nccl" and cfg.dist.world_size == 1
    assert cfg.data.packing == "document" and cfg.data.shards
    assert cfg.trainer.compile is False  # its comment says why; bench/gpu_check.sh measures the compiled run
    (plan,) = stage_plans(cfg, 1)
    assert plan.seq_len == 512 and plan.accumulation == 1
    assert plan.global_batch_size == plan.micro_batch_size and plan.micro_batch_size & (plan.micro_batch_size - 1) == 0


def _stage(micro_batch: int) -> str:
    return (f"curriculum.stages=[{{name: s512, seq_len: 512, global_batch_size: {micro_batch}, "
            f"micro_batch_size: {micro_batch}, steps: 10}}]")


def test_the_dry_run_fits_its_micro_batch_into_80gb_and_not_twice_that(small_shards, tmp_path, capsys):
    """``roformer-train --config base_gpu.yaml --dry-run --gpu-memory 80GB`` on CPU (a real shard set for the
    vocabulary): exit 0, every stage fits; twice the micro-batch is refused on 80 GB and fits 141 GB."""
    from roformer_dist.cli.train import main

    micro = stage_plans(load_config(PRESET), 1)[0].micro_batch_size
    base = ["--config", str(PRESET), f"data.shards={small_shards.dir}", f"run_dir={tmp_path / 'run'}"]

    assert main([*base, "--dry-run", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("s512 "))
    assert "DOES NOT FIT" not in out and int(row[2]) == micro
    assert micro <= int(row[-1]) < 2 * micro  # the largest micro-batch that fits: this one, not its double

    assert main([*base, _stage(2 * micro), "--dry-run", "--gpu-memory", "80GB"]) == EXIT_CONFIG
    assert "set curriculum.stages[0].micro_batch_size to at most" in capsys.readouterr().err
    assert main([*base, _stage(2 * micro), "--dry-run", "--gpu-memory", "141GB"]) == 0
    assert "DOES NOT FIT" not in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("maskless", [True, False], ids=["flex-or-varlen", "block-diagonal-mask"])
def test_the_micro_batch_fits_80gb_at_the_papers_vocabulary(maskless):
    """At the paper's 50000 words, with or without a kernel that spares the S x S mask of packed documents."""
    from roformer_dist.train.memory_estimate import HEADROOM, estimate_stage

    cfg = load_config(PRESET, ["model.vocab_size=50000"])
    (plan,) = stage_plans(cfg, 1)
    e = estimate_stage(cfg, plan, 1, "cuda", maskless)
    assert e.total <= 80e9 * (1 - HEADROOM) < e.total_at(2 * plan.micro_batch_size)
