"""Conversion between our :class:`RoFormerForMaskedLM` and HF ``transformers.RoFormerForMaskedLM``.

Key mapping (ours <- HF, ``L`` = layer index):
    embeddings.word_embeddings.weight        <- roformer.embeddings.word_embeddings.weight
                                                (also cls.predictions.decoder.weight: tied)
    embeddings.token_type_embeddings.weight  <- roformer.embeddings.token_type_embeddings.weight
    embeddings.norm.{weight,bias}            <- roformer.embeddings.LayerNorm.*
    embeddings.project.{weight,bias}         <- roformer.embeddings_project.*   (embedding_size != hidden)
    layers.L.attention.qkv.{weight,bias}     <- cat(attention.self.{query,key,value}.*)  along dim 0
    layers.L.attention.out.*                 <- attention.output.dense.*
    layers.L.attention_norm.*                <- attention.output.LayerNorm.*
    layers.L.ffn_in.*                        <- intermediate.dense.*
    layers.L.ffn_out.*                       <- output.dense.*
    layers.L.ffn_norm.*                      <- output.LayerNorm.*
    head.dense.*                             <- cls.predictions.transform.dense.*
    head.norm.*                              <- cls.predictions.transform.LayerNorm.*
    head.bias                                <- cls.predictions.bias  (= cls.predictions.decoder.bias)
HF's ``roformer.encoder.embed_positions.weight`` (the fixed sinusoidal table) is not a parameter of
ours: it is written from our rotary tables on the way out and checked against them on the way in.

Rotary base and scaling (``model.rope_theta`` / ``rope_scaling`` ...): HF's RoFormer builds its table with
base 10000 at construction, but ``from_pretrained`` keeps the stored table (it is a saved weight; HF
re-creates only missing ones) and its rotation reads cos and sin from that table as they are, so a
table of any settings (yarn's attention factor on cos and sin included) gives our logits. The
settings themselves go to ``config.json`` under :data:`HF_ROPE_KEY` (only when not RoFormer's; HF
ignores the key), from which :func:`model_config_from_hf` reads them back. HF's model reads at most
``max_position_embeddings`` positions (its table's rows).

Only ``position_embedding="rotary"`` models with ``attention="softmax"`` have an HF RoFormer equivalent
(HF's RoFormer has neither learned absolute positions nor linear attention). ``transformers`` is
needed by :func:`from_hf_pretrained`, :func:`to_hf_pretrained` and the ``hf_config_*`` helpers; the
state-dict mappings are pure torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from roformer_dist.checkpoint.weights import model_from_state_dict
from roformer_dist.config import ModelConfig, RopeSettings, build, rope_settings
from roformer_dist.errors import ConfigError
from roformer_dist.nn.attention_kinds import attention_kind
from roformer_dist.nn.model import RoFormerForMaskedLM, rotary_cache
from roformer_dist.nn.rotary import DEFAULT_ROPE

# HF config attribute names that equal ours one to one
_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "rotary_value",
                  "pad_token_id", "initializer_range")

_LAYER_MAP = (  # ours suffix, HF suffix (both under their layer prefix)
    ("attention.out", "attention.output.dense"),
    ("attention_norm", "attention.output.LayerNorm"),
    ("ffn_in", "intermediate.dense"),
    ("ffn_out", "output.dense"),
    ("ffn_norm", "output.LayerNorm"),
)
_TOP_MAP = (
    ("embeddings.word_embeddings.weight", "roformer.embeddings.word_embeddings.weight"),
    ("embeddings.token_type_embeddings.weight", "roformer.embeddings.token_type_embeddings.weight"),
    ("embeddings.norm.weight", "roformer.embeddings.LayerNorm.weight"),
    ("embeddings.norm.bias", "roformer.embeddings.LayerNorm.bias"),
    ("head.dense.weight", "cls.predictions.transform.dense.weight"),
    ("head.dense.bias", "cls.predictions.transform.dense.bias"),
    ("head.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("head.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("head.bias", "cls.predictions.bias"),
)
_PROJECT_MAP = (("embeddings.project.weight", "roformer.embeddings_project.weight"),
                ("embeddings.project.bias", "roformer.embeddings_project.bias"))
_TABLE = "roformer.encoder.embed_positions.weight"

HF_ROPE_KEY = "roformer_dist_rope"
"""``config.json`` key of a model's rotary settings (``config.rope_settings``) when they are not
RoFormer's; HF's own ``rope_theta`` / ``rope_scaling`` attributes mean other things to its RoPE code."""

TABLE_TOLERANCE = 1e-6
"""Largest difference between a stored HF table and ours that still counts as the same settings (HF
computes its default table in numpy, we in torch: they agree to ~1e-7)."""


def _require_rotary(cfg: ModelConfig) -> None:
    """ConfigError unless HF's RoFormer can express this model (names the key that stops it)."""
    if cfg.position_embedding != "rotary":
        raise ConfigError("model.position_embedding: only 'rotary' models have an HF RoFormer equivalent "
                          f"(HF RoFormer has no learned absolute positions), got {cfg.position_embedding!r}")
    attention = getattr(cfg, "attention", "softmax")
    if not attention_kind(attention).hf_export:
        raise ConfigError(f"model.attention: {attention!r} has no HF RoFormer equivalent (HF RoFormer computes "
                          "softmax attention only); only 'softmax' models can be exported")


def check_exportable(cfg: ModelConfig) -> None:
    """ConfigError naming the key when ``cfg`` has no HF RoFormer equivalent."""
    _require_rotary(cfg)


def _has_projection(cfg: ModelConfig) -> bool:
    return cfg.embedding_size is not None and cfg.embedding_size != cfg.hidden_size


def _take(sd: dict, key: str, source: str = "HF state dict") -> torch.Tensor:
    try:
        return sd[key]
    except KeyError:
        raise KeyError(f"{source} has no {key!r}") from None


def sinusoidal_table(cfg: ModelConfig) -> torch.Tensor:
    """HF's ``embed_positions.weight``: (max_positions, head_dim) = [sin | cos], fp32, from our rotary
    tables for the model's rope settings."""
    cos, sin = rotary_cache(cfg).get(cfg.max_position_embeddings)
    return torch.cat((sin, cos), dim=-1)


def _check_table(table: torch.Tensor, cfg: ModelConfig) -> None:
    want = sinusoidal_table(cfg)
    if table.shape != want.shape or not torch.allclose(table.float(), want, atol=TABLE_TOLERANCE, rtol=0):
        settings = ", ".join(f"model.{k}={v}" for k, v in rope_settings(cfg).to_dict().items())
        raise ValueError(f"HF state dict: {_TABLE} is not the rotary table of {settings} (max_position_embeddings "
                         f"{cfg.max_position_embeddings}); give the rope settings the model was trained with")


def state_dict_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF RoFormerForMaskedLM state dict -> ours (a new dict; tensors are shared or concatenated)."""
    _require_rotary(cfg)
    if isinstance(sd.get(_TABLE), torch.Tensor):
        _check_table(sd[_TABLE], cfg)
    out = {ours: _take(sd, theirs) for ours, theirs in _TOP_MAP}
    decoder = sd.get("cls.predictions.decoder.weight")
    if decoder is not None and decoder is not out["embeddings.word_embeddings.weight"] and \
            not torch.equal(decoder, out["embeddings.word_embeddings.weight"]):
        raise ValueError("HF state dict: cls.predictions.decoder.weight differs from the word embeddings; "
                         "our model ties them (tie_word_embeddings=True)")
    if _has_projection(cfg):
        out.update({ours: _take(sd, theirs) for ours, theirs in _PROJECT_MAP})
    for i in range(cfg.num_hidden_layers):
        hp = f"roformer.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            out[f"layers.{i}.attention.qkv.{kind}"] = torch.cat(
                [_take(sd, f"{hp}attention.self.{n}.{kind}") for n in ("query", "key", "value")], dim=0)
            for ours, theirs in _LAYER_MAP:
                out[f"layers.{i}.{ours}.{kind}"] = _take(sd, f"{hp}{theirs}.{kind}")
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF RoFormerForMaskedLM's (complete: tied decoder and sinusoidal table included)."""
    _require_rotary(cfg)
    src = "our state dict"
    out = {theirs: _take(sd, ours, src) for ours, theirs in _TOP_MAP}
    if _has_projection(cfg):
        out.update({theirs: _take(sd, ours, src) for ours, theirs in _PROJECT_MAP})
    out["cls.predictions.decoder.weight"] = out["roformer.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    out[_TABLE] = sinusoidal_table(cfg)
    for i in range(cfg.num_hidden_layers):
        hp = f"roformer.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = _take(sd, f"layers.{i}.attention.qkv.{kind}", src).chunk(3, dim=0)
            for name, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"{hp}attention.self.{name}.{kind}"] = t
            for ours, theirs in _LAYER_MAP:
                out[f"{hp}{theirs}.{kind}"] = _take(sd, f"layers.{i}.{ours}.{kind}", src)
    return out


def hf_config_from(cfg: ModelConfig):
    """Our ModelConfig -> ``transformers.RoFormerConfig``."""
    from transformers import RoFormerConfig

    _require_rotary(cfg)
    if not isinstance(cfg.vocab_size, int):
        raise ValueError(f"model.vocab_size: needs an integer to build an HF config, got {cfg.vocab_size!r}")
    kwargs = {name: getattr(cfg, name) for name in _SHARED_FIELDS}
    rope = rope_settings(cfg)
    if rope != DEFAULT_ROPE:
        kwargs[HF_ROPE_KEY] = rope.to_dict()
    return RoFormerConfig(embedding_size=cfg.embedding_size or cfg.hidden_size, **kwargs)


def model_config_from_hf(hf_cfg: Any, **overrides: Any) -> ModelConfig:
    """``transformers.RoFormerConfig`` (or its dict) -> our ModelConfig (rotary positions)."""
    get = (lambda k, d=None: hf_cfg.get(k, d)) if isinstance(hf_cfg, dict) else \
        (lambda k, d=None: getattr(hf_cfg, k, d))
    if get("is_decoder", False) or get("add_cross_attention", False):
        raise ValueError("HF config: decoder / cross-attention RoFormer models are not supported")
    defaults = ModelConfig()
    kwargs = {name: get(name, getattr(defaults, name)) for name in _SHARED_FIELDS}
    emb = get("embedding_size")
    kwargs["embedding_size"] = None if emb in (None, kwargs["hidden_size"]) else int(emb)
    if kwargs["pad_token_id"] is None:
        kwargs["pad_token_id"] = 0
    kwargs.update(RopeSettings.from_dict(get(HF_ROPE_KEY) or {}, f"HF config: {HF_ROPE_KEY}").to_dict())
    kwargs.update(position_embedding="rotary", **overrides)
    return build(ModelConfig, kwargs)


def read_hf_repository(path: str | os.PathLike, model_type: str = "roformer", **config_overrides: Any
                       ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(ModelConfig, our fp32 state dict)`` of a directory written by ``transformers``' ``save_pretrained``
    (safetensors or bin): ``model_type`` roformer (``RoFormerForMaskedLM``) or bert (``BertForMaskedLM``:
    RoFormer's layers without the rotation, so its names map onto RoFormer's; its learned position table is
    added and the model has ``position_embedding: absolute``)."""
    if model_type == "roformer":
        from transformers import RoFormerForMaskedLM as HFModel
    elif model_type == "bert":
        from transformers import BertForMaskedLM as HFModel
    else:
        raise ValueError(f"{path}: model_type {model_type!r}; expected roformer or bert")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory not found: {path}")
    hf = HFModel.from_pretrained(str(path), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = model_config_from_hf(hf.config, **config_overrides)
    if model_type == "roformer":
        return cfg, state_dict_from_hf(sd, cfg)
    renamed = {("roformer." + k[len("bert."):] if k.startswith("bert.") else k): v for k, v in sd.items()}
    out = state_dict_from_hf(renamed, cfg)
    out["embeddings.position_embeddings.weight"] = sd["bert.embeddings.position_embeddings.weight"]
    return dataclasses.replace(cfg, position_embedding="absolute"), out


def from_hf_pretrained(path: str | os.PathLike, **config_overrides: Any) -> RoFormerForMaskedLM:
    """Directory written by ``transformers``' ``save_pretrained`` (safetensors or bin) -> our model (fp32)."""
    return model_from_state_dict(*read_hf_repository(path, **config_overrides))


def to_hf_model(model: RoFormerForMaskedLM):
    """Our model -> an HF ``RoFormerForMaskedLM`` in memory (fp32, eval mode)."""
    from transformers import RoFormerForMaskedLM as HFRoFormerForMaskedLM

    cfg = model.config
    hf = HFRoFormerForMaskedLM(hf_config_from(cfg))
    sd = state_dict_to_hf({k: v.detach().float() for k, v in model.state_dict().items()}, cfg)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf.eval()


def to_hf_pretrained(model: RoFormerForMaskedLM, path: str | os.PathLike) -> None:
    """Write a directory that ``transformers.RoFormerForMaskedLM.from_pretrained`` loads (safetensors)."""
    os.makedirs(path, exist_ok=True)
    to_hf_model(model).save_pretrained(str(path))


__all__ = ["HF_ROPE_KEY", "check_exportable", "state_dict_from_hf", "state_dict_to_hf", "hf_config_from", "model_config_from_hf",
           "read_hf_repository", "from_hf_pretrained", "to_hf_pretrained", "to_hf_model",
           "sinusoidal_table"]
