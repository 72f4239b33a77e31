"""The config tree: presets, overrides, dump/load round trip, and every rejection naming its key."""

import subprocess
import sys

import pytest
import yaml

from roformer_dist.config import (CONFIGS_DIR, Config, dump_yaml, from_dict, load_config, micro_batch_size,
                                  save_config)

DEBUG = CONFIGS_DIR / "experiments" / "debug.yaml"


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.vocab_size == "auto"


def test_experiment_composes_presets():
    cfg = load_config(DEBUG)
    preset = yaml.safe_load((CONFIGS_DIR / "model" / "debug.yaml").read_text())
    assert cfg.model.hidden_size == preset["hidden_size"]
    assert [s.seq_len for s in cfg.curriculum.stages] == [128, 256, 512]
    assert cfg.deepspeed.zero_stage == 2 and cfg.dist.world_size == 2


@pytest.mark.parametrize("name", ["debug", "tiny", "small", "base", "large"])
def test_model_presets_load(name):
    cfg = load_config(overrides=[f"model={name}"])
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0


def test_base_and_large_are_the_papers_sizes():
    base = load_config(overrides=["model=base"]).model
    assert (base.num_hidden_layers, base.hidden_size, base.num_attention_heads, base.intermediate_size,
            base.max_position_embeddings) == (12, 768, 12, 3072, 1536)
    large = load_config(overrides=["model=large"]).model
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads,
            large.intermediate_size) == (24, 1024, 16, 4096)


def test_overrides_convert_types():
    cfg = load_config(DEBUG, ["model.hidden_size=96", "optim.lr=3e-4", "logging.tensorboard=false",
                              "model.embedding_size=32", "model.vocab_size=8000", "run_dir=/tmp/x"])
    assert cfg.model.hidden_size == 96 and isinstance(cfg.model.hidden_size, int)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.logging.tensorboard is False
    assert cfg.model.embedding_size == 32 and cfg.model.vocab_size == 8000
    assert cfg.run_dir == "/tmp/x"


def test_override_can_swap_a_preset_and_refine_it():
    cfg = load_config(DEBUG, ["model=small", "model.num_hidden_layers=2"])
    assert cfg.model.hidden_size == 256 and cfg.model.num_hidden_layers == 2


def test_section_mapping_with_preset_key(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("model: {preset: debug, hidden_size: 96}\ncurriculum: debug\n")
    cfg = load_config(f)
    assert cfg.model.hidden_size == 96 and cfg.model.num_hidden_layers == 2


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(DEBUG, ["model.embedding_size=32", "slurm.setup=[module load cuda]",
                              "slurm.env={NCCL_DEBUG: WARN}"])
    again = from_dict(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_curriculum_presets_paper_stages():
    cfg = load_config(overrides=["model=base", "curriculum=paper_zh"])
    got = [(s.seq_len, s.global_batch_size, s.steps) for s in cfg.curriculum.stages]
    assert got == [(512, 256, 200000), (1536, 256, 12500), (256, 256, 120000), (128, 512, 80000),
                   (1536, 256, 10000), (512, 512, 30000)]


@pytest.mark.parametrize("override, key", [
    ("no_such.key=1", "no_such"),
    ("model.no_such=1", "model.no_such"),
    ("model.hidden_size=abc", "model.hidden_size"),
    ("model.hidden_size=1.5", "model.hidden_size"),
    ("logging.tensorboard=maybe", "logging.tensorboard"),
    ("model.num_attention_heads=3", "model.num_attention_heads"),
    ("model.vocab_size=lots", "model.vocab_size"),
    ("model.hidden_act=swish", "model.hidden_act"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
    ("deepspeed.precision=fp8", "deepspeed.precision"),
    ("data.mlm_probability=1.5", "data.mlm_probability"),
    ("model.max_position_embeddings=256", "seq_len"),
    ("dist.world_size=3", "global_batch_size"),
    ("dist.world_size=3 parallel.tensor=2", "dist.world_size"),
    ("parallel.pipeline=2 dist.world_size=2", "deepspeed.zero_stage"),
    ("parallel.pipeline=4 dist.world_size=4 deepspeed.zero_stage=1", "parallel.pipeline"),
    ("parallel.tensor=3 dist.world_size=3", "parallel.tensor"),
    ("curriculum=nope", "curriculum"),
    ("slurm.signal_delay_s=7200 slurm.time_min=60", "slurm.signal_delay_s"),
    ("deepspeed.offload_optimizer=cpu deepspeed.zero_stage=0", "deepspeed.offload_optimizer"),
    ("parallel.tensor=2 dist.world_size=2 deepspeed.zero_stage=3", "deepspeed.zero_stage"),
])
def test_rejections_name_the_key(override, key):
    with pytest.raises(ValueError) as e:
        load_config(DEBUG, override.split())
    assert key in str(e.value)


def test_stage_errors_name_the_stage(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: debug\ncurriculum:\n  stages:\n    - {name: warm, seq_len: 100, global_batch_size: 8, "
                 "steps: 2}\n")
    with pytest.raises(ValueError, match=r"warm.*seq_len.*multiple of 8"):
        load_config(f)
    f.write_text("model: debug\ncurriculum:\n  stages:\n    - {name: big, seq_len: 128, global_batch_size: 6, "
                 "steps: 2, micro_batch_size: 4}\n")
    with pytest.raises(ValueError, match=r"big.*global_batch_size: 6 is not a multiple"):
        load_config(f)


def test_bad_yaml_names_the_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml"):
        load_config(f)


def test_micro_batch_from_token_budget():
    cfg = load_config(DEBUG)
    s128, s256, s512 = cfg.curriculum.stages
    # 2048 tokens per micro-batch, global batch 8 over 2 ranks -> 4 per rank
    assert micro_batch_size(cfg, s128) == 4
    assert micro_batch_size(cfg, s256) == 4
    assert micro_batch_size(cfg, s512) == 2   # 4 sequences of 512 would exceed the budget


def test_cli_rejects_unknown_key_before_spawning():
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.train", "--config", str(DEBUG), "no_such.key=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no_such" in r.stderr


def test_cli_help_lists_usage():
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.train", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--config" in r.stdout


def test_the_hang_timeout_must_come_before_the_collective_timeout():
    from roformer_dist.config import load_config, validate
    from roformer_dist.errors import ConfigError

    validate(load_config(overrides=["dist.hang_timeout_s=0", "model.vocab_size=100"]))  # off
    for value in ("-1", "1800", "4000"):
        with pytest.raises(ConfigError, match=r"dist.hang_timeout_s: .* below dist.timeout_s \(1800\)"):
            validate(load_config(overrides=[f"dist.hang_timeout_s={value}", "model.vocab_size=100"]))
