"""Validation of the config tree: one function per section, each raising
:class:`~roformer_dist.errors.ConfigError` for the first bad key.

``validate`` checks every section, then the combinations (stages vs positions, batch vs world size, heads vs
hidden size, ...) before any process is spawned. A rule that combines sections lives with the section it
constrains: every parallel-layout rule in ``validate_layout``, stage lengths and micro-batches in
``_validate_curriculum``. The model checks its own config with ``validate_model``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal, Optional

from data_pipeline.mixture import SOURCE_NAME
from roformer_dist.config.derived import (RopeSettings, data_parallel_size, micro_batch_size, parse_mode, rope_settings,
                                          stage_override_keys, stage_overrides,
                                          training_sources, wsd_decay_steps)
from roformer_dist.config.schema import (CheckpointConfig, Config, DataConfig, DeepSpeedConfig, InitConfig,
                                         LoggingConfig, LogLevel, ModelConfig, OptimConfig, RopeScaling, SlurmConfig,
                                         TrainerConfig, choice_error, choices)
from roformer_dist.errors import ConfigError

# One function per section; the rules that combine sections (positions vs stages, layout vs model and
# ZeRO) live with the section they constrain: ``validate_layout`` holds every parallel-layout rule.


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: expected a {'non-negative' if allow_zero else 'positive'} value, got {value!r}")


def _check_choices(section: Any, prefix: str) -> None:
    """Every choice-typed field of a section holds one of its values (also for configs made with
    ``replace``, which skips the loader's coercion)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if typing.get_origin(hints[f.name]) is Literal:
            allowed = choices(hints[f.name])
            value = getattr(section, f.name)
            if value not in allowed or (isinstance(value, bool) and not isinstance(allowed[0], bool)):
                raise choice_error(f"{prefix}.{f.name}", allowed, value)


def validate_model(m: ModelConfig) -> None:
    """The model section on its own (the model checks its config with this too)."""
    _check_choices(m, "model")
    if isinstance(m.vocab_size, str):
        if m.vocab_size != "auto":
            raise ConfigError(f"model.vocab_size: expected a positive integer or 'auto', got {m.vocab_size!r}")
    else:
        _positive(m.vocab_size, "model.vocab_size")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size"):
        _positive(getattr(m, key), f"model.{key}")
    if m.embedding_size is not None:
        _positive(m.embedding_size, "model.embedding_size")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.num_attention_heads: {m.num_attention_heads} does not divide model.hidden_size {m.hidden_size}")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model.num_attention_heads: head size hidden_size/heads must be even for rotary pairs")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not 0.0 <= getattr(m, key) < 1.0:
            raise ConfigError(f"model.{key}: expected a probability in [0, 1), got {getattr(m, key)}")
    validate_rope(rope_settings(m), m, "model")


def validate_rope(rope: RopeSettings, m: ModelConfig, where: str) -> None:
    """``rope`` (:func:`rope_settings`) makes sense for model ``m``; errors name ``where`` (model or a stage)."""
    theta, kind, factor = rope.rope_theta, rope.rope_scaling, rope.rope_scaling_factor
    original = rope.rope_original_max_position
    if kind not in choices(RopeScaling):
        raise ConfigError(f"{where}.rope_scaling: expected one of {', '.join(choices(RopeScaling))}, got {kind!r}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 1.0):
        raise ConfigError(f"{where}.rope_theta: expected a number > 1, got {theta!r}")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
        raise ConfigError(f"{where}.rope_scaling_factor: expected a number >= 1 (how many times longer), "
                          f"got {factor!r}")
    if kind == "none" and factor != 1.0:
        raise ConfigError(f"{where}.rope_scaling_factor: {factor} has no effect with rope_scaling none; choose "
                          "linear, ntk or yarn")
    if original is not None:
        _positive(original, f"{where}.rope_original_max_position")
    if kind != "none" and m.position_embedding != "rotary":
        raise ConfigError(f"{where}.rope_scaling: {kind} needs model.position_embedding rotary")


def _validate_sources(cfg: Config) -> None:
    d = cfg.data
    if d.sources and d.shards:
        raise ConfigError("data.sources: give data.shards (one shard set) or data.sources (a mixture), not both")
    names = []
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(f"{key}.name: expected letters, digits, '_' or '-', got {s.name!r}")
        if s.name in names:
            raise ConfigError(f"{key}.name: {s.name!r} is given twice")
        names.append(s.name)
        if not s.shards:
            raise ConfigError(f"{key}.shards: source {s.name!r} has no shard set")
        if s.weight is None and d.size_alpha is None and len(d.sources) > 1:
            raise ConfigError(f"{key}.weight: source {s.name!r} has no weight (give each source a weight, or "
                              "data.size_alpha to weigh them by size)")
        if s.weight is not None and not 0 <= s.weight < float("inf"):
            raise ConfigError(f"{key}.weight: expected a finite number >= 0, got {s.weight!r}")
        if s.max_epochs is not None and not s.max_epochs > 0:
            raise ConfigError(f"{key}.max_epochs: expected a positive number, got {s.max_epochs!r}")
    if d.sources and sum(s.weight or 0 for s in d.sources) <= 0 and d.size_alpha is None:
        raise ConfigError("data.sources: the weights sum to 0; expected a positive sum")
    if d.size_alpha is not None and not 0 <= d.size_alpha <= 1:
        raise ConfigError(f"data.size_alpha: expected a value in [0, 1], got {d.size_alpha!r}")
    known = [s.name for s in training_sources(d)]
    for i, st in enumerate(cfg.curriculum.stages):
        for name, w in st.weights.items():
            key = f"curriculum.stages[{i}].weights.{name}"
            if name not in known:
                raise ConfigError(f"{key}: no source {name!r} (the sources are {', '.join(known) or 'none'})")
            if not 0 <= w < float("inf"):
                raise ConfigError(f"{key}: expected a finite number >= 0, got {w!r}")
    eval_names = []
    for i, e in enumerate(d.eval_sources):
        key = f"data.eval_sources[{i}]"
        if not SOURCE_NAME.fullmatch(e.name) or e.name in eval_names:
            raise ConfigError(f"{key}.name: expected a new name of letters, digits, '_' or '-', got {e.name!r}")
        if not e.shards:
            raise ConfigError(f"{key}.shards: eval source {e.name!r} has no shard set")
        if e.batches is not None:
            _positive(e.batches, f"{key}.batches")
        eval_names.append(e.name)


def _validate_data(d: DataConfig) -> None:
    _check_choices(d, "data")
    for key in ("mlm_probability", "eval_mlm_probability"):
        _rate(getattr(d, key), f"data.{key}")
    split = d.mask_replace
    if len(split) != 3 or any(not isinstance(x, (int, float)) or x < 0 for x in split) or \
            not math.isclose(sum(split), 1.0, abs_tol=1e-6):
        raise ConfigError(f"data.mask_replace: expected three shares >= 0 of the chosen tokens ([MASK], random, "
                          f"unchanged) that sum to 1, got {list(split)}")
    _positive(d.num_workers, "data.num_workers", allow_zero=True)
    _positive(d.url_retries, "data.url_retries")
    _positive(d.url_retry_wait_s, "data.url_retry_wait_s", allow_zero=True)
    _positive(d.url_timeout_s, "data.url_timeout_s")


def _rate(value: Any, key: str) -> None:
    """A masking rate: a number in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ConfigError(f"{key}: expected a masking rate in (0, 1), got {value!r}")


def _validate_optim(o: OptimConfig) -> None:
    _check_choices(o, "optim")
    _positive(o.lr, "optim.lr")
    _positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: expected a value in [0, 1], got {o.min_lr_ratio}")
    _positive(o.decay_steps, "optim.decay_steps", allow_zero=True)
    if not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"optim.decay_fraction: expected a value in (0, 1], got {o.decay_fraction}")


def _validate_wsd(o: OptimConfig, stages) -> None:
    """A wsd decay fits in the run after the warmup, and no stage's own lr overrides it (after the curriculum
    is checked)."""
    if o.schedule != "wsd":
        return
    total = sum(st.steps for st in stages)
    decay = wsd_decay_steps(o, total)
    key = "optim.decay_steps" if o.decay_steps else "optim.decay_fraction"
    if o.warmup_steps + decay > total:
        raise ConfigError(f"{key}: the wsd decay ({decay} steps) and optim.warmup_steps ({o.warmup_steps}) are "
                          f"longer than the run ({total} steps of curriculum.stages)")
    start = 0
    for i, st in enumerate(stages):
        if st.lr is not None and start + st.steps > total - decay:
            raise ConfigError(f"curriculum.stages[{i}] ({st.name}).lr: the stage sets its own lr within the wsd "
                              f"decay (steps {total - decay + 1}-{total}), which would override it; drop the "
                              "stage's lr or shorten the decay")
        start += st.steps


def _validate_deepspeed(d: DeepSpeedConfig) -> None:
    _check_choices(d, "deepspeed")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = getattr(d, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"deepspeed.{key}: expected a positive number of elements, got {value!r}")
    if d.offload_optimizer == "cpu" and d.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer: cpu offload needs deepspeed.zero_stage >= 1")


def check_tensor_split(m: ModelConfig, tensor: int) -> None:
    """Tensor parallelism splits heads, the FFN and the vocabulary ``tensor`` ways: they must divide."""
    if tensor == 1:
        return
    if m.num_attention_heads % tensor:
        raise ConfigError(f"parallel.tensor: {tensor} does not divide model.num_attention_heads "
                          f"{m.num_attention_heads}")
    if m.intermediate_size % tensor:
        raise ConfigError(f"parallel.tensor: {tensor} does not divide model.intermediate_size "
                          f"{m.intermediate_size}")
    if isinstance(m.vocab_size, int) and m.vocab_size < 2 * tensor:
        raise ConfigError(f"parallel.tensor: {tensor} too large for model.vocab_size {m.vocab_size}")


def _check_compilable(cfg: Config) -> None:
    """The layouts ``trainer.compile`` does not cover."""
    if not cfg.trainer.compile:
        return
    if cfg.parallel.pipeline > 1:
        raise ConfigError("trainer.compile: pipeline stages (parallel.pipeline > 1) are not compiled; set "
                          "trainer.compile=false or parallel.pipeline=1")
    if cfg.parallel.tensor > 1:
        raise ConfigError("trainer.compile: tensor parallelism (parallel.tensor > 1) is not compiled (its "
                          "collectives inside autograd functions are not traced); set trainer.compile=false "
                          "or parallel.tensor=1")
    if cfg.deepspeed.zero_stage == 3:
        raise ConfigError("trainer.compile: ZeRO-3 (deepspeed.zero_stage=3) is not compiled (DeepSpeed's "
                          "parameter-gathering hooks are excluded from compilation: the static graph breaks); "
                          "set trainer.compile=false or deepspeed.zero_stage <= 2")


def validate_layout(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every rule of the parallel layout: world size vs tensor x pipeline, ZeRO vs pipeline/tensor,
    pipeline stages vs layers, heads/FFN/vocabulary vs tensor (``parallel.topology`` relies on it)."""
    p, d, m = cfg.parallel, cfg.deepspeed, cfg.model
    _positive(p.tensor, "parallel.tensor")
    _positive(p.pipeline, "parallel.pipeline")
    ws = cfg.dist.world_size if world_size is None else world_size
    _positive(ws, "dist.world_size")
    _check_choices(cfg.dist, "dist")
    _positive(cfg.dist.straggler_log_steps, "dist.straggler_log_steps")
    if not cfg.dist.straggler_factor > 1:
        raise ConfigError(f"dist.straggler_factor: {cfg.dist.straggler_factor:g} must be above 1 (a multiple of the "
                          "ranks' median time)")
    hang = cfg.dist.hang_timeout_s
    if not 0 <= hang < cfg.dist.timeout_s:
        raise ConfigError(f"dist.hang_timeout_s: {hang:g} must be 0 (off) or positive and below dist.timeout_s "
                          f"({cfg.dist.timeout_s}), when a collective gives up on its own")
    first = cfg.dist.first_step_timeout_s
    if not 0 <= first < cfg.dist.timeout_s:
        raise ConfigError(f"dist.first_step_timeout_s: {first:g} must be 0 or positive and below dist.timeout_s "
                          f"({cfg.dist.timeout_s}): a rank done compiling waits for the others in a collective, "
                          "which gives up after dist.timeout_s")
    if ws % (p.tensor * p.pipeline):
        raise ConfigError(
            f"dist.world_size: {ws} is not divisible by parallel.tensor x parallel.pipeline = {p.tensor * p.pipeline}")
    _check_compilable(cfg)
    if p.pipeline > 1 and cfg.trainer.spike != "none":
        raise ConfigError(f"trainer.spike: {cfg.trainer.spike} is not supported with pipeline parallelism "
                          "(parallel.pipeline > 1): DeepSpeed's pipeline engine computes the loss inside its schedule")
    if p.pipeline > 1 and d.zero_stage > 1:
        raise ConfigError("deepspeed.zero_stage: pipeline parallelism (parallel.pipeline > 1) supports ZeRO 0 or 1 only")
    if p.pipeline > m.num_hidden_layers:
        raise ConfigError(
            f"parallel.pipeline: {p.pipeline} stages but model.num_hidden_layers is {m.num_hidden_layers}")
    check_tensor_split(m, p.tensor)
    if p.tensor > 1 and d.zero_stage == 3:
        # ZeRO-3 would partition each tensor shard again across the data ranks; its checkpoint
        # consolidation (zero_to_fp32) knows only one model-parallel rank.
        raise ConfigError("deepspeed.zero_stage: 3 is not supported with parallel.tensor > 1; use 1 or 2")


def _validate_curriculum(cfg: Config, world_size: Optional[int] = None) -> None:
    c, m = cfg.curriculum, cfg.model
    if not c.stages:
        raise ConfigError("curriculum.stages: expected at least one stage")
    _positive(c.tokens_per_micro_batch, "curriculum.tokens_per_micro_batch")
    ws = cfg.dist.world_size if world_size is None else world_size
    dp = data_parallel_size(cfg, ws)
    for i, st in enumerate(c.stages):
        key = f"curriculum.stages[{i}] ({st.name})"
        _positive(st.steps, f"{key}.steps")
        _positive(st.global_batch_size, f"{key}.global_batch_size")
        if st.seq_len <= 0 or st.seq_len % 8:
            raise ConfigError(f"{key}.seq_len: expected a positive multiple of 8, got {st.seq_len}")
        if st.seq_len > m.max_position_embeddings:
            raise ConfigError(f"{key}.seq_len: {st.seq_len} is longer than model.max_position_embeddings "
                              f"{m.max_position_embeddings}")
        for ln in st.eval_lengths:
            if ln <= 0 or ln % 8 or ln > m.max_position_embeddings:
                raise ConfigError(f"{key}.eval_lengths: {ln} must be a positive multiple of 8 <= "
                                  f"model.max_position_embeddings {m.max_position_embeddings}")
        if st.micro_batch_size is None and st.seq_len > c.tokens_per_micro_batch:
            # the derived micro-batch would be one sequence larger than the memory budget
            raise ConfigError(f"{key}.seq_len: {st.seq_len} tokens exceed curriculum.tokens_per_micro_batch "
                              f"{c.tokens_per_micro_batch}: raise the budget or set the stage's micro_batch_size")
        mbs = micro_batch_size(cfg, st, ws)
        _positive(mbs, f"{key}.micro_batch_size")
        if st.global_batch_size % (mbs * dp):
            raise ConfigError(
                f"{key}.global_batch_size: {st.global_batch_size} is not a multiple of micro_batch_size {mbs} x "
                f"data-parallel size {dp} (dist.world_size {ws} / (parallel.tensor x parallel.pipeline))")
        if st.lr is not None:
            _positive(st.lr, f"{key}.lr")
        _check_overrides(cfg, st, key)


SECTION_CHECKS = {"model": lambda cfg: validate_model(cfg.model), "data": lambda cfg: _validate_data(cfg.data),
                  "optim": lambda cfg: _validate_optim(cfg.optim)}
"""The checks a stage's own value of a setting of that section goes through."""


def _check_overrides(cfg: Config, st, key: str) -> None:
    """A stage's own values of run settings (``schema.stage_override``) checked together, as the run's settings are:
    the section's checks on the config with the stage's values in; an error names the stage's field."""
    own = stage_overrides(st)
    if not own:
        return
    names = {target: name for name, target in stage_override_keys().items()}
    by_section: dict[str, dict] = {}
    for target, value in own.items():
        section, name = target.split(".")
        by_section.setdefault(section, {})[name] = value
    as_stage = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **values)
                                           for s, values in by_section.items()})
    for section in sorted(by_section):
        try:
            SECTION_CHECKS[section](as_stage)
        except ConfigError as e:
            message = str(e)
            for target in sorted(own, key=len, reverse=True):  # model.rope_scaling_factor before model.rope_scaling
                message = message.replace(target, f"{key}.{names[target]}")
            raise ConfigError(message) from None


def _validate_init(i: InitConfig) -> None:
    _check_choices(i, "init")
    if i.load_optimizer and not i.from_:
        raise ConfigError("init.load_optimizer: true needs init.from (the checkpoint whose optimizer state to take)")
    _positive(i.decay_steps, "init.decay_steps", allow_zero=True)
    if i.decay_steps and not i.from_:
        raise ConfigError("init.decay_steps: a decay branch needs init.from (the checkpoint to decay from; "
                          "roformer-train --fork PARENT --decay STEPS)")


def _validate_trainer(t: TrainerConfig) -> None:
    _check_choices(t, "trainer")
    for key in ("stop_at_step", "save_every", "eval_every"):
        _positive(getattr(t, key), f"trainer.{key}", allow_zero=True)
    _positive(t.log_every, "trainer.log_every")
    _positive(t.max_nonfinite_steps, "trainer.max_nonfinite_steps")
    _positive(t.spike_window, "trainer.spike_window")
    _positive(t.spike_max, "trainer.spike_max")
    if not t.spike_factor > 1:
        raise ConfigError(f"trainer.spike_factor: {t.spike_factor:g} must be above 1 (a multiple of the median loss)")
    if t.spike == "rollback" and not t.save_every:
        raise ConfigError("trainer.spike: rollback reloads the newest checkpoint before a spike, and "
                          "trainer.save_every is 0 (no checkpoints during the run): set it, or use trainer.spike: skip")
    _positive(t.profile.start_step, "trainer.profile.start_step", allow_zero=True)
    _positive(t.profile.steps, "trainer.profile.steps")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _positive(c.keep_last, "checkpoint.keep_last")


def _validate_logging(lg: LoggingConfig) -> None:
    _check_choices(lg.wandb, "logging.wandb")
    if lg.level.upper() not in choices(LogLevel):
        raise choice_error("logging.level", choices(LogLevel), lg.level)
    # which names are sinks is the sink table's business (roformer_dist/observe/sinks/), checked when a run starts
    if not isinstance(lg.sinks, (tuple, list)):
        raise ConfigError(f"logging.sinks: expected a list of sink names, got {lg.sinks!r}")
    for name in lg.sinks:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"logging.sinks: expected non-empty sink names, got {name!r} in {list(lg.sinks)}")
        if lg.sinks.count(name) > 1:
            raise ConfigError(f"logging.sinks: {name!r} is given twice in {list(lg.sinks)}")


def _validate_slurm(s: SlurmConfig) -> None:
    """The job's shape; what may be written into a batch script is checked by the launcher, which writes it
    (``launcher/slurm_settings.py``: character sets, one line per value, ``$NAME`` only)."""
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
        _positive(getattr(s, key), f"slurm.{key}")
    if s.signal_delay_s >= s.time_min * 60:
        raise ConfigError(f"slurm.signal_delay_s: {s.signal_delay_s} s is not shorter than slurm.time_min "
                          f"{s.time_min} min")
    both = sorted(set(s.env) & set(s.env_from))
    if both:
        raise ConfigError(f"slurm.env_from.{both[0]}: also set in slurm.env; give it in one of them")


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every section, then the layout and the curriculum at ``world_size`` (default: dist.world_size).
    Raises ConfigError naming the first bad key."""
    parse_mode(cfg.run_dir_mode)
    validate_model(cfg.model)
    _validate_data(cfg.data)
    _validate_sources(cfg)
    _validate_optim(cfg.optim)
    _validate_deepspeed(cfg.deepspeed)
    if cfg.optim.name == "lamb" and cfg.deepspeed.zero_stage > 0:
        # DeepSpeed asserts on it (its ZeRO-tested optimizers exclude LAMB), and rightly: under ZeRO-1-3 each
        # rank's optimizer sees flat partitions of all the parameters, so LAMB's per-layer trust ratio would be
        # computed over slices that cross layers
        raise ConfigError(f"deepspeed.zero_stage: {cfg.deepspeed.zero_stage} does not go with optim.name lamb: under "
                          "ZeRO the optimizer sees flat partitions that cut across layers, and LAMB's per-layer "
                          "trust ratio would be computed over them (DeepSpeed refuses it as untested); set "
                          "deepspeed.zero_stage=0 for LAMB, or optim.name=adamw")
    validate_layout(cfg, world_size)
    _validate_curriculum(cfg, world_size)
    _validate_wsd(cfg.optim, cfg.curriculum.stages)
    _validate_init(cfg.init)
    _validate_trainer(cfg.trainer)
    _validate_checkpoint(cfg.checkpoint)
    _validate_logging(cfg.logging)
    _validate_slurm(cfg.slurm)
