"""Megatron-style tensor parallelism for RoFormer, applied from outside the model.

``parallelize(model, dims)`` swaps, in place, the modules of a plain ``RoFormerForMaskedLM`` for
sharded ones holding only this tensor rank's slice, and returns a ``TensorParallelMLM``: the model's
own class with its ``forward`` / ``encode`` / ``MaskedLMOutput``; only the seams differ (the
attention's ``project`` / ``attend`` / ``output``, the head's ``decode`` / ``full_logits`` /
``criterion``)::

    attention.qkv       column-parallel by heads: rank r keeps heads [r*H/t, (r+1)*H/t) of q, k and v
    attention.out       row-parallel: input columns of those heads; all-reduce, then the (replicated) bias
    ffn_in              column-parallel: rows [r*F/t, (r+1)*F/t)
    ffn_out             row-parallel: the matching input columns; all-reduce, then the bias
    word_embeddings     vocab-parallel: rows [start_r, end_r) (ceil(V/t) per rank, the last may be shorter);
                        ids outside the range look up zeros; all-reduce
    head.bias + decoder vocab-parallel logits (N, V/t) from the tied embedding shard; the MLM loss and
                        accuracy are computed without gathering the vocabulary (max, sum-exp and target
                        logit are all-reduced over the tensor group)

Everything else (LayerNorms, token-type / position embeddings, the head's dense layer, row-parallel
biases) is replicated; its gradients come out identical on every tensor rank because every rank
computes the same replicated activations. Autograd collectives: ``copy_to_tp`` (identity forward,
all-reduce backward) in front of each column-parallel GEMM, ``reduce_from_tp`` (all-reduce forward,
identity backward) after each row-parallel one. Sharded parameters carry ``tensor_model_parallel =
True`` so that DeepSpeed's gradient-norm counts them on every tensor rank and replicated ones once.

Attention (softmax or linear) is computed per head, so it runs unchanged on this rank's heads: only
the projections around it carry collectives.

Dropout: activations outside attention are replicated, so the tensor ranks of one replica must draw
the same dropout masks: seed them alike (``ParallelDims.replica_seed_offset``). Attention-probability
dropout acts on each rank's own heads; it draws from a generator forked per tensor rank (see
``_per_rank_rng``) so that heads on different ranks do not share masks.

State-dict names stay those of the plain model (shapes are the local slices); ``SHARDING`` /
``shard_tensor`` / ``merge_shards`` map between the two.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roformer_dist.nn.attention import uses_dropout_rng
from roformer_dist.config import check_tensor_split
from roformer_dist.nn.model import RoFormerForMaskedLM, RoFormerLayer, RoFormerMLMHead, RoFormerSelfAttention

# ----------------------------------------------------------------------------- collectives


def _active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce (sum) backward: in front of a column-parallel GEMM."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: after a row-parallel GEMM."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if _active(group) else x


# ----------------------------------------------------------------------------- sharding rules

SHARDING = {
    "embeddings.word_embeddings.weight": "vocab",
    "head.bias": "vocab",
    "attention.qkv.weight": "qkv",
    "attention.qkv.bias": "qkv",
    "attention.out.weight": "in",
    "ffn_in.weight": "out",
    "ffn_in.bias": "out",
    "ffn_out.weight": "in",
}
"""Plain-model parameter name (suffix) -> how it is split. vocab: rows by vocabulary range; qkv: each of
q, k, v by heads; out: output rows; in: input columns. Names not listed are replicated."""


def shard_kind(name: str) -> Optional[str]:
    for suffix, kind in SHARDING.items():
        if name == suffix or name.endswith("." + suffix):
            return kind
    return None


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows held by ``tp_rank``: ceil(V/t) each, the last may be shorter."""
    per = math.ceil(vocab_size / tp_size)
    start = min(vocab_size, tp_rank * per)
    return start, min(vocab_size, start + per)


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of the plain model's parameter ``name`` (a copy)."""
    kind = shard_kind(name)
    if kind is None or tp_size == 1:
        return full.detach().clone()
    if kind == "vocab":
        start, end = vocab_range(full.shape[0], tp_size, tp_rank)
        return full[start:end].detach().clone()
    if kind == "qkv":  # (3*hidden, ...) = (3, hidden, ...): split hidden (= heads x head_dim)
        parts = full.reshape(3, full.shape[0] // 3, *full.shape[1:]).chunk(tp_size, dim=1)[tp_rank]
        return parts.reshape(-1, *full.shape[1:]).detach().clone()
    if kind == "out":
        return full.chunk(tp_size, dim=0)[tp_rank].detach().clone()
    if kind == "in":
        return full.chunk(tp_size, dim=1)[tp_rank].detach().clone()
    raise AssertionError(kind)


def merge_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_tensor`` over all tensor ranks (replicated: rank 0's copy)."""
    kind = shard_kind(name)
    if kind is None or len(shards) == 1:
        return shards[0]
    if kind in ("vocab", "out"):
        return torch.cat(shards, dim=0)
    if kind == "in":
        return torch.cat(shards, dim=1)
    if kind == "qkv":
        parts = [s.reshape(3, s.shape[0] // 3, *s.shape[1:]) for s in shards]
        merged = torch.cat(parts, dim=1)
        return merged.reshape(-1, *merged.shape[2:])
    raise AssertionError(kind)


def _mark(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel = True  # DeepSpeed's grad norm: count on every tensor rank
    p.partition_dim = dim
    return p


def _param(t: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=requires_grad)


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    """An nn.Linear holding these tensors, built without drawing from the RNG."""
    lin = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                             device=weight.device, dtype=weight.dtype)
    lin.weight = _param(weight)
    if bias is not None:
        lin.bias = _param(bias)
    return lin


# ----------------------------------------------------------------------------- modules


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: output features split across tensor ranks."""

    def __init__(self, full: nn.Linear, name: str, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group = group
        self.weight = _mark(_param(shard_tensor(name + ".weight", full.weight, tp_rank, tp_size)), 0)
        self.bias = (_mark(_param(shard_tensor(name + ".bias", full.bias, tp_rank, tp_size)), 0)
                     if full.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b: input features split, bias replicated."""

    def __init__(self, full: nn.Linear, name: str, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group = group
        self.weight = _mark(_param(shard_tensor(name + ".weight", full.weight, tp_rank, tp_size)), 1)
        self.bias = _param(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, end) of the vocabulary; other ids look up zeros; all-reduce."""

    def __init__(self, full: nn.Embedding, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group = group
        self.num_embeddings = full.num_embeddings
        self.start, self.end = vocab_range(full.num_embeddings, tp_size, tp_rank)
        self.weight = _mark(_param(full.weight[self.start:self.end].detach().clone()), 0)
        pad = full.padding_idx
        # nn.Embedding gives the padding row no gradient; keep that for the rank that holds it
        self.local_padding_idx = pad - self.start if pad is not None and self.start <= pad < self.end else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


@contextmanager
def _per_rank_rng(tp_rank: int, device: torch.device):
    """Fork the RNG for dropout on this rank's heads: seed = one draw from the (replica-wide) global
    generator + tp_rank. The draw advances the global generator identically on all tensor ranks, and
    activation checkpointing, which restores the global RNG before recomputing, redraws the same seed."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + 7919 * tp_rank)
        yield


class TensorParallelSelfAttention(RoFormerSelfAttention):
    """RoFormerSelfAttention over this rank's heads: qkv column-parallel, out row-parallel.

    Keeps the parent's attribute names (``qkv``, ``out``, ``num_heads`` = local heads), so its
    ``project`` (incl. the rotate-half weight permutation, which is per head) and the attention core
    apply unchanged; only the collectives and the per-rank dropout stream are added."""

    def __init__(self, full: RoFormerSelfAttention, tp_rank: int, tp_size: int, group):
        nn.Module.__init__(self)
        for name in RoFormerSelfAttention.SETTINGS:
            setattr(self, name, getattr(full, name))
        self.num_heads = full.num_heads // tp_size
        self.group, self.tp_rank = group, tp_rank
        self.qkv = _linear(shard_tensor("attention.qkv.weight", full.qkv.weight, tp_rank, tp_size),
                           shard_tensor("attention.qkv.bias", full.qkv.bias, tp_rank, tp_size))
        _mark(self.qkv.weight, 0), _mark(self.qkv.bias, 0)
        self.out = _linear(shard_tensor("attention.out.weight", full.out.weight, tp_rank, tp_size),
                           full.out.bias.detach().clone())
        _mark(self.out.weight, 1)

    def project(self, x, kernel):
        return super().project(copy_to_tp(x, self.group), kernel)  # (B, S, 3, H_local, D)

    def attend(self, qkv, attn_mask, cos, sin, kernel):
        if self.training and uses_dropout_rng(self.kind, self.dropout_p):
            with _per_rank_rng(self.tp_rank, qkv.device):
                return super().attend(qkv, attn_mask, cos, sin, kernel)
        return super().attend(qkv, attn_mask, cos, sin, kernel)

    def output(self, ctx, out_weight):  # ctx (B, S, hidden / t)
        return reduce_from_tp(F.linear(ctx, out_weight), self.group) + self.out.bias


def parallelize_layer(layer: RoFormerLayer, tp_rank: int, tp_size: int, group) -> RoFormerLayer:
    """Swap, in place, the attention and FFN GEMMs of one layer for tensor-parallel ones."""
    layer.attention = TensorParallelSelfAttention(layer.attention, tp_rank, tp_size, group)
    layer.ffn_in = ColumnParallelLinear(layer.ffn_in, "ffn_in", tp_rank, tp_size, group)
    layer.ffn_out = RowParallelLinear(layer.ffn_out, "ffn_out", tp_rank, tp_size, group)
    return layer


# ----------------------------------------------------------------------------- loss


def vocab_parallel_loss(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and accuracy of (N, V_local) fp32 logits whose columns are the vocabulary
    ids [vocab_start, vocab_start + V_local), without gathering the vocabulary. Equal to
    ``F.cross_entropy`` / argmax accuracy on the gathered logits (argmax ties: the smallest id, as torch)."""
    n_local = logits.shape[1]
    with torch.no_grad():
        local_max, local_arg = logits.max(dim=-1)
        global_max = local_max.clone()
        if _active(group):
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - global_max.unsqueeze(1)  # the shift cancels in the loss: no gradient through it
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    inside = (target >= vocab_start) & (target < vocab_start + n_local)
    local_target = (target - vocab_start).clamp(0, n_local - 1)
    target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1) * inside
    target_logit = reduce_from_tp(target_logit, group)
    loss = (sum_exp.log() - target_logit).mean()
    with torch.no_grad():
        big = torch.iinfo(torch.int64).max
        pred = torch.where(local_max == global_max, local_arg + vocab_start, torch.full_like(local_arg, big))
        if _active(group):
            dist.all_reduce(pred, op=dist.ReduceOp.MIN, group=group)
        accuracy = (pred == target).float().mean()
    return loss, accuracy


def gather_vocab(local: torch.Tensor, vocab_size: int, tp_size: int, group) -> torch.Tensor:
    """(..., V_local) shards -> (..., V) on every rank (forward only; for logits without labels)."""
    if not _active(group):
        return local
    per = math.ceil(vocab_size / tp_size)
    padded = F.pad(local.detach(), (0, per - local.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(tp_size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def vocab_parallel_decode(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, group) -> torch.Tensor:
    """The tied decoder on this rank's vocabulary rows: (N, E) -> (N, V_local). The head's transform
    before it is replicated and must see the full gradient, so ``copy_to_tp`` sits here, in front of
    the decoder GEMM."""
    return F.linear(copy_to_tp(h, group), weight, bias)


def vocab_parallel_bias(bias: torch.Tensor, tp_rank: int, tp_size: int) -> nn.Parameter:
    """This rank's slice of the decoder bias (the plain model's ``head.bias``), as a marked parameter."""
    return _mark(_param(shard_tensor("head.bias", bias, tp_rank, tp_size)), 0)


class VocabParallelMLMHead(RoFormerMLMHead):
    """The MLM head with the decoder, its bias and the loss split by vocabulary (see the module
    docstring); dense / act / LayerNorm replicated."""

    def __init__(self, full: RoFormerMLMHead, vocab_size: int, tp_rank: int, tp_size: int, group):
        nn.Module.__init__(self)
        self.dense, self.act, self.norm = full.dense, full.act, full.norm
        self.bias = vocab_parallel_bias(full.bias, tp_rank, tp_size)
        self.vocab_size, self.tp_size, self.group = vocab_size, tp_size, group
        self.vocab_start = vocab_range(vocab_size, tp_size, tp_rank)[0]

    def decode(self, h, decoder_weight):
        return vocab_parallel_decode(h, decoder_weight, self.bias, self.group)

    def full_logits(self, hidden, decoder_weight):
        return gather_vocab(self(hidden, decoder_weight), self.vocab_size, self.tp_size, self.group)

    def criterion(self, logits, target):
        return vocab_parallel_loss(logits, target, self.vocab_start, self.group)


# ----------------------------------------------------------------------------- the model


class TensorParallelMLM(RoFormerForMaskedLM):
    """A tensor-parallel ``RoFormerForMaskedLM``: the plain model's modules, sharded in place.

    With labels, ``masked_logits`` is this rank's vocabulary slice (N, V_local); without labels,
    ``logits`` are gathered to the full vocabulary. Parameter names are the plain model's."""

    def __init__(self, model: RoFormerForMaskedLM, tp_rank: int, tp_size: int, group):
        nn.Module.__init__(self)
        cfg = model.config
        check_tensor_split(cfg, tp_size)
        self.config = cfg
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        emb = model.embeddings
        emb.word_embeddings = VocabParallelEmbedding(emb.word_embeddings, tp_rank, tp_size, group)
        for layer in model.layers:
            parallelize_layer(layer, tp_rank, tp_size, group)
        self.embeddings, self.layers, self.rotary = emb, model.layers, model.rotary
        self.head = VocabParallelMLMHead(model.head, cfg.vocab_size, tp_rank, tp_size, group)
        self.gradient_checkpointing = model.gradient_checkpointing

    @property
    def vocab_start(self) -> int:
        return self.embeddings.word_embeddings.start


def parallelize(model: RoFormerForMaskedLM, dims) -> TensorParallelMLM:
    """Shard ``model`` (in place) over ``dims``' tensor group; returns the tensor-parallel wrapper.

    ``dims``: a ``ParallelDims`` (or anything with ``tp_rank``, ``tp_size``, ``tp_group``)."""
    return TensorParallelMLM(model, dims.tp_rank, dims.tp_size, dims.tp_group)
