"""``roformer-train --dry-run`` and ``roformer-submit --dry-run``: the plan and a memory estimate per GPU, nothing
written.

- The estimate's parameter count is the model's own, for every preset shape (factorised embeddings, learned
  positions included); its largest micro-batch is the largest whose estimate fits.
- The dry run resolves the run (stages, mixture, resume decision), writes nothing (no run directory, no lock),
  exits 0 when every stage fits and 2 naming the stage and its figures when one does not.
- Against measured peaks: ``bench/dry_run_memory.py --tiny`` (run by tests/test_benches.py, which asserts its
  ``"ok": true``) compares the estimate with torch's own count of a real DeepSpeed step on CPU, within 15 %.
"""

from __future__ import annotations

import pytest

from roformer_dist.config import load_config, stage_plans
from roformer_dist.errors import EXIT_CONFIG, ConfigError
from trainer_runs import make_cfg


@pytest.mark.parametrize("overrides", [["model=debug"], ["model=demo"], ["model=base"],
                                       ["model=small", "model.embedding_size=128"],
                                       ["model=tiny", "model.position_embedding=absolute"]])
def test_the_estimates_parameter_count_is_the_models(overrides):
    from roformer_dist.launch.memory_estimate import parameter_count
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = load_config(None, [*overrides, "model.vocab_size=3001"])
    outer, layer = parameter_count(cfg.model)
    assert outer + layer * cfg.model.num_hidden_layers == RoFormerForMaskedLM(cfg.model).num_parameters()


def test_zero_partitions_the_states_and_the_largest_micro_batch_is_the_largest_that_fits():
    from roformer_dist.launch.memory_estimate import estimate_stage

    def at(*overrides):
        cfg = load_config(None, ["model=base", "model.vocab_size=21128", "dist.world_size=8",
                                 "deepspeed.precision=bf16", *overrides])
        return estimate_stage(cfg, stage_plans(cfg)[-1])

    z0, z2, z3 = at("deepspeed.zero_stage=0"), at("deepspeed.zero_stage=2"), at("deepspeed.zero_stage=3")
    p = z0.parameters
    assert z0.weights == 2 * p and z0.gradients == 2 * p and z0.optimizer == 12 * p and z0.buckets == 0
    assert z2.weights == 2 * p and z2.gradients == 2 * p // 8 and z2.optimizer == 12 * p // 8
    assert z3.states < z2.states < z0.states
    assert at("deepspeed.activation_checkpointing=true").activations < z2.activations
    assert at("deepspeed.offload_optimizer=cpu").optimizer == 0
    budget = 20 * 2**30
    n = z2.largest_micro_batch(budget)
    assert n > 0 and z2.total_at(n) <= budget < z2.total_at(n + 1)


def test_sizes_are_read_as_people_write_them():
    from roformer_dist.launch.memory_estimate import parse_bytes

    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("141 GiB") == 141 * 2**30 and parse_bytes("8e9") == 8e9
    for bad in ("eighty", "80XB", "-1GB", "0"):
        with pytest.raises(ConfigError, match="--gpu-memory: expected a size such as 80GB"):
            parse_bytes(bad)


def test_a_dry_run_prints_the_plan_writes_nothing_and_refuses_a_stage_that_does_not_fit(small_shards, tmp_path,
                                                                                          capsys):
    from roformer_dist.cli.train import main

    cfg_file = tmp_path / "exp.yaml"
    from roformer_dist.config import dump_yaml
    cfg_file.write_text(dump_yaml(make_cfg(small_shards, tmp_path / "run")))

    assert main(["--config", str(cfg_file), "--dry-run", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "fresh start" in out and "s512" in out and "largest micro-batch that fits" in out
    assert "budget: 67.1 GiB of 74.5 GiB" in out and "DOES NOT FIT" not in out
    assert not (tmp_path / "run").exists()  # no run directory, no lock

    # the base model at 1536 tokens, fp32, micro-batch 16 on a 16 GB card: the last stage does not fit
    code = main(["--config", str(cfg_file), "model=base", "model.max_position_embeddings=1536",
                 "curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 32, steps: 1}, "
                 "{name: long, seq_len: 1536, global_batch_size: 32, steps: 1, micro_batch_size: 16}]",
                 "--dry-run", "--gpu-memory", "16GB"])
    captured = capsys.readouterr()
    assert code == EXIT_CONFIG
    assert "curriculum.stages[1] ('long', seq_len 1536, micro-batch 16): needs about" in captured.err
    assert "set curriculum.stages[1].micro_batch_size to at most" in captured.err
    assert "DOES NOT FIT" in captured.out and not (tmp_path / "run").exists()


def test_gpu_memory_without_a_dry_run_is_refused(small_shards, tmp_path, capsys):
    from roformer_dist.cli.train import main
    from roformer_dist.config import dump_yaml

    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text(dump_yaml(make_cfg(small_shards, tmp_path / "run")))
    assert main(["--config", str(cfg_file), "--gpu-memory", "80GB"]) == EXIT_CONFIG
    assert "--gpu-memory: only with --dry-run" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_submit_dry_run_prints_the_batch_script_and_the_plan(small_shards, tmp_path, capsys):
    from launcher.cli import main
    from roformer_dist.config import dump_yaml

    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text(dump_yaml(make_cfg(small_shards, tmp_path / "run")))
    assert main(["--config", str(cfg_file), "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "1",
                 "--dry-run", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "#SBATCH" in out
    assert "# resolved run (2 rank(s)): fresh start" in out and "largest micro-batch that fits" in out
    assert out.split("\n# dry run of ")[1].count("\n# ") >= 8  # the plan as comments: still a batch script
    assert not (tmp_path / "run").exists()


def test_packed_documents_cost_no_score_mask_where_a_kernel_takes_them_without_one():
    """On CUDA flex attention (or flash-attn's varlen) takes packed documents without an S x S mask, so the
    estimate leaves out the bias per row and layer; with attention dropout, on CPU, or with the blocks asked
    for, it stays in."""
    from roformer_dist.launch.memory_estimate import maskless as _maskless
    from roformer_dist.launch.memory_estimate import estimate_stage
    from roformer_dist.nn.documents import flash_varlen_available

    def cfg(*overrides):
        return load_config(None, ["model=base", "model.vocab_size=21128", "deepspeed.precision=bf16",
                                  "model.attention_probs_dropout_prob=0", *overrides])

    flex = cfg()
    assert _maskless(flex, "cuda") and not _maskless(flex, "cpu")
    assert not _maskless(cfg("model.document_attention=blocks"), "cuda")
    assert _maskless(cfg("model.attention_probs_dropout_prob=0.1"), "cuda") == flash_varlen_available()
    plan = stage_plans(flex)[-1]
    saved = (estimate_stage(flex, plan, maskless=False).layers_per_sample
             - estimate_stage(flex, plan, maskless=True).layers_per_sample)
    assert abs(saved - plan.seq_len ** 2 * 2 * flex.model.num_hidden_layers) <= 1   # bf16: 2 bytes per score


def test_the_reduce_buckets_follow_the_deepspeed_keys():
    """The estimate's bucket is ``deepspeed.reduce_bucket_size`` elements, two of them with ``overlap_comm``
    (ZeRO-2 double-buffers); what DeepSpeed is handed carries the same keys."""
    from roformer_dist.launch.memory_estimate import estimate_stage
    from roformer_dist.parallel.engine import deepspeed_config

    def at(*overrides):
        cfg = load_config(None, ["model=base", "model.vocab_size=21128", "deepspeed.precision=bf16", *overrides])
        plan = stage_plans(cfg)[-1]
        return estimate_stage(cfg, plan).buckets, deepspeed_config(cfg, plan)["zero_optimization"]

    default, zero = at()
    assert default == 500_000_000 * 2 and zero["reduce_bucket_size"] == 500_000_000 and not zero["overlap_comm"]
    small, zero = at("deepspeed.reduce_bucket_size=50000000", "deepspeed.allgather_bucket_size=20000000",
                     "deepspeed.overlap_comm=true")
    assert small == 2 * 50_000_000 * 2
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"], zero["overlap_comm"]) == (50_000_000,
                                                                                               20_000_000, True)
    with pytest.raises(ConfigError, match="deepspeed.reduce_bucket_size: expected a positive number"):
        at("deepspeed.reduce_bucket_size=0")
