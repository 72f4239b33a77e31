"""configs/experiments/base_gpu.yaml, the preset a GPU user starts from: loaded by the real config loader it is
the base model in bf16 under ZeRO-2 on NCCL, one stage at 512 tokens without gradient accumulation, packed
documents kept apart and no dropout; and its micro-batch is the largest power of two that the dry run's memory
estimate lets into an 80 GB GPU (twice that does not fit there, and does on a 141 GB part)."""

from __future__ import annotations

import re
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
    from roformer_dist.launch.memory_estimate import HEADROOM, estimate_stage

    cfg = load_config(PRESET, ["model.vocab_size=50000"])
    (plan,) = stage_plans(cfg, 1)
    e = estimate_stage(cfg, plan, 1, "cuda", maskless)
    assert e.total <= 80e9 * (1 - HEADROOM) < e.total_at(2 * plan.micro_batch_size)


# ------------------------------------------------------------------ docs/guides/pretraining.md: N x 8 GPUs

GUIDE = PRESET.parent.parent.parent / "docs" / "guides" / "pretraining.md"
RECOMMENDED = PRESET.parent / "base_pretrain.yaml"


def _guide_table() -> list[dict]:
    """The rows of the guide's table of batch, learning rate and warm-up by GPU count."""
    lines = [x for x in GUIDE.read_text(encoding="utf-8").splitlines() if x.startswith("| ")]
    head, *rows = ([c.strip().replace("`", "") for c in x.strip("|").split("|")] for x in lines[:1] + lines[2:])
    rows = [dict(zip(head, r)) for r in rows]
    return [r for r in rows if r.get("GPUs", "").isdigit()]


def test_the_guides_table_is_what_the_dry_run_resolves_at_8_32_and_64_gpus(small_shards, tmp_path, capsys):
    """Each row of docs/guides/pretraining.md's table, given to ``roformer-train --dry-run --gpu-memory 80GB``
    with the recommended config: every stage has the row's global batch and micro-batch (no accumulation), the
    schedule peaks at its lr after its warm-up, which holds the same tokens at every size, and the steps and
    the tokens are the row's and the same at every size; each stage fits."""
    from roformer_dist.cli.train import main

    rows = _guide_table()
    assert [r["GPUs"] for r in rows] == ["8", "32", "64"]
    tokens = set()
    for r in rows:
        gpus, batch, micro = int(r["GPUs"]), int(r["global batch"]), int(r["micro-batch per GPU (--dry-run)"])
        assert gpus == 8 * int(r["nodes"])
        args = ["--config", str(RECOMMENDED), f"curriculum={r['curriculum=']}", f"optim.lr={r['optim.lr']}",
                f"optim.warmup_steps={r['optim.warmup_steps']}", f"dist.world_size={gpus}",
                f"data.shards={small_shards.dir}", f"run_dir={tmp_path / 'run'}", "--dry-run", "--gpu-memory", "80GB"]
        assert main(args) == 0
        out = capsys.readouterr().out
        stages = [x for x in out.splitlines() if re.match(r"\s*stage \d+ '", x)]
        assert len(stages) == 4 and all(f"global batch {batch}, micro-batch {micro}, accumulation 1" in x
                                        for x in stages), out
        lr = float(r["optim.lr"])
        schedule = next(x for x in out.splitlines() if "lr schedule wsd" in x)
        warm = int(r["optim.warmup_steps"])
        assert f"peak {lr:g}," in schedule and f"warmup steps 1-{warm} (" in schedule, schedule
        assert schedule.rstrip(")").endswith(f"-{r['steps']} (3,276,800,000 tokens"), schedule
        tokens.add((warm * batch, int(r["steps"]) * batch))
        assert "DOES NOT FIT" not in out
    assert len(tokens) == 1, f"warm-up and total tokens differ between the rows: {tokens}"
    assert not (tmp_path / "run").exists()


def test_the_guides_context_extension_fork_is_a_valid_config():
    """Step 5's overrides (an inline 1024-token stage with its rotary base) load and pass the checks."""
    block = GUIDE.read_text(encoding="utf-8").split("--fork /shared/runs/base")[1].split("```")[0]
    overrides = re.findall(r"'([^']+)'|(\S+=\S+)", block)
    items = [a or b for a, b in overrides if not (a or b).startswith(("run_dir=", "data."))]
    cfg = load_config(RECOMMENDED, items)
    (stage,) = cfg.curriculum.stages
    assert (stage.seq_len, stage.rope_theta, cfg.optim.lr) == (1024, 40000, 5e-5)
    assert stage.seq_len <= cfg.model.max_position_embeddings
