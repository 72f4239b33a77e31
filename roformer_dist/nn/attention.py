"""The attention core of a RoFormer layer: projected q, k, v -> context, softmax or linear.

``attention_core`` is the one place where attention is computed; ``RoFormerSelfAttention``
(model.py) calls it between the QKV projection and the output projection, and so does its
tensor-parallel subclass (parallel/tensor.py), on its own heads.

Each kind of attention (``model.attention``: softmax, linear) is a module of ``nn/attention_kinds/``, which
says how it attends (``AttentionKind.attend``); this module lays the projections out for it: packed documents
in blocks or flash-attn's varlen form, rotary on v (``model.rotary_value``).
"""

from __future__ import annotations

from typing import Optional

import torch

from roformer_dist.nn import documents
from roformer_dist.nn.attention_kinds import attention_kind
from roformer_dist.nn.documents import DocumentPlan, RowMask
from roformer_dist.nn.rotary import run_kernel


def attention_core(kind: str, qkv: torch.Tensor, attn_mask: RowMask,
                   cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], kernel: Optional[str],
                   rotary_value: bool, dropout_p: float) -> torch.Tensor:
    """Projections (B, S, 3, H, D) -> context (B, S, H * D).

    ``attn_mask``: bool (B, 1, 1, S), True = attend (softmax also takes an additive float mask), None,
    a :class:`~roformer_dist.nn.documents.DocumentPlan` (attention inside each packed document; it
    carries its own rotary tables) or a :class:`~roformer_dist.nn.documents.FlexMask` (softmax only:
    flex attention over the rows, or SDPA with its dense form when there is dropout).
    ``cos``/``sin``: fp32 (S, D/2) rotary tables (or (B, S, D/2), one
    per row), None for absolute positions. ``kernel``: the rotary kernel (``rotary.model_kernel``, chosen
    before the forward; called through ``rotary.run_kernel``, no resolution here).
    ``dropout_p``: on the softmax probabilities (0 in eval)."""
    if isinstance(attn_mask, DocumentPlan):
        if attention_kind(kind).varlen and documents.varlen_applies(attn_mask, qkv):
            return varlen_attention(qkv, attn_mask, kernel, rotary_value, dropout_p)
        return document_attention(kind, qkv, attn_mask, kernel, rotary_value, dropout_p)
    B, S = qkv.shape[:2]
    q, k, v = qkv.unbind(2)  # (B, S, H, D) views of one buffer
    if cos is not None and rotary_value:
        v = run_kernel(kernel, v, None, cos, sin)[0]
    ctx = attention_kind(kind).attend(q, k, v, attn_mask, cos, sin, kernel, dropout_p)  # (B, S, H, D)
    return ctx.reshape(B, S, -1)


def document_attention(kind: str, qkv: torch.Tensor, plan: DocumentPlan, kernel: Optional[str],
                       rotary_value: bool, dropout_p: float) -> torch.Tensor:
    """Each block of the plan as one dense attention call, the results gathered back to (B, S, H * D);
    padding positions get a zero context."""
    B, S, _, H, D = qkv.shape
    gathered = qkv.reshape(B * S, 3, H, D).index_select(0, plan.slots)   # one gather (and one scatter back)
    outs = []
    for b, x in zip(plan.blocks, gathered.split([n * L for n, L in (b.shape for b in plan.blocks)])):
        n, L = b.shape
        x = x.view(n, L, 3, H, D)
        ctx = attention_core(kind, x, b.key_mask, b.cos, b.sin, kernel, rotary_value, dropout_p)
        ctx = ctx.reshape(n * L, H * D)
        outs.append(ctx if b.keep is None else ctx.index_select(0, b.keep))
    outs.append(qkv.new_zeros(1, H * D))
    return torch.cat(outs).index_select(0, plan.inverse).view(B, S, H * D)


def varlen_attention(qkv: torch.Tensor, plan: DocumentPlan, kernel: Optional[str], rotary_value: bool,
                     dropout_p: float) -> torch.Tensor:
    """Softmax attention over the documents laid end to end, through ``documents.varlen_kernel``
    (flash-attn's varlen kernel on CUDA): no padding at all."""
    B, S, _, H, D = qkv.shape
    vl = plan.varlen
    tokens = qkv.reshape(B * S, 3, H, D).index_select(0, vl.order)[None]   # (1, T, 3, H, D)
    q, k, v = tokens.unbind(2)
    if vl.cos is not None:
        if rotary_value:
            v = run_kernel(kernel, v, None, vl.cos, vl.sin)[0]
        q, k = run_kernel(kernel, q, k, vl.cos, vl.sin)
    ctx = documents.varlen_kernel(q[0], k[0], v[0], vl.cu_seqlens, vl.max_len, dropout_p)   # (T, H, D)
    out = torch.cat([ctx.reshape(-1, H * D), qkv.new_zeros(1, H * D)])
    return out.index_select(0, plan.inverse).view(B, S, H * D)


def uses_dropout_rng(kind: str, dropout_p: float) -> bool:
    """Whether ``attention_core`` draws from the RNG (a kind that draws dropout, with dropout)."""
    return attention_kind(kind).draws_dropout and dropout_p > 0.0


__all__ = ["attention_core", "document_attention", "varlen_attention", "uses_dropout_rng"]
