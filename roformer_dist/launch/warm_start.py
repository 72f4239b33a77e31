"""A new run's first weights from existing ones (``init.from``): a warm start, and a fork of a run of ours.

:func:`read_parent` reads what ``init.from`` names, whichever form it has:

    Hugging Face repository   a directory with ``config.json`` of ``model_type`` roformer
                              (``RoFormerForMaskedLM``) or bert (``BertForMaskedLM``: absolute positions)
    roformer-dist run         a run directory or ``checkpoints/``: its newest complete checkpoint
    checkpoint                a step directory (any ZeRO stage, any tensor x pipeline layout)
    weights file              what ``roformer-convert from-hf`` writes (``model.pt``, or its directory)

:func:`adapt` fits those weights to this run's model or raises one :class:`ConfigError` listing every
mismatch (architecture settings and parameter shapes), before anything is written. The one change it
makes: a vocabulary that grew (the new shards' tokenizer has more ids) gets its new embedding rows and
decoder biases (``init.new_rows``: the mean of the parent's rows, or the initialiser; the biases: the
mean of the parent's, or 0). The settings without parameters (rotary base and scaling, the rotary
model's max_position_embeddings, dropout, kernels, document positions) may differ and are logged.

The trainer records the parent in ``run_dir/parent.json`` (:mod:`roformer_dist.checkpoint.lineage`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch

from roformer_dist.checkpoint.compat import changed_settings, parameter_shapes
from roformer_dist.checkpoint.lineage import Parent, config_digest
from roformer_dist.checkpoint.store import read_trainer_state, resolve, state_file
from roformer_dist.checkpoint.weights import WEIGHTS_NAME, load_checkpoint_weights, load_weights
from roformer_dist.config import Config, ModelConfig, to_dict
from roformer_dist.errors import CheckpointError, ConfigError

__all__ = ["read_parent", "adapt", "warm_start", "optimizer_checkpoint"]

log = logging.getLogger(__name__)

HF_KINDS = {"roformer": "hf-roformer", "bert": "hf-bert"}
ARCHITECTURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "embedding_size", "hidden_act", "type_vocab_size", "layer_norm_eps", "rotary_value",
                     "position_embedding")
"""Model settings a warm start must share with its parent (they shape or define the parameters)."""
FREE_KEYS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_position",
             "max_position_embeddings", "attention", "document_positions", "hidden_dropout_prob",
             "attention_probs_dropout_prob", "rotary_backend", "pad_token_id")
"""Settings that may differ (no parameters, or none with rotary positions): each difference is logged."""
_EMBEDDINGS, _BIAS = "embeddings.word_embeddings.weight", "head.bias"
_MAX_SHAPES = 8


def _hf_kind(path: Path) -> Optional[str]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        model_type = json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"init.from: {cfg_file}: unreadable Hugging Face config ({e})") from None
    if model_type not in HF_KINDS:
        raise ConfigError(f"init.from: {cfg_file}: model_type {model_type!r}; a warm start reads roformer "
                          "(RoFormerForMaskedLM) or bert (BertForMaskedLM) repositories")
    return model_type


def _read_hf(path: Path, model_type: str) -> tuple[ModelConfig, dict]:
    """(ModelConfig, our state dict) of an HF repository; transformers reads it (safetensors or bin)."""
    from roformer_dist.hf.convert import read_hf_repository

    try:
        return read_hf_repository(path, model_type)
    except (OSError, ValueError) as e:
        raise ConfigError(f"init.from: {path}: transformers cannot load it ({e})") from None


def read_parent(source: str, read_only: bool = False) -> tuple[Parent, ModelConfig, dict]:
    """``(Parent, its ModelConfig, its fp32 state dict with our key names)`` of what ``init.from`` names (a
    damaged checkpoint of ours marked BAD unless ``read_only``)."""
    p = Path(source).expanduser()
    if not p.exists():
        raise ConfigError(f"init.from: {source}: no such file or directory (expected a Hugging Face repository, a "
                          "roformer-dist run or checkpoint directory, or a weights file)")
    p = p.resolve()
    if p.is_dir() and (model_type := _hf_kind(p)):
        cfg, sd = _read_hf(p, model_type)
        raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
        return Parent(HF_KINDS[model_type], str(p), config_sha256=config_digest(raw)), cfg, sd
    if p.is_file() or (p / WEIGHTS_NAME).is_file() and not state_file(p, 0).exists():
        file = p if p.is_file() else p / WEIGHTS_NAME
        try:
            cfg, sd = load_weights(file)
        except (CheckpointError, ConfigError) as e:
            raise ConfigError(f"init.from: {e}") from None
        return Parent("weights", str(file), config_sha256=config_digest(to_dict(cfg))), cfg, sd
    try:
        found = resolve(p, read_only)
        cfg, sd = load_checkpoint_weights(found)
        state = read_trainer_state(found.dir, 0)
    except CheckpointError as e:
        raise ConfigError(f"init.from: {e}") from None
    return (Parent("checkpoint", str(found.dir), found.step, config_digest(state.config), state.tokenizer_sha256,
                   found.world_size), cfg, sd)


def adapt(parent_cfg: ModelConfig, sd: dict, cfg: ModelConfig, new_rows: str = "mean", where: str = "init.from"
          ) -> tuple[dict, list[str]]:
    """``(state dict for a model of cfg, notes)``: ``sd`` fitted to ``cfg`` (a grown vocabulary), or one
    ConfigError listing every mismatch. ``notes``: what differs and was allowed, one line each."""
    problems = [f"model.{k}: {getattr(parent_cfg, k)!r} in the parent, {getattr(cfg, k)!r} in this config"
                for k in ARCHITECTURE_KEYS if getattr(parent_cfg, k) != getattr(cfg, k)]
    if cfg.position_embedding == "absolute" and parent_cfg.max_position_embeddings != cfg.max_position_embeddings:
        problems.append(f"model.max_position_embeddings: {parent_cfg.max_position_embeddings} in the parent, "
                        f"{cfg.max_position_embeddings} in this config (absolute positions are parameters)")
    old_vocab = int(sd[_EMBEDDINGS].shape[0]) if _EMBEDDINGS in sd else None
    if old_vocab is not None and old_vocab > cfg.vocab_size:
        problems.append(f"model.vocab_size: {old_vocab} in the parent, {cfg.vocab_size} in this config (a "
                        "vocabulary may grow, not shrink)")
    want = parameter_shapes(cfg)
    out = dict(sd)
    if old_vocab is not None and old_vocab < cfg.vocab_size:
        out[_EMBEDDINGS] = _grow(sd[_EMBEDDINGS], cfg.vocab_size, new_rows, cfg.initializer_range)
        if _BIAS in sd:
            out[_BIAS] = _grow(sd[_BIAS], cfg.vocab_size, "mean" if new_rows == "mean" else "zero", 0.0)
    shapes = []
    for k in sorted(want.keys() | out.keys()):
        if k not in out:
            shapes.append(f"parameter {k}: {list(want[k])} in this model, missing in the parent")
        elif k not in want:
            shapes.append(f"parameter {k}: {list(out[k].shape)} in the parent, not in this model")
        elif tuple(out[k].shape) != want[k]:
            shapes.append(f"parameter {k}: {list(out[k].shape)} in the parent, {list(want[k])} in this model")
    if len(shapes) > _MAX_SHAPES:
        shapes = shapes[:_MAX_SHAPES] + [f"... and {len(shapes) - _MAX_SHAPES} more parameters"]
    if problems or shapes:
        raise ConfigError(f"{where}: the parent does not fit this model:\n"
                          + "".join(f"  {p}\n" for p in problems + shapes)
                          + "Set these model keys to the parent's values (or start from random weights).")
    notes = [f"model.{k}: {getattr(parent_cfg, k)!r} in the parent, {getattr(cfg, k)!r} now"
             for k in FREE_KEYS if getattr(parent_cfg, k) != getattr(cfg, k)]
    if old_vocab is not None and old_vocab < cfg.vocab_size:
        notes.append(f"vocabulary grew {old_vocab} -> {cfg.vocab_size}: {cfg.vocab_size - old_vocab} new rows "
                     + ("set to the mean of the parent's rows" if new_rows == "mean" else
                        f"drawn from N(0, {cfg.initializer_range}^2)"))
    return out, notes


def _grow(t: torch.Tensor, size: int, how: str, std: float) -> torch.Tensor:
    """``t`` (rows first) with rows appended up to ``size``: the mean row, N(0, std^2) (seeded by the caller's
    torch RNG) or zeros."""
    extra = size - t.shape[0]
    if how == "mean":
        new = t.mean(dim=0, keepdim=True).expand(extra, *t.shape[1:])
    elif how == "init":
        new = torch.randn(extra, *t.shape[1:], dtype=t.dtype) * std
    else:
        new = torch.zeros(extra, *t.shape[1:], dtype=t.dtype)
    return torch.cat([t, new], dim=0)


def warm_start(cfg: Config, tokenizer_sha256: str = "", read_only: bool = False) -> tuple[Parent, dict]:
    """``(Parent, state dict for RoFormerForMaskedLM(cfg.model))`` of ``cfg.init``; every refusal is one
    ConfigError (a missing or unreadable parent, another tokenizer, mismatched shapes, an optimizer that
    cannot be taken). ``read_only`` (a dry run): a damaged parent checkpoint is not marked BAD."""
    init = cfg.init
    parent, parent_cfg, sd = read_parent(init.from_, read_only)
    if parent.kind == "checkpoint" and init.check_tokenizer and parent.tokenizer_sha256 and tokenizer_sha256 \
            and parent.tokenizer_sha256 != tokenizer_sha256:
        raise ConfigError(
            f"init.from: {parent.path} was trained on shards of another tokenizer (sha256 "
            f"{parent.tokenizer_sha256[:12]}..., this run's shards {tokenizer_sha256[:12]}...): its embeddings "
            "would read the wrong ids. Prepare the shards with the parent's tokenizer, or set "
            "init.check_tokenizer=false if the new vocabulary keeps the old pieces at their old ids")
    if init.load_optimizer:
        _check_optimizer_source(parent, cfg)
    out, notes = adapt(parent_cfg, sd, cfg.model, init.new_rows)
    if parent.kind == "checkpoint":  # e.g. the masking rates a new phase changes
        notes += changed_settings(read_trainer_state(Path(parent.path), 0).config, cfg)
    for note in notes:
        log.info("warm start: %s", note)
    return parent, out


def _check_optimizer_source(parent: Parent, cfg: Config) -> None:
    """init.load_optimizer needs a checkpoint of ours written by the same layout (DeepSpeed's files)."""
    if parent.kind != "checkpoint":
        raise ConfigError(f"init.load_optimizer: {parent.path} is a {parent.kind} parent, which has no optimizer "
                          "state; only a roformer-dist checkpoint has one")
    saved = read_trainer_state(Path(parent.path), 0).config
    was = {"deepspeed.zero_stage": saved.get("deepspeed", {}).get("zero_stage"),
           "parallel.tensor": saved.get("parallel", {}).get("tensor", 1),
           "parallel.pipeline": saved.get("parallel", {}).get("pipeline", 1), "world size": parent.world_size}
    now = {"deepspeed.zero_stage": cfg.deepspeed.zero_stage, "parallel.tensor": cfg.parallel.tensor,
           "parallel.pipeline": cfg.parallel.pipeline, "world size": cfg.dist.world_size}
    diffs = [f"{k}: {was[k]} in the parent, {now[k]} now" for k in now if was[k] != now[k]]
    if diffs:
        raise ConfigError("init.load_optimizer: the parent's optimizer files are of another layout:\n"
                          + "".join(f"  {d}\n" for d in diffs)
                          + "Use the parent's layout, or init.load_optimizer=false (fresh Adam moments)")


def optimizer_checkpoint(parent: Parent) -> tuple[str, str]:
    """(checkpoints root, tag) of a checkpoint parent, as DeepSpeed's load_checkpoint takes them."""
    d = Path(parent.path)
    return str(d.parent), d.name
