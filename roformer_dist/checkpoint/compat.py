"""Can this run resume from that checkpoint? Every difference in one CheckpointError, before anything
in the run directory changes.

Compared (:func:`differences`): the model settings that change the parameters or what they compute
(all of ``model.*`` except :data:`FREE_MODEL_KEYS`), the parameter names and shapes they imply, the
model-parallel layout (tensor x pipeline; the world size may change only without it), the ZeRO stage
(0, 1-2 and 3 save different files), the tokenizer (sha256 of the shard set's model), and the
number of shards the loader position refers to, and the sources it reads (each must still be in the
mixture; their shard sets are the loader's own check). The curriculum, optimizer, logging and
checkpoint settings may change on resume.
"""

from __future__ import annotations

from typing import Any, Optional

from roformer_dist.config import ROPE_KEYS, Config, ModelConfig, build, stage_override_keys, to_dict, training_sources
from roformer_dist.errors import CheckpointError, ConfigError

FREE_MODEL_KEYS = frozenset({"rotary_backend", "hidden_dropout_prob", "attention_probs_dropout_prob",
                             "initializer_range", "document_positions", "document_attention", *ROPE_KEYS})
"""Model settings a resumed run may change: the kernels used (rotary, packed documents), dropout, the
initialiser (already used), how packed documents count positions and the rotary base and scaling (no
parameters); and, with rotary positions, max_position_embeddings (:func:`_free_keys`)."""


def _free_keys(position_embedding: str) -> frozenset:
    """FREE_MODEL_KEYS, and max_position_embeddings where positions have no parameters (rotary)."""
    return FREE_MODEL_KEYS | ({"max_position_embeddings"} if position_embedding == "rotary" else set())

_MAX_SHAPES = 8
_ZERO_FORMAT = {0: "module optimizer", 1: "partitioned optimizer", 2: "partitioned optimizer", 3: "partitioned all"}
"""How each ZeRO stage saves its state: stages of one format load each other's checkpoints."""


def _model_config(saved: dict) -> Optional[ModelConfig]:
    """The saved model section as a ModelConfig, or None when this version cannot build it."""
    try:
        return build(ModelConfig, saved)
    except ConfigError:
        return None


def parameter_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the plain model's state dict, built on the meta device (no memory, no time)."""
    import torch  # (here: the launcher imports this module, and a fresh run needs no torch there)

    from roformer_dist.nn.model import RoFormerForMaskedLM

    with torch.device("meta"):
        model = RoFormerForMaskedLM(model_cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _shape_differences(old: ModelConfig, new: ModelConfig) -> list[str]:
    try:
        a, b = parameter_shapes(old), parameter_shapes(new)
    except Exception:  # noqa: BLE001 - a saved model config this version cannot build: the keys say enough
        return []
    out = [f"{k}: {list(a[k])} in the checkpoint, {list(b[k])} now" for k in sorted(a.keys() & b.keys())
           if a[k] != b[k]]
    out += [f"{k}: in the checkpoint only" for k in sorted(a.keys() - b.keys())]
    out += [f"{k}: new in this model" for k in sorted(b.keys() - a.keys())]
    if len(out) > _MAX_SHAPES:
        out = out[:_MAX_SHAPES] + [f"... and {len(out) - _MAX_SHAPES} more parameters"]
    return out


def _get(tree: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return default
        tree = tree[k]
    return tree


def differences(saved_config: dict, saved_world_size: int, cfg: Config, world_size: int,
                saved_tokenizer: str = "", tokenizer: str = "", saved_num_shards: Optional[int] = None,
                num_shards: Optional[int] = None) -> list[str]:
    """One line per difference that forbids resuming (empty: resumable); pure."""
    out = []
    now = to_dict(cfg.model)
    old = dict(to_dict(ModelConfig()))
    old.update(saved_config.get("model") or {})
    free = _free_keys(cfg.model.position_embedding) if old.get("position_embedding") == cfg.model.position_embedding \
        else FREE_MODEL_KEYS
    for key in sorted(set(now) | set(old)):
        if key not in free and old.get(key) != now.get(key):
            out.append(f"model.{key}: {old.get(key)!r} in the checkpoint, {now.get(key)!r} now")
    if out:
        saved_model = _model_config(old)
        shapes = _shape_differences(saved_model, cfg.model) if saved_model is not None else []
        out += [f"  parameter {line}" for line in shapes]
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    old_tp = int(_get(saved_config, "parallel", "tensor", default=1))
    old_pp = int(_get(saved_config, "parallel", "pipeline", default=1))
    if (old_tp, old_pp) != (tp, pp):
        out.append(f"parallel: tensor {old_tp} x pipeline {old_pp} in the checkpoint, tensor {tp} x pipeline {pp} "
                   "now (only the data-parallel degree may change)")
    elif saved_world_size != world_size and (tp > 1 or pp > 1):
        out.append(f"world size: {saved_world_size} in the checkpoint, {world_size} now: with tensor or pipeline "
                   "parallelism the world size cannot change")
    was, new = _get(saved_config, "deepspeed", "zero_stage"), cfg.deepspeed.zero_stage
    if was is not None and _ZERO_FORMAT.get(int(was)) != _ZERO_FORMAT.get(new):
        out.append(f"deepspeed.zero_stage: {was} in the checkpoint, {new} now (their optimizer files differ; "
                   "ZeRO 1 and 2 may replace each other)")
    if saved_tokenizer and tokenizer and saved_tokenizer != tokenizer:
        out.append(f"tokenizer: sha256 {saved_tokenizer[:12]}... in the checkpoint, {tokenizer[:12]}... in "
                   f"{_first_set(cfg)}/manifest.json (shards of another tokenizer would scramble the vocabulary)")
    if saved_num_shards is not None and num_shards is not None and saved_num_shards != num_shards:
        out.append(f"data.shards: the saved loader position is in a set of {saved_num_shards} shards, "
                   f"{_first_set(cfg)} has {num_shards}")
    return out


def _first_set(cfg: Config) -> str:
    sources = training_sources(cfg.data)
    return sources[0].shards if sources else ""


CHANGEABLE = ("data.packing", "model.document_positions", "model.rotary_backend", "model.document_attention",
              "data.size_alpha", "data.mlm_probability", "data.eval_mlm_probability", "data.mask_replace",
              "model.max_position_embeddings", *(f"model.{k}" for k in ROPE_KEYS))
"""Settings that change what a resumed run computes without touching its parameters: logged when they differ
(and the mixture's weights and caps and the stages' own values of run settings, :func:`_stage_settings`)."""


def _stage_settings(config: dict) -> dict:
    """The mixture's weights and caps and each stage's own values of run settings (``schema.stage_override``: a
    masking rate, a rotary base, ...) in a config dict, by dotted key (a config that predates them: none)."""
    data = config.get("data") or {}
    out = {}
    for src in data.get("sources") or []:
        for key in ("weight", "max_epochs"):
            out[f"data.sources.{src.get('name')}.{key}"] = src.get(key)
    for i, st in enumerate(_get(config, "curriculum", "stages", default=[]) or []):
        for name, w in ((st or {}).get("weights") or {}).items():
            out[f"curriculum.stages[{i}].weights.{name}"] = w
        for name in stage_override_keys():
            out[f"curriculum.stages[{i}].{name}"] = (st or {}).get(name)
    return out


def changed_settings(saved_config: dict, cfg: Config) -> list[str]:
    """One line per :data:`CHANGEABLE` setting whose value differs from the checkpoint's (a setting the
    checkpoint predates counts with its default)."""
    out, defaults, now = [], to_dict(Config()), to_dict(cfg)
    for dotted in CHANGEABLE:
        section, key = dotted.split(".")
        was = _get(saved_config, section, key, default=defaults[section][key])
        if was != now[section][key]:
            out.append(f"{dotted}: {was!r} in the checkpoint, {now[section][key]!r} now")
    was, new = _stage_settings(saved_config), _stage_settings(now)
    for key in sorted(set(was) | set(new), key=lambda k: (k.split(".")[0], k)):
        if was.get(key) != new.get(key):
            out.append(f"{key}: {was.get(key)!r} in the checkpoint, {new.get(key)!r} now")
    return out


def check_compatible(found, state, cfg: Config, world_size: int, manifest: Optional[dict] = None) -> None:
    """Raise one CheckpointError listing every difference between checkpoint ``found`` (its rank-0
    ``TrainerState`` ``state``) and this run; nothing when it can be resumed."""
    manifest = manifest or {}
    saved_shards = _get(state.loader, "shard_set", "num_shards")
    diffs = differences(state.config, found.world_size, cfg, world_size, state.tokenizer_sha256,
                        _get(manifest, "tokenizer", "sha256", default=""),
                        int(saved_shards) if isinstance(saved_shards, int) else None,
                        len(manifest["shards"]) if isinstance(manifest.get("shards"), list) else None)
    names = {s.name for s in training_sources(cfg.data)}
    saved_sources = _get(state.loader, "sources", default={}) or {}
    diffs += [f"data.sources: the checkpoint's loader reads source {n!r}, which this config lacks (keep it: a weight "
              "of 0 pauses a source)" for n in sorted(saved_sources) if n not in names]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {found.dir}: it was written for another model or layout:\n"
            + "".join(f"  {d}\n" for d in diffs)
            + "Resume with the checkpoint's settings, or start this configuration in a new run_dir.")
