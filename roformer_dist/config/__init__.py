"""The one config tree of roformer-dist: its schema, loading, validation and the values derived from it.

Owns: ``schema.py`` (the frozen dataclasses, one per section, a docstring under each field; the ``Literal``
choice types and ``choices``), ``load.py`` (defaults <- YAML file <- ``key.sub=value`` overrides; presets in
``CONFIGS_DIR``; type coercion; ``build``, the one dict -> dataclass builder; ``from_dict``, ``to_dict``,
``dump_yaml``, ``save_config``, ``replace``), ``validate.py`` (one validator per section and ``validate``;
every user error is a :class:`~roformer_dist.errors.ConfigError` naming the key), ``derived.py`` (values
computed from a config in one place: micro-batch and data-parallel sizes, the rotary settings in force
(``RopeSettings``), each stage's plan (``StagePlan``), the training sources, the metric sinks in force, the run
directory mode).

The SLURM section's schema is here; what of it may be written into a batch script is the launcher's rule
(``launcher/slurm_settings.py``), since only the launcher writes one.

May import: ``roformer_dist.errors``, ``data_pipeline.mixture`` (source names), ``data_pipeline.atomic``
(``save_config``), yaml and the standard library; nothing else of the package (every layer above reads it).

Start reading at ``schema.py``; ``load.load_config`` is the entry point. This module is the front door:
import from ``roformer_dist.config``, not from its modules.
"""

from roformer_dist.config.derived import (ROPE_KEYS, RopeSettings, StagePlan, data_parallel_size, effective_sinks,
                                          micro_batch_size, parse_lengths, parse_mode, rope_settings, stage_plans,
                                          stage_override_keys, stage_overrides,
                                          training_sources, wsd_decay_steps)
from roformer_dist.config.load import (CONFIGS_DIR, PRESET_DIRS, build, dump_yaml, fork_overrides, from_dict,
                                       load_config, parse_overrides, replace, save_config, to_dict)
from roformer_dist.config.schema import (DEFAULT_RUN_DIR_MODE, CheckpointConfig, Config,
                                         CurriculumConfig, DataConfig, DeepSpeedConfig, DistBackend, DistConfig,
                                         DecayShape, DocumentAttention, DocumentPositions, EvalSourceConfig,
                                         HiddenAct, InitConfig, LoggingConfig, LogLevel, LRSchedule, MlflowSettings,
                                         ModelConfig, NewRows,
                                         OffloadDevice, OptimConfig, SpikePolicy, WandbMode, WandbSettings,
                                         OptimizerName, Packing, ParallelConfig, PositionEmbedding, Precision,
                                         ProfileConfig, RopeScaling, RotaryBackend, SlurmConfig, SourceConfig,
                                         StageConfig, TrainerConfig, ZeroStage, choices)
from roformer_dist.config.validate import (check_tensor_split, validate, validate_layout, validate_model,
                                           validate_rope)
from roformer_dist.errors import ConfigError

__all__ = [
    # schema
    "Config", "ModelConfig", "SourceConfig", "EvalSourceConfig", "DataConfig", "StageConfig", "CurriculumConfig",
    "InitConfig", "OptimConfig", "DeepSpeedConfig", "ParallelConfig", "DistConfig", "ProfileConfig",
    "TrainerConfig", "CheckpointConfig", "LoggingConfig", "WandbSettings", "MlflowSettings", "SlurmConfig",
    "DEFAULT_RUN_DIR_MODE", "WandbMode", "SpikePolicy",
    "HiddenAct", "PositionEmbedding", "RopeScaling", "NewRows", "RotaryBackend", "Packing",
    "DocumentAttention", "DocumentPositions", "OptimizerName", "LRSchedule", "DecayShape", "ZeroStage", "Precision",
    "OffloadDevice",
    "DistBackend", "LogLevel", "choices",
    # loading
    "CONFIGS_DIR", "PRESET_DIRS", "load_config", "parse_overrides", "fork_overrides", "build", "from_dict", "to_dict", "dump_yaml",
    "save_config", "replace",
    # validation
    "validate", "validate_model", "validate_rope", "validate_layout", "check_tensor_split", "ConfigError",
    # derived values
    "data_parallel_size", "micro_batch_size", "ROPE_KEYS", "RopeSettings", "rope_settings", "StagePlan", "stage_plans",
    "stage_override_keys", "stage_overrides",
    "training_sources", "effective_sinks", "parse_mode", "parse_lengths", "wsd_decay_steps",
]
