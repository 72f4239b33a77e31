"""Rank 0's view of a run: its sinks (``metrics.jsonl``, TensorBoard, ...: :mod:`roformer_dist.observe.sinks`)
and MFU.

``metrics.jsonl`` holds one JSON line per optimizer step (step, loss, seq_len,
stage, lr, ...). On resume every sink drops what came after the checkpoint
(``SinkContext.resume_step``), so a resumed run's curves equal an uninterrupted one's.

``perf/mfu`` is model FLOPs utilisation: tokens/s x FLOPs per token / (dense peak x GPUs), with the peak of
the GPU at the run's matmul precision (:func:`peak_flops`, :func:`matmul_precision`) and the FLOPs of
``RoFormerForMaskedLM.flops_per_token(S, p)``: matmuls only, training = 3 x forward,

    3 * ( L * (2 * (4 h^2 + 2 h f) + 4 S h)  +  2 e h [e != h]  +  p * (2 h e + 2 e V) )

(L layers, hidden h, FFN f, embedding e, vocabulary V, stage length S, predicted fraction p). That is the
usual 6N + 12 L h S with attention's scores and context (4 S h per layer and token, softmax attention;
linear attention has 4 (h / heads) h instead) at the stage's length and the vocabulary projection only on
the predicted positions. Recomputation under gradient checkpointing is not counted (MFU, not HFU);
attention restricted to document blocks (``data.packing``) is counted as full S x S.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import resource
from pathlib import Path
from typing import Literal, Optional, Sequence

from roformer_dist.config import Config, LoggingConfig, effective_sinks
from roformer_dist.observe.sinks import SinkContext, check_sinks, open_sinks

log = logging.getLogger(__name__)


def max_mem_gb() -> float:
    import torch  # (in the functions: the launcher imports this module for run_sinks, without torch)

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


MatmulPrecision = Literal["fp32", "tf32", "bf16", "fp16"]

# Dense (non-sparse) tensor-core peaks in TFLOP/s by GPU and matmul precision, from NVIDIA's datasheets:
# H100 (2024: SXM, PCIe, NVL per GPU), H200 (2024: SXM, NVL), GH200, A100 (40/80 GB, SXM and PCIe), L40S,
# L40, A40, A10, L4, T4, V100 (SXM2, PCIe) and V100S. The datasheets give TF32/BF16/FP16 with sparsity
# (marked *) for Ampere and later: those figures are halved here. FP32 is the non-tensor-core figure.
# A GPU without TF32 (Volta, Turing) runs an fp32 run's matmuls at its FP32 peak; one without a bf16
# figure has no bf16 MFU. Patterns are searched, case-insensitive, in torch.cuda.get_device_name(), first
# match wins (so NVL and PCIe before the SXM entry; "GH200" matches H[12]00: same GPU figures as H100 SXM).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H[12]00.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (r"H[12]00", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (r"\bL40\b", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05}),
    (r"\bA40\b", {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),  # not A10G: no datasheet
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
    (r"V100S", {"fp32": 16.4, "fp16": 130.0}),
    (r"V100.*PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
)


# Peak memory (HBM / GDDR) bandwidth in TB/s by GPU, from NVIDIA's datasheets; searched as PEAK_TFLOPS is.
# GH200 is left out (its figure depends on the memory fitted: HBM3 or HBM3e).
PEAK_MEMORY_TBPS: tuple[tuple[str, float], ...] = (
    (r"(?<!G)H200", 4.8),
    (r"H100.*NVL", 3.9),
    (r"H100.*PCIe", 2.0),
    (r"(?<!G)H100", 3.35),
    (r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", 1.935),
    (r"A100.*80GB", 2.039),
    (r"A100", 1.555),
    (r"L40S|\bL40\b", 0.864),
    (r"\bA40\b", 0.696),
    (r"\bA10\b", 0.6),
    (r"\bL4\b", 0.3),
    (r"\bT4\b", 0.32),
    (r"V100S", 1.134),
    (r"V100", 0.9),
)


def peak_memory_bandwidth(name: str) -> Optional[float]:
    """Peak memory bandwidth in bytes/s of the GPU named ``name`` (``torch.cuda.get_device_name()``), None
    when :data:`PEAK_MEMORY_TBPS` does not know it."""
    for pattern, tbps in PEAK_MEMORY_TBPS:
        if re.search(pattern, name, re.IGNORECASE):
            return tbps * 1e12
    return None


def matmul_precision(precision: str) -> MatmulPrecision:
    """The precision a run's matmuls run at: ``deepspeed.precision`` (fp32 | bf16 | fp16), with fp32 read as
    tf32 when ``torch.backends.cuda.matmul.allow_tf32`` is on (PyTorch's default is off)."""
    import torch

    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    assert precision in ("fp32", "bf16", "fp16"), precision
    return precision  # type: ignore[return-value]


def peak_flops(precision: MatmulPrecision) -> Optional[float]:
    """Dense peak FLOP/s of the current GPU at ``precision`` (:data:`PEAK_TFLOPS`; :func:`matmul_precision`
    turns a run's ``deepspeed.precision`` into it); None without CUDA, and None with one warning per GPU
    and precision when the figure is not known (then there is no MFU).

    MFU = tokens/s x ``RoFormerForMaskedLM.flops_per_token(seq_len, predicted_fraction)`` / (peak x GPUs)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return _peak(torch.cuda.get_device_name(), precision)


@functools.lru_cache(maxsize=None)  # the cache is what makes the warning one line per run, not one per step
def _peak(name: str, precision: str) -> Optional[float]:
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            if precision == "tf32" and "tf32" not in tflops:
                precision = "fp32"  # no TF32 units: the fp32 cores do the work
            if precision in tflops:
                return tflops[precision] * 1e12
            log.warning("no MFU: no dense %s peak known for %s (metrics.PEAK_TFLOPS)", precision, name)
            return None
    log.warning("no MFU: the peak FLOP/s of %r is not known (metrics.PEAK_TFLOPS)", name)
    return None


def run_sinks(cfg: Config) -> tuple[str, ...]:
    """The sinks of a run: ``config.effective_sinks`` (``metrics.jsonl`` always; ``logging.tensorboard: false``
    takes TensorBoard out), checked against the table (ConfigError naming ``logging.sinks``)."""
    return check_sinks(effective_sinks(cfg.logging))


class MetricsWriter:
    """Rank 0's sinks (:mod:`roformer_dist.observe.sinks`: ``metrics.jsonl`` always, the others of
    ``logging.sinks``); a no-op on other ranks. ``metrics.jsonl`` is the record of the run: a failure to
    write it is a StorageError (exit 74). The other sinks are views: each handles its own failures."""

    def __init__(self, run_dir: Path, rank: int, resume_step: int, sinks: Sequence[str] = ("tensorboard",),
                 settings: LoggingConfig = LoggingConfig()):
        self.enabled = rank == 0
        self.sinks = open_sinks(sinks, SinkContext(Path(run_dir), resume_step, settings)) if self.enabled else []

    def step_record(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log_record(record)

    def scalars(self, step: int, values: dict) -> None:
        values = {tag: value for tag, value in values.items() if value is not None}
        for sink in self.sinks:
            sink.log_scalars(step, values)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        for sink in self.sinks:
            sink.log_text(tag, text, step)

    def flush(self) -> None:
        """Every event so far on disk (the trainer calls it before a checkpoint can commit)."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
