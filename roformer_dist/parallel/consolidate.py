"""Merge the tensor-parallel shards of a saved model into the plain model's state dict.

Reading the files of a checkpoint (which file holds which shard in each layout) is the checkpoint
layer's job (``roformer_dist.checkpoint.weights.read_model_shards`` / ``consolidate_state_dict``); this module
only merges what was read. Module states are written by data rank 0 of each (pipeline, tensor)
position; with fp32 training they are the exact weights (ZeRO 1/2 keep the module parameters up to
date). With bf16/fp16 they are the low-precision weights (the fp32 master copy lives in the ZeRO
optimizer files).
"""

from __future__ import annotations

import torch

from roformer_dist.parallel.tensor import merge_shards


def merge_model_shards(shards: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Parameter name -> its shards in tensor-rank order (one entry without tensor parallelism)
    => parameter name -> the full fp32 tensor."""
    return {name: merge_shards(name, parts).float().clone() for name, parts in shards.items()}

