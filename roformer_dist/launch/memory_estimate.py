"""Will a run fit? The memory one rank needs in each curriculum stage, from the config alone (no torch tensors,
no GPU): what ``roformer-train --dry-run`` prints.

Per rank and stage, in bytes (``w``: 2 for bf16/fp16, 4 for fp32; ``P``: the parameters this rank's
tensor x pipeline slice holds; ``d``: the data-parallel degree):

    weights     P w            ZeRO-3: P w / d, plus the layer gathered for compute (up to DeepSpeed's
                               prefetch bucket, ``stage3_prefetch_bucket_size`` elements)
    gradients   P w            ZeRO-1/2/3: P w / d (the averaged partition)
    optimizer   8 P (Adam's two fp32 moments) + 4 P (the fp32 master copy; ZeRO-0 in fp32 has none), / d
                under ZeRO-1/2/3; 0 on the GPU when ``offload_optimizer: cpu``
    buckets     ZeRO-1/2: ``deepspeed.reduce_bucket_size`` elements of w (DeepSpeed allocates the whole bucket
                in every backward), twice with ``deepspeed.overlap_comm``; ZeRO-3: its reduce bucket the same way
    activations what autograd keeps from forward to backward at the stage's micro-batch B and length S:
                per layer and token 11 h + 2 f elements (the layer's input, q k v, the rotated q and k, the
                attention output and its copy, two LayerNorm inputs and one output, the FFN's two f-wide
                tensors); with dropout a byte per element for its masks; softmax attention without a fused
                kernel (attention dropout on CPU) also a S x S float per head and its mask; packed documents
                (``data.packing: document``) a S x S bias per row, unless a kernel takes them without one
                (flash-attn's varlen, or flex attention without attention dropout); then the
                embeddings' h and the head at the predicted positions (the masking rate of B S tokens):
                h + 3 e elements and, as fp32, the scores, their log-softmax and, in backward, two
                gradients of them (V each). Activation checkpointing keeps one h per layer and token plus
                one layer's whole set. A pipeline stage holds L / p layers for up to p micro-batches in
                flight; tensor parallelism splits the attention and FFN terms t ways.

The total is what the framework's tensors take (on a GPU, what ``torch.cuda.max_memory_allocated`` counts);
the fit check keeps :data:`HEADROOM` of the device for the CUDA context, NCCL and the allocator's slack.
``bench/dry_run_memory.py`` measures the peak of a real DeepSpeed step on CPU next to this estimate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from roformer_dist.config import Config, ModelConfig, StagePlan, data_parallel_size
from roformer_dist.errors import ConfigError
from roformer_dist.nn.attention_kinds import MemoryContext, attention_kind

__all__ = ["StageMemory", "parameter_count", "estimate_stage", "parse_bytes", "format_bytes",
           "HEADROOM", "DS_PREFETCH_BUCKET", "maskless"]

HEADROOM = 0.10
"""The share of a device's memory the estimate leaves free (CUDA context, NCCL buffers, allocator slack)."""
DS_PREFETCH_BUCKET = int(5e7)
"""``stage3_prefetch_bucket_size`` as ``parallel/engine.py`` sets it (elements)."""


def parameter_count(m: ModelConfig) -> tuple[int, int]:
    """(parameters of the embeddings and the head, parameters of one layer) of a model config whose vocabulary
    is known; their sum over the layers is ``RoFormerForMaskedLM(m).num_parameters()``."""
    if not isinstance(m.vocab_size, int):
        raise ConfigError(f"model.vocab_size: {m.vocab_size!r} is decided by the data; resolve the run first")
    h, f, v = m.hidden_size, m.intermediate_size, m.vocab_size
    e = m.embedding_size or h
    emb = v * e + m.type_vocab_size * e + 2 * e
    if m.position_embedding == "absolute":
        emb += m.max_position_embeddings * e
    if e != h:
        emb += e * h + h
    head = h * e + e + 2 * e + v  # dense, LayerNorm, the decoder's bias (its weight is the word embeddings)
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv + out, the FFN, two LayerNorms
    return emb + head, layer


@dataclass(frozen=True)
class StageMemory:
    """One curriculum stage's estimate for one rank (bytes).

    The peak is the larger of two moments of a step: the head's backward (every activation saved, the
    scores' gradients alive, no bucket yet) and the layers' backward (DeepSpeed's bucket allocated at the
    first gradient hook, the head's tensors freed)."""
    stage: str
    seq_len: int
    micro_batch: int
    parameters: int
    """Parameters of this rank's model slice (before ZeRO partitions them)."""
    weights: int
    gradients: int
    optimizer: int
    buckets: int
    layers_per_sample: int
    """Activation bytes the embeddings and layers keep for one sequence of the micro-batch."""
    head_per_sample: int
    """The head's saved and transient bytes for one sequence (at the masking rate)."""

    @property
    def states(self) -> int:
        """Weights, gradients and optimizer state (not the bucket, which is scratch space)."""
        return self.weights + self.gradients + self.optimizer

    @property
    def activations(self) -> int:
        return self.micro_batch * (self.layers_per_sample + self.head_per_sample)

    def total_at(self, micro_batch: int) -> int:
        """The peak at another micro-batch of the same stage."""
        return (self.states + micro_batch * self.layers_per_sample
                + max(micro_batch * self.head_per_sample, self.buckets))

    @property
    def total(self) -> int:
        return self.total_at(self.micro_batch)

    def largest_micro_batch(self, budget: int) -> int:
        """The largest micro-batch whose peak stays within ``budget`` bytes (0: not even one sequence)."""
        room = budget - self.states
        return max(0, min((room - self.buckets) // self.layers_per_sample,
                          room // (self.layers_per_sample + self.head_per_sample)))


def _per_sample(cfg: Config, plan: StagePlan, device: str, maskless: bool) -> tuple[int, int]:
    """(layers, head) activation bytes of one sequence (see the module docstring), on the busiest pipeline
    stage, with the micro-batches a pipeline keeps in flight."""
    m, d, par = cfg.model, cfg.deepspeed, cfg.parallel
    w = 2 if d.precision in ("bf16", "fp16") else 4
    h, f, heads, v = m.hidden_size, m.intermediate_size, m.num_attention_heads, m.vocab_size
    e = m.embedding_size or h
    t, p, seq_len = par.tensor, par.pipeline, plan.seq_len
    dropout = m.hidden_dropout_prob > 0 or m.attention_probs_dropout_prob > 0
    per_token = (4 * h + (7 * h + 2 * f) / t) * w + (2 * h + f / t if dropout else 0)  # masks: a byte each
    per_token += attention_kind(m.attention).activation_bytes(MemoryContext(
        seq_len=seq_len, heads=heads // t, value_bytes=w,
        eager_dropout=m.attention_probs_dropout_prob > 0 and device == "cpu",
        document_mask=cfg.data.packing == "document" and not maskless))
    layers = m.num_hidden_layers / p
    in_flight = min(p, plan.accumulation)  # 1F1B: the first pipeline stage holds up to p micro-batches
    if d.activation_checkpointing:
        layer_token = layers * h * w + per_token / max(1, in_flight)  # one layer's set is recomputed at a time
    else:
        layer_token = layers * per_token
    layer_bytes = seq_len * (layer_token + h * w) * in_flight  # + the embeddings' output
    predicted = plan.mlm_probability * seq_len
    head = predicted * ((h + 3 * e) * w + 3 * v * 4 / t)  # saved, and the fp32 scores' log-softmax + 2 gradients
    return int(layer_bytes), int(head)


def maskless(cfg: Config, device: str) -> bool:
    """Whether packed documents take a kernel without an S x S mask on ``device``: flash-attn's varlen (half
    precision) or flex attention without attention dropout (CUDA)."""
    from roformer_dist.nn.documents import flash_varlen_available
    from roformer_dist.nn.model import document_kernel

    kernel = document_kernel(cfg.model, device)
    if kernel == "varlen":
        return device == "cuda" and cfg.deepspeed.precision in ("bf16", "fp16") and flash_varlen_available()
    return kernel == "flex" and device == "cuda" and cfg.model.attention_probs_dropout_prob == 0


def estimate_stage(cfg: Config, plan: StagePlan, world_size: Optional[int] = None, device: str = "cuda",
                   maskless: bool = False) -> StageMemory:
    """The estimate for one rank in stage ``plan`` of ``cfg`` (resolved: the vocabulary known) at ``world_size``
    ranks (default dist.world_size). ``device``: ``cuda`` or ``cpu`` (the attention path differs on CPU);
    ``maskless``: packed documents go through a kernel that takes no S x S mask (flash-attn's varlen, or flex
    attention without attention dropout; CUDA)."""
    d = cfg.deepspeed
    dp = max(1, data_parallel_size(cfg, world_size))
    w = 2 if d.precision in ("bf16", "fp16") else 4
    outer, layer = parameter_count(cfg.model)
    par = cfg.parallel
    params = int((outer + layer * cfg.model.num_hidden_layers / par.pipeline) / par.tensor)
    z = d.zero_stage
    weights = params * w if z < 3 else params * w // dp + min(params, DS_PREFETCH_BUCKET) * w
    gradients = params * w if z == 0 else params * w // dp
    master = 0 if (z == 0 and w == 4) else 4
    optimizer = 0 if d.offload_optimizer == "cpu" else (params * (8 + master)) // (1 if z == 0 else dp)
    # overlap_comm under ZeRO-1/2: DeepSpeed keeps two buckets, one filling while the other is reduced
    buckets = d.reduce_bucket_size * w * (2 if d.overlap_comm and z < 3 else 1) if z >= 1 else 0
    layers, head = _per_sample(cfg, plan, device, maskless)
    return StageMemory(plan.name, plan.seq_len, plan.micro_batch_size, params, weights, gradients, optimizer,
                       buckets, layers, head)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, what: str = "--gpu-memory") -> int:
    """``80GB``, ``80GiB``, ``141 GB``, ``8e9`` -> bytes; ConfigError naming ``what`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{what}: expected a size such as 80GB, 80GiB or 141e9, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Bytes in GiB (or MiB below one GiB), one decimal."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"
