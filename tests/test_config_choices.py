"""Typed config choices (one Literal per choice, read by the loader, the validator and the code that
dispatches on it), the per-section validation, the layout rules in one place, the long presets."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from roformer_dist import config as C
from roformer_dist.config import ConfigError, load_config, replace, validate

DEBUG = C.CONFIGS_DIR / "experiments" / "debug.yaml"


def choice_fields():
    """(dotted key, allowed values) of every choice-typed field of the config tree."""
    out = []
    for section in dataclasses.fields(C.Config):
        cls = typing.get_type_hints(C.Config)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        for name, tp in typing.get_type_hints(cls).items():
            if typing.get_origin(tp) is typing.Literal:
                out.append((f"{section.name}.{name}", typing.get_args(tp)))
    return out


def test_fixed_value_fields_are_typed():
    keys = {k for k, _ in choice_fields()}
    assert {"model.hidden_act", "model.position_embedding", "model.rotary_backend",
            "deepspeed.precision", "optim.schedule", "optim.name", "deepspeed.zero_stage",
            "dist.backend"} <= keys
    # model.attention's names are the kinds' table's (nn/attention_kinds), checked where the model is built
    assert "model.attention" not in keys


@pytest.mark.parametrize("key, allowed", choice_fields(), ids=[k for k, _ in choice_fields()])
def test_every_choice_rejects_other_values_naming_the_key(key, allowed):
    with pytest.raises(ConfigError, match=rf"{key}: expected one of {', '.join(map(str, allowed))}"):
        load_config(DEBUG, [f"{key}=bogus"])
    # the same check on a config built without the loader (dataclasses.replace skips coercion)
    with pytest.raises(ConfigError, match=key):
        validate(replace(load_config(DEBUG), **{key: "bogus"}))
    # and every allowed value is accepted by the loader (world-size rules aside)
    for value in allowed:
        try:
            assert getattr(getattr(load_config(DEBUG, [f"{key}={value}"]), key.split(".")[0]),
                           key.split(".")[1]) == value
        except ConfigError as e:
            assert key not in str(e).split(":")[0], e  # another key's rule, e.g. offload needs ZeRO >= 1


def test_choice_values_are_converted_to_the_choices_type():
    assert load_config(DEBUG, ["deepspeed.zero_stage=3"]).deepspeed.zero_stage == 3
    assert load_config(DEBUG, ["deepspeed.zero_stage='1'"]).deepspeed.zero_stage == 1
    with pytest.raises(ConfigError, match="deepspeed.zero_stage"):
        load_config(DEBUG, ["deepspeed.zero_stage=true"])  # a bool is not stage 1


def test_dispatch_tables_cover_exactly_the_choices():
    from roformer_dist.nn.model import ACTIVATIONS
    from roformer_dist.nn.rotary import BACKENDS

    assert tuple(ACTIVATIONS) == C.choices(C.HiddenAct)
    assert BACKENDS == C.choices(C.RotaryBackend)
    from roformer_dist.nn.attention_kinds import ATTENTION

    assert tuple(ATTENTION) == ("softmax", "linear")


def test_model_checks_its_config_with_the_validator():
    from roformer_dist.nn.model import RoFormerForMaskedLM

    with pytest.raises(ConfigError, match="model.attention"):
        RoFormerForMaskedLM(C.ModelConfig(vocab_size=10, hidden_size=8, num_attention_heads=2,
                                          attention="performer"))
    with pytest.raises(ConfigError, match="model.num_attention_heads"):
        RoFormerForMaskedLM(C.ModelConfig(vocab_size=10, hidden_size=12, num_attention_heads=4))  # head size 3


def test_layout_rules_live_in_validate_layout():
    """topology's Layout and the tensor-parallel wrapper use the config's rules (ConfigError, key named)."""
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.tensor import TensorParallelMLM
    from roformer_dist.parallel.topology import Layout

    cfg = load_config(DEBUG)
    with pytest.raises(ConfigError, match="dist.world_size"):
        Layout.from_config(replace(cfg, **{"parallel.tensor": 2}), 3)
    with pytest.raises(ConfigError, match="deepspeed.zero_stage"):
        Layout.from_config(replace(cfg, **{"parallel.pipeline": 2}), 2)  # debug uses ZeRO-2
    model = RoFormerForMaskedLM(dataclasses.replace(cfg.model, vocab_size=50))
    with pytest.raises(ConfigError, match="parallel.tensor: 3 does not divide model.num_attention_heads"):
        TensorParallelMLM(model, 0, 3, None)


def test_long_curriculum_needs_positions_and_a_budget():
    cfg = load_config(overrides=["model=base_linear", "curriculum=long_8192"])
    assert cfg.model.attention == "linear" and cfg.model.max_position_embeddings == 8192
    assert [s.seq_len for s in cfg.curriculum.stages] == [512, 1536, 4096, 8192]
    # the same curriculum with the paper's 1536 positions is refused, naming the stage and the key
    with pytest.raises(ConfigError, match=r"len4096.*seq_len: 4096 is longer than model.max_position_embeddings"):
        load_config(overrides=["model=base", "curriculum=long_8192"])
    # a token budget below one sequence would make a micro-batch over budget: refused, naming the budget
    with pytest.raises(ConfigError, match=r"len8192.*curriculum.tokens_per_micro_batch 4096"):
        load_config(overrides=["model=base_linear", "curriculum=long_8192",
                               "curriculum.tokens_per_micro_batch=4096"])
    # an explicit micro-batch is the user's choice
    cfg = load_config(overrides=["model=base_linear", "curriculum.tokens_per_micro_batch=4096",
                                 "curriculum.stages=[{name: s, seq_len: 8192, global_batch_size: 4, steps: 1, "
                                 "micro_batch_size: 1}]"])
    assert C.micro_batch_size(cfg, cfg.curriculum.stages[0]) == 1


def test_validation_is_one_function_per_section():
    """Each section's rules sit in their own function: a bad value in one section is caught by that
    section's validator alone."""
    cfg = load_config(DEBUG)
    bad_model = dataclasses.replace(cfg.model, hidden_dropout_prob=1.5)
    with pytest.raises(ConfigError, match="model.hidden_dropout_prob"):
        C.validate_model(bad_model)
    C.validate_layout(replace(cfg, **{"model.hidden_dropout_prob": 1.5}))  # not the layout's business
    with pytest.raises(ConfigError, match="parallel.pipeline"):
        C.validate_layout(replace(cfg, **{"parallel.pipeline": 4, "deepspeed.zero_stage": 1}), 4)
