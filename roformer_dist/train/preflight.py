"""Before DeepSpeed, on a GPU: does the curriculum's largest micro-batch fit? One forward and backward of
the freshly built model at the worst stage, so that a micro-batch that does not fit fails at start-up,
naming the stage, not hours later when a long stage begins."""

from __future__ import annotations

from typing import Sequence

import torch

from roformer_dist.config import Config, StagePlan
from roformer_dist.nn.model import IGNORE_INDEX

__all__ = ["check_largest_micro_batch_fits"]


def check_largest_micro_batch_fits(model: torch.nn.Module, cfg: Config, stages: Sequence[StagePlan],
                                   local_rank: int) -> None:
    """No-op without CUDA. The model goes back to the CPU afterwards, its gradients cleared."""
    if not torch.cuda.is_available():
        return
    worst = max(stages, key=lambda s: s.micro_batch_size * s.seq_len * (1 + s.seq_len / 1024))
    mbs = worst.micro_batch_size
    dev = torch.device("cuda", local_rank)
    model.to(dev)
    ids = torch.randint(5, cfg.model.vocab_size, (mbs, worst.seq_len), device=dev)
    labels = torch.where(torch.rand(ids.shape, device=dev) < worst.mlm_probability, ids,
                         torch.full_like(ids, IGNORE_INDEX))
    try:
        model(ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
    except torch.cuda.OutOfMemoryError:
        raise RuntimeError(
            f"curriculum stage {worst.name!r} (seq_len {worst.seq_len}, micro_batch_size {mbs}) does not fit "
            "in GPU memory: lower curriculum.tokens_per_micro_batch or the stage's micro_batch_size "
            "(gradient accumulation keeps the global batch)") from None
    finally:
        model.zero_grad(set_to_none=True)
    model.cpu()
    torch.cuda.empty_cache()
