"""The one place that calls ``deepspeed.initialize``, and that builds DeepSpeed's ops.

The DeepSpeed JSON is generated from our config (``deepspeed_config``), never
kept by hand. The learning rate is set by the trainer every step from the pure
``lr_at`` schedule, so DeepSpeed gets no scheduler.

The optimizer (``choose_optimizer``) is a torch AdamW we hand DeepSpeed (fused on CUDA), which needs nothing
compiled; DeepSpeed's own optimizers only where a setting asks for one, and those are C++/CUDA ops that
DeepSpeed compiles on first use on a machine (JIT, into ``TORCH_EXTENSIONS_DIR``). ``load_op`` builds such
an op before DeepSpeed asks for it, so that a build that fails is one line naming the op, the environment
variables and the fix (``EnvironmentSetupError``), not a traceback from every rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import traceback
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from roformer_dist.config import Config, StagePlan
from roformer_dist.errors import ConfigError, EnvironmentSetupError
from roformer_dist.runtime.cuda_arch import VARIABLE as ARCH_LIST, prepare_for_deepspeed, unreadable_entries
from roformer_dist.runtime.deepspeed_import import import_deepspeed
from roformer_dist.runtime.jit_builds import extensions_root
from roformer_dist.runtime.process_group import TorchComm

log = logging.getLogger(__name__)


def deepspeed_config(cfg: Config, stage: StagePlan, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON for ``cfg`` at curriculum stage ``stage`` (its plan at the run's world size)."""
    d = cfg.deepspeed
    zero: dict = {"stage": d.zero_stage}
    if d.zero_stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=d.overlap_comm, reduce_scatter=True,
                    reduce_bucket_size=d.reduce_bucket_size)
        if d.zero_stage <= 2:
            zero["allgather_bucket_size"] = d.allgather_bucket_size
    if d.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if d.zero_stage == 3:
        # Gather parameters layer by layer; small models stay well under these thresholds.
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=int(5e7))
    ds: dict = {
        "train_batch_size": stage.global_batch_size,
        "train_micro_batch_size_per_gpu": stage.micro_batch_size,
        "gradient_accumulation_steps": stage.accumulation,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and synchronizes the device at the start of every
        # forward and the end of every step (deepspeed/utils/timer.py ThroughputTimer): the host could never run
        # ahead of the GPU. The trainer times the steps itself (perf/*, without a sync).
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "checkpoint": {"load_universal": load_universal},
    }
    if d.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif d.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": d.initial_loss_scale_power,
                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if cfg.parallel.pipeline > 1:
        ds["pipeline"] = {"activation_checkpoint_interval": 1 if d.activation_checkpointing else 0}
    if choose_optimizer(cfg, torch.cuda.is_available()).op is not None:
        name = {"adamw": "AdamW", "lamb": "Lamb"}[cfg.optim.name]
        params = {"lr": cfg.optim.lr, "betas": [cfg.optim.beta1, cfg.optim.beta2], "eps": cfg.optim.eps,
                  "weight_decay": cfg.optim.weight_decay}
        ds["optimizer"] = {"type": name, "params": params}
    return ds


class DeepSpeedOp(NamedTuple):
    """A DeepSpeed op, compiled on first use on a machine, and what asks for it (for the messages)."""

    label: str
    """What it is, in messages."""
    builder: str
    """DeepSpeed's builder class, as its accelerator names it (``create_op_builder``)."""
    compiler: str
    """``nvcc`` (a CUDA op) or ``c++``."""
    needed_for: str
    """The setting or component that needs it."""
    instead: str = ""
    """How to do without it; empty where nothing can."""
    optional: bool = False
    """DeepSpeed goes without it where its builder finds it cannot be built here (and so does ``load_op``)."""


CPU_ADAM = DeepSpeedOp("DeepSpeed's CPU Adam", "CPUAdamBuilder", "c++", "deepspeed.offload_optimizer: cpu",
                       "or set deepspeed.offload_optimizer: none")
FUSED_LAMB = DeepSpeedOp("DeepSpeed's fused LAMB", "FusedLambBuilder", "nvcc", "optim.name: lamb",
                         "or set optim.name: adamw (torch's fused AdamW: nothing to build)")
SHM_COMM = DeepSpeedOp("DeepSpeed's shared-memory collectives", "ShareMemCommBuilder", "c++",
                       "torch.distributed on CPU", optional=True)


class OptimizerChoice(NamedTuple):
    """What ``build_engine`` gives DeepSpeed as the optimizer (``choose_optimizer``)."""

    op: Optional[DeepSpeedOp]
    """DeepSpeed builds its own optimizer from the JSON's ``optimizer`` section, which compiles this op;
    None: a torch AdamW we construct and pass in."""
    fused: bool
    """That torch AdamW runs its fused kernel."""

    def describe(self) -> str:
        if self.op is not None:
            return self.op.label
        return "torch AdamW (fused)" if self.fused else "torch AdamW"


def choose_optimizer(cfg: Config, cuda: bool) -> OptimizerChoice:
    """The optimizer of a run, on a machine with (``cuda``) or without CUDA.

    On CUDA torch's fused AdamW, a client optimizer of DeepSpeed (ZeRO 1-3 put it on their fp32 master
    partitions; bf16 keeps those in fp32): it ships with torch, where DeepSpeed's FusedAdam would be compiled
    with nvcc on every fresh node (about a minute, and nvcc must be there). On CPU torch's AdamW as it always
    was: its fused CPU kernel rounds differently (1e-8 after a few steps), which would move every CPU loss trace.
    DeepSpeed's own optimizers only where a setting asks for one: ``optim.name: lamb`` (its fused LAMB, CUDA),
    ``deepspeed.offload_optimizer: cpu`` (its CPU Adam: DeepSpeed refuses a client optimizer under ZeRO-Offload)."""
    if cfg.optim.name == "lamb":
        return OptimizerChoice(FUSED_LAMB, False)
    if cfg.deepspeed.offload_optimizer == "cpu":
        return OptimizerChoice(CPU_ADAM, False)
    return OptimizerChoice(None, cuda)


def torch_optimizer(cfg: Config, groups: list[dict], fused: bool) -> torch.optim.AdamW:
    """The torch AdamW of a choice without a DeepSpeed op; not ``fused``: torch's default kernel, as always."""
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                             fused=True if fused else None)


def load_op(op: DeepSpeedOp, local_rank: int) -> None:
    """Build ``op`` on this machine (or load it, built before) ahead of DeepSpeed, which finds it loaded.

    Local rank 0 of each machine goes first and the others load what it built, so that every rank fails
    alike: a failure raises ``EnvironmentSetupError`` on every rank with the same one-line message (the op,
    the variables, the fix; the whole output is written beside the builds). ``TORCH_CUDA_ARCH_LIST`` is
    normalised for the build (``runtime.cuda_arch``). Every rank must call it (a collective)."""
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(op.builder)
    if builder is None or (op.optional and not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)):
        return
    failure = _build(op, builder) if local_rank == 0 else None
    failure = next((f for f in TorchComm().all_gather(failure) if f is not None), None)
    if failure is None and local_rank != 0:
        failure = _build(op, builder)
    if failure is not None:
        raise EnvironmentSetupError(failure)


def _build(op: DeepSpeedOp, builder) -> Optional[str]:
    """None once ``builder``'s op is loaded; else the one-line message of its failure."""
    try:
        with prepare_for_deepspeed():
            builder.load()
    except Exception as e:  # noqa: BLE001 - whatever stops a build on this machine is the machine's to fix
        return build_failure(op, builder.NAME, e)
    _build_log(builder.NAME).unlink(missing_ok=True)  # an earlier failure's, fixed since
    return None


def build_failure(op: DeepSpeedOp, name: str, error: BaseException) -> str:
    """One line: DeepSpeed's op ``name`` could not be built (``error``), the variables involved, the fix."""
    cause = _first_error_line(error)
    if op.compiler == "nvcc":
        from torch.utils.cpp_extension import CUDA_HOME

        arch = os.environ.get(ARCH_LIST)
        bad = unreadable_entries(arch or "")
        if bad:
            cause = f"{ARCH_LIST} holds {', '.join(map(repr, bad))}, which is no compute capability ({cause})"
        home = os.environ.get("CUDA_HOME") or f"(unset; torch found {CUDA_HOME or 'no CUDA toolkit'})"
        where = f"CUDA_HOME={home}, {ARCH_LIST}={arch if arch is not None else '(unset: the visible GPUs)'}"
        toolkit = f"the CUDA {torch.version.cuda} toolkit torch was built with" if torch.version.cuda else \
            "a CUDA toolkit"
        fix = (f"set CUDA_HOME to {toolkit} (its bin/nvcc) and {ARCH_LIST} to the GPUs' compute capabilities as "
               "MAJOR.MINOR[+PTX] separated by ';' (e.g. 9.0 on H100/H200)")
    else:
        where = f"CXX={os.environ.get('CXX') or '(unset: c++)'}, ninja={shutil.which('ninja') or '(not on PATH)'}"
        fix = "set CXX to a working C++ compiler (g++) and put ninja on PATH (pip install ninja)"
    out = f"{op.label} (op {name}, for {op.needed_for}) could not be built: {cause}; {where}; fix: {fix}"
    if op.instead:
        out += f", {op.instead}"
    log_file = _write_build_log(name, error)
    return out + (f"; the build's output: {log_file}" if log_file else "")


def _first_error_line(error: BaseException, limit: int = 300) -> str:
    """The line of ``error``'s text that says what went wrong: a compiler's first ``error``/``fatal`` line (torch
    puts the whole build log into the message), else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    said = [line for line in lines[1:] if re.search(r"\berror\b|\bfatal\b", line, re.IGNORECASE)
            and not line.startswith(("[", "FAILED:", "ninja:")) and " -o " not in line]
    line = said[0] if said else lines[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _build_log(name: str) -> Path:
    return extensions_root() / f"{name}.build-error.log"


def _write_build_log(name: str, error: BaseException) -> Optional[Path]:
    """The failure's whole text and traceback, written beside the builds; None where it cannot be written."""
    path = _build_log(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
    except OSError:
        return None
    return path


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


def build_engine(cfg: Config, module: torch.nn.Module, stage: StagePlan, load_universal: bool = False, mpu=None,
                 extra_config: dict | None = None):
    """Wrap ``module`` (our model, its tensor-parallel form, or a pipeline module) in DeepSpeed for
    ``stage``; ``mpu`` gives DeepSpeed the model-parallel groups. Returns the engine."""
    deepspeed = import_deepspeed()

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    if cfg.optim.name == "lamb" and not cuda:
        raise ConfigError("optim.name: lamb uses DeepSpeed's fused LAMB, which needs CUDA; use adamw on CPU")
    if maybe_use_apex(module):
        log.info("using apex FusedLayerNorm")
    if hasattr(module, "gradient_checkpointing"):
        module.gradient_checkpointing = cfg.deepspeed.activation_checkpointing
    ds_config = deepspeed_config(cfg, stage, load_universal)
    for key, value in (extra_config or {}).items():
        ds_config[key] = {**ds_config.get(key, {}), **value}
    groups = param_groups(module, cfg.optim.weight_decay)
    choice = choose_optimizer(cfg, cuda)
    log.info("optimizer: %s", choice.describe())
    optimizer = None
    if choice.op is not None:
        load_op(choice.op, int(os.environ.get("LOCAL_RANK", "0")))
    else:
        optimizer = torch_optimizer(cfg, groups, choice.fused)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           model_parameters=groups if optimizer is None else None,
                                           config=ds_config, mpu=mpu)
    return engine
