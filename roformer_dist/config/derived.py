"""Values computed from a config, each in one place: the data-parallel size, a stage's micro-batch, the
rotary settings in force (:class:`RopeSettings`), each stage's plan (:class:`StagePlan`: micro-batch,
accumulation, rotary settings, masking rate), the training mixture, the metric sinks in force, the run
directory mode, the decay steps of a ``wsd`` schedule.

Code that needs one of these calls the function here rather than recomputing it; ``validate.py`` checks the
config with the same functions.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from data_pipeline.mixture import DEFAULT_NAME
from roformer_dist.config.schema import Config, DataConfig, LoggingConfig, ModelConfig, OptimConfig, RopeScaling, \
    SourceConfig, StageConfig
from roformer_dist.errors import ConfigError


def data_parallel_size(cfg: Config, world_size: Optional[int] = None) -> int:
    ws = cfg.dist.world_size if world_size is None else world_size
    return ws // (cfg.parallel.tensor * cfg.parallel.pipeline)


def micro_batch_size(cfg: Config, stage: StageConfig, world_size: Optional[int] = None) -> int:
    """Micro-batch of a stage: explicit, or the token budget divided by seq_len, made to divide the batch."""
    if stage.micro_batch_size is not None:
        return stage.micro_batch_size
    dp = max(1, data_parallel_size(cfg, world_size))
    per_rank = max(1, stage.global_batch_size // dp)
    mbs = max(1, min(per_rank, cfg.curriculum.tokens_per_micro_batch // stage.seq_len))
    while per_rank % mbs:
        mbs -= 1
    return mbs


@dataclass(frozen=True)
class RopeSettings:
    """The rotary settings in force (no parameters): the model's, overridden per curriculum stage. The fields
    carry the config's key names, so ``dataclasses.replace(model_cfg, **rope.to_dict())`` puts them into a
    ModelConfig; ``config.validate_rope`` checks them."""
    rope_theta: float = ModelConfig.rope_theta
    rope_scaling: RopeScaling = ModelConfig.rope_scaling
    rope_scaling_factor: float = ModelConfig.rope_scaling_factor
    rope_original_max_position: Optional[int] = ModelConfig.rope_original_max_position

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "rotary settings") -> "RopeSettings":
        """From a mapping of the config's keys (a missing key takes the default); an unknown key is a
        ValueError naming ``where``."""
        unknown = sorted(set(data) - set(ROPE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(ROPE_KEYS)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "RopeSettings":
        return dataclasses.replace(self, **changes)


ROPE_KEYS = tuple(f.name for f in dataclasses.fields(RopeSettings))
"""The config keys of the rotary settings, in a ModelConfig and (as overrides) in a StageConfig."""


def rope_settings(m: ModelConfig, stage: Optional[StageConfig] = None) -> RopeSettings:
    """The rotary settings in force: the model's, with a stage's own values (not None) over them."""
    out = {k: getattr(m, k) for k in ROPE_KEYS}
    if stage is not None:
        out.update({k: getattr(stage, k) for k in ROPE_KEYS if getattr(stage, k) is not None})
    return RopeSettings(**out)


def stage_override_keys() -> dict[str, str]:
    """Each StageConfig field that overrides a run setting, with the setting's key (``schema.stage_override``)."""
    return {f.name: f.metadata["overrides"] for f in dataclasses.fields(StageConfig) if "overrides" in f.metadata}


def stage_overrides(stage: StageConfig) -> dict[str, Any]:
    """The run settings ``stage`` sets itself, by the setting's key (``{"data.mlm_probability": 0.3}``)."""
    return {key: getattr(stage, name) for name, key in stage_override_keys().items()
            if getattr(stage, name) is not None}


def stage_settings(cfg: Config, stage: StageConfig) -> dict[str, Any]:
    """Every overridable setting's value in ``stage``: its own, else the run's."""
    own = stage_overrides(stage)
    return {key: own[key] if key in own else getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            for key in stage_override_keys().values()}


@dataclass(frozen=True)
class StagePlan:
    """One curriculum stage as the ranks run it: its config and the values derived from it at the run's
    world size, computed once (:func:`stage_plans`)."""
    index: int
    stage: StageConfig
    micro_batch_size: int
    accumulation: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    rope: RopeSettings
    mlm_probability: float
    """The masking rate of the stage's batches."""
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Every setting a stage may override (``schema.stage_override``), by key: the stage's value or the run's."""

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def seq_len(self) -> int:
        return self.stage.seq_len

    @property
    def global_batch_size(self) -> int:
        return self.stage.global_batch_size


def stage_plans(cfg: Config, world_size: Optional[int] = None) -> tuple[StagePlan, ...]:
    """Every curriculum stage's :class:`StagePlan` at ``world_size`` (default dist.world_size)."""
    dp = max(1, data_parallel_size(cfg, world_size))
    out = []
    for i, st in enumerate(cfg.curriculum.stages):
        mbs = micro_batch_size(cfg, st, world_size)
        settings = stage_settings(cfg, st)
        out.append(StagePlan(i, st, mbs, max(1, st.global_batch_size // (mbs * dp)), rope_settings(cfg.model, st),
                             settings["data.mlm_probability"], settings))
    return tuple(out)


def training_sources(d: DataConfig) -> tuple[SourceConfig, ...]:
    """The training mixture: data.sources, or data.shards as one source named ``main`` (weight 1)."""
    return d.sources or ((SourceConfig(DEFAULT_NAME, d.shards, 1.0),) if d.shards else ())


def effective_sinks(lg: LoggingConfig) -> tuple[str, ...]:
    """The metric sinks in force: ``jsonl`` (the run's record, always on) first, then ``logging.sinks`` in
    their order, without ``tensorboard`` when ``logging.tensorboard`` is false."""
    rest = (s for s in lg.sinks if s != "jsonl" and (lg.tensorboard or s != "tensorboard"))
    return ("jsonl", *rest)


def parse_mode(text: str, key: str = "run_dir_mode") -> int:
    """``"0750"`` -> 0o750; the owner must keep rwx (the run writes there). ConfigError naming ``key``.
    The one parser of ``run_dir_mode`` (runtime/rundir.py, roformer-submit's umask)."""
    if not isinstance(text, str) or not re.fullmatch(r"0[0-7]{3}", text):
        raise ConfigError(f"{key}: expected an octal mode with its leading 0 such as 0750 (quoted in YAML: "
                          f"'0750'), got {text!r}")
    mode = int(text, 8)
    if mode & 0o700 != 0o700:
        raise ConfigError(f"{key}: {text} takes from the owner the rwx a run needs on its own directory")
    return mode


def parse_lengths(text: str) -> list[int]:
    """The argparse type of a list of sequence lengths, ``"512,1024,1536"`` -> [512, 1024, 1536]: positive
    multiples of 8, as the trainer takes them (``roformer-eval --lengths``, the benches)."""
    import argparse

    try:
        lengths = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    bad = [n for n in lengths if n < 8 or n % 8]
    if not lengths or bad:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not a positive multiple of 8")
    return lengths


def wsd_decay_steps(optim: OptimConfig, total: int) -> int:
    """The decay steps of ``schedule: wsd`` in a run of ``total`` steps: ``optim.decay_steps``, or
    ``optim.decay_fraction`` of ``total`` (rounded, at least 1)."""
    return optim.decay_steps or max(1, round(optim.decay_fraction * total))
