"""Merge the tensor / pipeline shards of a saved checkpoint into the plain model's state dict.

Files DeepSpeed writes per layout (``<ckpt_dir>`` = ``<run_dir>/checkpoints/<tag>``)::

    tensor x data        mp_rank_<tp>_model_states.pt            ['module']: TensorParallelMLM's state,
                                                                 plain names, this rank's slices
    pipeline (x tensor)  layer_<idx>-model_<tp>-model_states.pt  one pipeline layer's state
                                                                 (indices: see parallel/pipeline.py)

Module states are written by data rank 0 of each (pipeline, tensor) position; with fp32 training
they are the exact weights (ZeRO 1/2 keep the module parameters up to date). With bf16/fp16 they are
the low-precision weights (the fp32 master copy lives in the ZeRO optimizer files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from roformer_dist.parallel.pipeline import to_plain_names
from roformer_dist.parallel.tensor import merge_shards
from roformer_dist.parallel.topology import Layout


def _load(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"{path.parent}: missing {path.name} (is this a checkpoint of that layout?)")
    return torch.load(path, map_location="cpu", weights_only=False)


def consolidate_state_dict(ckpt_dir: str | Path, model_cfg=None, layout: Optional[Layout] = None):
    """``(ModelConfig, fp32 state_dict)`` of the plain ``RoFormerForMaskedLM`` from a checkpoint of any
    tensor x pipeline layout. Without ``model_cfg`` / ``layout`` both come from the trainer state
    saved beside it (``trainer_state_rank0.pt``, its resolved config and world size)."""
    ckpt_dir = Path(ckpt_dir)
    if model_cfg is None or layout is None:
        from roformer_dist.checkpoint import load_trainer_state
        from roformer_dist.config import from_dict

        state = load_trainer_state(ckpt_dir, 0)
        cfg = from_dict(state["config"])
        model_cfg = model_cfg or cfg.model
        layout = layout or Layout.from_config(cfg, int(state["world_size"]))
    tp = layout.tensor
    per_name: dict[str, list[torch.Tensor]] = {}
    if layout.pipeline == 1:
        for t in range(tp):
            sd = _load(ckpt_dir / f"mp_rank_{t:02d}_model_states.pt")["module"]
            for k, v in sd.items():
                per_name.setdefault(k, []).append(v)
    else:
        num_layers = model_cfg.num_hidden_layers
        for idx in range(num_layers + 2):  # the tied decoder (last entry) is saved with entry 0
            for t in range(tp):
                sd = _load(ckpt_dir / f"layer_{idx:02d}-model_{t:02d}-model_states.pt")
                for k, v in to_plain_names(idx, sd, num_layers).items():
                    per_name.setdefault(k, []).append(v)
    merged = {k: merge_shards(k, shards).float().clone() for k, shards in per_name.items()}
    return model_cfg, merged
