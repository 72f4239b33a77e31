"""Model weights out of checkpoints and weights files: the one place that defines the weights format.

Weights file (what ``roformer-convert from-hf`` writes and every command that takes weights reads;
:func:`save_weights` / :func:`load_weights`)::

    torch.save({"format": "roformer-dist-weights", "version": 1,
                "model_config": dataclasses.asdict(ModelConfig),   # plain dict, vocab_size an int
                "state_dict": {our key: fp32 tensor}})              # keys of RoFormerForMaskedLM

A bare state dict (our keys, optionally prefixed ``module.``) is read too, with a model config given
by the caller. ``model.yaml`` beside ``model.pt`` (a from-hf output directory) holds the model section.

Training checkpoints (:func:`load_checkpoint_weights`): the fp32 weights of any ZeRO stage and any
tensor x pipeline layout, consolidated into the plain model's state dict. Which file holds which
shard in each layout::

    tensor x data        mp_rank_<tp>_model_states.pt            ['module']: plain names, this rank's slices
    pipeline (x tensor)  layer_<idx>-model_<tp>-model_states.pt  one pipeline layer's state
                                                                 (indices: see parallel/pipeline.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.atomic import atomic_write
from roformer_dist.checkpoint import safe_load
from roformer_dist.checkpoint.store import COMPLETE, Found, is_complete, read_trainer_state, short_error, state_file
from roformer_dist.config import ModelConfig, build, from_dict
from roformer_dist.errors import CheckpointError, ConfigError
from roformer_dist.nn.model import RoFormerForMaskedLM
from roformer_dist.parallel.consolidate import merge_model_shards
from roformer_dist.parallel.pipeline import to_plain_names
from roformer_dist.parallel.topology import Layout
from roformer_dist.runtime.deepspeed_import import import_deepspeed

__all__ = ["WEIGHTS_FORMAT", "WEIGHTS_VERSION", "WEIGHTS_NAME", "CONFIG_NAME", "save_weights", "load_weights",
           "with_vocab_size", "model_from_state_dict", "read_model_shards", "consolidate_state_dict",
           "load_checkpoint_weights"]

WEIGHTS_FORMAT = "roformer-dist-weights"
WEIGHTS_VERSION = 1
WEIGHTS_NAME = "model.pt"
CONFIG_NAME = "model.yaml"
_WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"


# --------------------------------------------------------------------------- weights files


def save_weights(path: str | os.PathLike, cfg: ModelConfig, state_dict: dict) -> None:
    """Write the documented weights file (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "model_config": dataclasses.asdict(cfg),
               "state_dict": {k: v.detach().float().cpu().contiguous() for k, v in state_dict.items()}}
    atomic_write(path, lambda f: torch.save(payload, f))


def load_weights(path: str | os.PathLike, cfg: Optional[ModelConfig] = None) -> tuple[ModelConfig, dict]:
    """A weights file (or a bare state dict file with ``cfg``) -> (ModelConfig with an integer
    vocab_size, our state dict). Nothing is unpickled but tensors and plain types."""
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - anything unreadable is a user error naming the file
        raise CheckpointError(f"{path}: not a readable torch weights file ({type(e).__name__}: {e})") from None
    if isinstance(obj, dict) and "state_dict" in obj:
        sd = obj["state_dict"]
        if cfg is None:
            if "model_config" not in obj:
                raise ConfigError(f"{path}: has no model_config; pass --config")
            cfg = build(ModelConfig, obj["model_config"], f"{path}: model_config", CheckpointError)
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        sd = obj
        if cfg is None:
            raise ConfigError(f"{path}: a bare state dict carries no model config; pass --config")
    else:
        raise CheckpointError(f"{path}: expected a roformer-dist weights file ({{'model_config', 'state_dict'}}) "
                              "or a state dict")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return with_vocab_size(cfg, sd, str(path)), sd


def with_vocab_size(cfg: ModelConfig, sd: dict, where: str) -> ModelConfig:
    """``cfg`` with ``vocab_size: auto`` replaced by the rows of the state dict's word embeddings."""
    if isinstance(cfg.vocab_size, int):
        return cfg
    if _WORD_EMBEDDINGS not in sd:
        raise CheckpointError(f"{where}: model.vocab_size is {cfg.vocab_size!r} and the state dict has no "
                              f"{_WORD_EMBEDDINGS}")
    return dataclasses.replace(cfg, vocab_size=int(sd[_WORD_EMBEDDINGS].shape[0]))


def model_from_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> RoFormerForMaskedLM:
    """Build our model for ``cfg`` and load ``sd`` (our keys) strictly."""
    model = RoFormerForMaskedLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model


# --------------------------------------------------------------------------- training checkpoints


def _torch_load(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path.parent}: missing {path.name} (is this a checkpoint of that layout?)")
    try:
        return safe_load.load(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file
        raise CheckpointError(f"{path}: unreadable ({short_error(e)})") from None


def read_model_shards(ckpt_dir: Path, layout: Layout, num_layers: int) -> dict[str, list[torch.Tensor]]:
    """Parameter name -> its shards in tensor-rank order, as the tensor x pipeline layout saved them
    (files: see the module docstring; written by data rank 0 of each (pipeline, tensor) position)."""
    ckpt_dir = Path(ckpt_dir)
    per_name: dict[str, list[torch.Tensor]] = {}
    if layout.pipeline == 1:
        for t in range(layout.tensor):
            for k, v in _torch_load(ckpt_dir / f"mp_rank_{t:02d}_model_states.pt")["module"].items():
                per_name.setdefault(k, []).append(v)
    else:
        for idx in range(num_layers + 2):  # the tied decoder (last entry) is saved with entry 0
            for t in range(layout.tensor):
                sd = _torch_load(ckpt_dir / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
                for k, v in to_plain_names(idx, sd, num_layers).items():
                    per_name.setdefault(k, []).append(v)
    return per_name


def consolidate_state_dict(ckpt_dir: str | os.PathLike, model_cfg: Optional[ModelConfig] = None,
                           layout: Optional[Layout] = None) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, fp32 state_dict)`` of the plain ``RoFormerForMaskedLM`` from a checkpoint of any
    tensor x pipeline layout. Without ``model_cfg`` / ``layout`` both come from the trainer state
    saved beside it (its resolved config and world size)."""
    ckpt_dir = Path(ckpt_dir)
    if model_cfg is None or layout is None:
        state = read_trainer_state(ckpt_dir, 0)
        cfg = from_dict(state.config)
        model_cfg = model_cfg or cfg.model
        layout = layout or Layout.from_config(cfg, state.world_size)
    shards = read_model_shards(ckpt_dir, layout, model_cfg.num_hidden_layers)
    return model_cfg, merge_model_shards(shards)


def load_checkpoint_weights(found: Found | str | os.PathLike) -> tuple[ModelConfig, dict]:
    """(ModelConfig, fp32 state dict with our key names) of a complete training checkpoint of any ZeRO
    stage or layout (a :class:`Found` from :func:`~roformer_dist.checkpoint.store.resolve`, or its
    step directory)."""
    ckpt_dir = found.dir if isinstance(found, Found) else Path(found)
    if not state_file(ckpt_dir, 0).exists():
        raise CheckpointError(f"{ckpt_dir}: not a roformer-dist checkpoint (no trainer_state_rank0.pt)")
    if not is_complete(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: checkpoint is incomplete (no {COMPLETE} marker)")
    state = read_trainer_state(ckpt_dir, 0)
    try:
        cfg = from_dict(state.config)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt_dir}: its stored config is invalid: {e}") from None
    if cfg.parallel.tensor > 1 or cfg.parallel.pipeline > 1:
        return consolidate_state_dict(ckpt_dir, cfg.model)
    if cfg.deepspeed.zero_stage == 0:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise CheckpointError(f"{ckpt_dir}: no mp_rank_*_model_states.pt")
        sd = _torch_load(files[0])["module"]
    else:
        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            # DeepSpeed prints per tensor group; its loads unpickle nothing but tensors (safe_load)
            with contextlib.redirect_stdout(io.StringIO()), safe_load.weights_only_loads():
                sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises many kinds on a damaged file
            raise CheckpointError(f"{ckpt_dir}: cannot read the ZeRO files ({short_error(e)})") from None
    return cfg.model, {k: v.float() for k, v in sd.items()}
