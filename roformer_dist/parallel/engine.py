"""The one place that calls ``deepspeed.initialize``.

The DeepSpeed JSON is generated from our config (``deepspeed_config``), never
kept by hand. The learning rate is set by the trainer every step from the pure
``lr_at`` schedule, so DeepSpeed gets no scheduler.
"""

from __future__ import annotations

import logging
import os

import torch

from roformer_dist.config import Config, StageConfig, data_parallel_size, micro_batch_size
from roformer_dist.errors import ConfigError

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

log = logging.getLogger(__name__)


def deepspeed_config(cfg: Config, stage: StageConfig, world_size: int, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON for ``cfg`` at curriculum stage ``stage``."""
    dp = data_parallel_size(cfg, world_size)
    mbs = micro_batch_size(cfg, stage, world_size)
    d = cfg.deepspeed
    zero: dict = {"stage": d.zero_stage}
    if d.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=False, reduce_scatter=True)
    if d.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if d.zero_stage == 3:
        # Gather parameters layer by layer; small models stay well under these thresholds.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=int(5e7))
    ds: dict = {
        "train_batch_size": stage.global_batch_size,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": stage.global_batch_size // (mbs * dp),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": load_universal},
    }
    if d.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif d.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": d.initial_loss_scale_power,
                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if cfg.parallel.pipeline > 1:
        ds["pipeline"] = {"activation_checkpoint_interval": 1 if d.activation_checkpointing else 0}
    if _use_deepspeed_optimizer(cfg):
        name = {"adamw": "AdamW", "lamb": "Lamb"}[cfg.optim.name]
        params = {"lr": cfg.optim.lr, "betas": [cfg.optim.beta1, cfg.optim.beta2], "eps": cfg.optim.eps,
                  "weight_decay": cfg.optim.weight_decay}
        ds["optimizer"] = {"type": name, "params": params}
    return ds


def _use_deepspeed_optimizer(cfg: Config) -> bool:
    """DeepSpeed's fused Adam/LAMB on GPU, and its CPU Adam under offload; torch AdamW otherwise."""
    return torch.cuda.is_available() or cfg.deepspeed.offload_optimizer == "cpu"


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights are excluded."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def maybe_use_apex(model: torch.nn.Module) -> int:
    """Swap nn.LayerNorm for apex's FusedLayerNorm when apex and CUDA are there; returns how many."""
    if not torch.cuda.is_available():
        return 0
    try:
        from apex.normalization import FusedLayerNorm  # type: ignore
    except ImportError:
        return 0
    swapped = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.LayerNorm:
                fused = FusedLayerNorm(child.normalized_shape, eps=child.eps)
                fused.load_state_dict(child.state_dict())
                setattr(parent, name, fused)
                swapped += 1
    return swapped


def build_engine(cfg: Config, module: torch.nn.Module, stage: StageConfig, world_size: int,
                 load_universal: bool = False, mpu=None, extra_config: dict | None = None):
    """Wrap ``module`` (our model, its tensor-parallel form, or a pipeline module) in DeepSpeed for
    ``stage``; ``mpu`` gives DeepSpeed the model-parallel groups. Returns the engine."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if cfg.optim.name == "lamb" and not torch.cuda.is_available():
        raise ConfigError("optim.name: lamb uses DeepSpeed's fused LAMB, which needs CUDA; use adamw on CPU")
    if maybe_use_apex(module):
        log.info("using apex FusedLayerNorm")
    if hasattr(module, "gradient_checkpointing"):
        module.gradient_checkpointing = cfg.deepspeed.activation_checkpointing
    ds_config = deepspeed_config(cfg, stage, world_size, load_universal)
    for key, value in (extra_config or {}).items():
        ds_config[key] = {**ds_config.get(key, {}), **value}
    groups = param_groups(module, cfg.optim.weight_decay)
    optimizer = None
    if not _use_deepspeed_optimizer(cfg):
        optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                      eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           model_parameters=groups if optimizer is None else None,
                                           config=ds_config, mpu=mpu)
    return engine
