"""The attention core of a RoFormer layer: projected q, k, v -> context, softmax or linear.

``attention_core`` is the one place where attention is computed; ``RoFormerSelfAttention``
(model.py) calls it between the QKV projection and the output projection, and so does its
tensor-parallel subclass (parallel/tensor.py), on its own heads.

softmax (``model.attention: softmax``)
    Rotary on q and k (RoFormer eq. 14), then ``F.scaled_dot_product_attention`` with the padding
    mask: O(S^2) time per head, and O(S^2) memory wherever no fused kernel applies (on CPU with
    attention dropout the eager path below is used).

linear (``model.attention: linear``; the paper's section 3.3, eq. 19)
    With a feature map phi >= 0, position m attends as

        out_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n  /  sum_n phi(q_m)^T phi(k_n)

    R_m the rotation of position m: rotary applies to the feature maps in the numerator only; the
    denominator stays unrotated, so it is positive (the paper's remark: the rotated weights need
    not be, nor sum to one). Both sums over n are computed once per head,

        KV = sum_n (R_n phi(k_n)) v_n^T   (D x D)        Z = sum_n phi(k_n)   (D)

    and every query then costs O(D^2): O(S D^2) time and O(S D + D^2) memory per head, no S x S
    matrix anywhere. Padded keys are left out of both sums; everything after the projections is
    accumulated in fp32. phi(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, smooth, linear
    for x > 0. No 1/sqrt(D) scale (the normalisation divides it out for a homogeneous map; elu+1 is
    not, and the scale-free form is the one the paper's linear variant uses). There is no
    probability matrix, so ``attention_probs_dropout_prob`` does not apply.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from roformer_dist.config import AttentionKind
from roformer_dist.nn import documents
from roformer_dist.nn.documents import DocumentPlan, FlexMask, RowMask
from roformer_dist.nn.rotary import run_kernel


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0, elementwise (so it commutes with any permutation of head dims)."""
    return F.elu(x) + 1.0


def key_padding_mask(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The model's bool mask (B, 1, 1, S), True = attend -> (B, S); None stays None."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
        raise ValueError("linear attention takes a boolean key-padding mask of shape (B, 1, 1, S), got "
                         f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
    return attn_mask[:, 0, 0, :]


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                     cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], kernel: Optional[str]) -> torch.Tensor:
    """Eq. 19 above. q, k, v (B, S, H, D) (v already rotated with rotary_value); key_mask (B, S) bool,
    True = a token; cos/sin (S, D/2) or None (no rotary); ``kernel`` the rotary dispatch's name.
    Returns the context (B, S, H, D) in v's dtype."""
    phi_q = feature_map(q.float())
    phi_k = feature_map(k.float())
    if key_mask is not None:
        phi_k = phi_k * key_mask[:, :, None, None].to(phi_k.dtype)  # padding out of both sums
    if cos is not None:
        rot_q, rot_k = run_kernel(kernel, phi_q, phi_k, cos, sin)
    else:
        rot_q, rot_k = phi_q, phi_k
    kv = torch.einsum("bshd,bshe->bhde", rot_k, v.float())       # sum_n R_n phi(k_n) v_n^T (B, H, D, D)
    numerator = torch.einsum("bshd,bhde->bshe", rot_q, kv)         # (B, S, H, D)
    k_sum = phi_k.sum(dim=1)                                       # sum_n phi(k_n) (B, H, D)
    denominator = torch.einsum("bshd,bhd->bsh", phi_q, k_sum)      # (B, S, H), > 0 unless all keys are padding
    # a row without any key (all padding) gives 0 / tiny = 0 rather than NaN
    denominator = denominator.clamp_min(torch.finfo(torch.float32).tiny)
    return (numerator / denominator.unsqueeze(-1)).to(v.dtype)


def eager_softmax_attention(q, k, v, attn_mask, dropout_p):
    """Softmax attention in plain ops, (B, H, S, D) -> (B, H, S, D), with dropout on the probabilities."""
    # scale q (S x D) rather than the scores (S x S): one pass less over the big tensor, fwd and bwd
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # (B, H, S, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attn_mask
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout_p, training=True)
    return torch.matmul(probs, v)


def softmax_attention(q, k, v, attn_mask, dropout_p: float) -> torch.Tensor:
    """Scaled dot-product attention, (B, H, S, D) -> (B, H, S, D)."""
    if dropout_p > 0.0 and q.device.type == "cpu":
        # PyTorch's CPU SDPA has no fused kernel with dropout; its math fallback is ~2x slower
        # than this eager path (measured in bench/step.py).
        return eager_softmax_attention(q, k, v, attn_mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


def attention_core(kind: AttentionKind, qkv: torch.Tensor, attn_mask: RowMask,
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
        if kind == "softmax" and documents.varlen_applies(attn_mask, qkv):
            return varlen_attention(qkv, attn_mask, kernel, rotary_value, dropout_p)
        return document_attention(kind, qkv, attn_mask, kernel, rotary_value, dropout_p)
    B, S = qkv.shape[:2]
    q, k, v = qkv.unbind(2)  # (B, S, H, D) views of one buffer
    if cos is not None and rotary_value:
        v = run_kernel(kernel, v, None, cos, sin)[0]
    if kind == "linear":
        ctx = linear_attention(q, k, v, key_padding_mask(attn_mask), cos, sin, kernel)  # (B, S, H, D)
        return ctx.reshape(B, S, -1)
    if cos is not None:
        q, k = run_kernel(kernel, q, k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if isinstance(attn_mask, FlexMask):
        if dropout_p == 0.0:
            ctx = documents.flex_kernel(q, k, v, attn_mask)
            return ctx.transpose(1, 2).reshape(B, S, -1)
        attn_mask = attn_mask.dense()   # flex attention has no dropout
    ctx = softmax_attention(q, k, v, attn_mask, dropout_p)
    return ctx.transpose(1, 2).reshape(B, S, -1)


def document_attention(kind: AttentionKind, qkv: torch.Tensor, plan: DocumentPlan, kernel: Optional[str],
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


def uses_dropout_rng(kind: AttentionKind, dropout_p: float) -> bool:
    """Whether ``attention_core`` draws from the RNG (softmax attention with dropout)."""
    return kind == "softmax" and dropout_p > 0.0


__all__ = ["attention_core", "document_attention", "varlen_attention", "linear_attention", "softmax_attention",
           "eager_softmax_attention", "feature_map", "key_padding_mask", "uses_dropout_rng"]
