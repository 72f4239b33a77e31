"""Softmax attention (``model.attention: softmax``): rotary on q and k (RoFormer eq. 14), then
``F.scaled_dot_product_attention`` with the padding mask: O(S^2) time per head, and O(S^2) memory wherever no
fused kernel applies (on CPU with attention dropout the eager path below is used). Packed documents: in blocks,
rows with a dense block-diagonal mask, flex attention or flash-attn's varlen kernel. HF's RoFormer computes it.
"""

from __future__ import annotations

import math

from roformer_dist.nn.attention_kinds.kind import AttentionKind, MemoryContext

__all__ = ["KIND", "softmax_attention", "eager_softmax_attention"]


def eager_softmax_attention(q, k, v, attn_mask, dropout_p):
    """Softmax attention in plain ops, (B, H, S, D) -> (B, H, S, D), with dropout on the probabilities."""
    import torch
    import torch.nn.functional as F

    # scale q (S x D) rather than the scores (S x S): one pass less over the big tensor, fwd and bwd
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # (B, H, S, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attn_mask
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout_p, training=True)
    return torch.matmul(probs, v)


def softmax_attention(q, k, v, attn_mask, dropout_p: float):
    """Scaled dot-product attention, (B, H, S, D) -> (B, H, S, D)."""
    import torch.nn.functional as F

    if dropout_p > 0.0 and q.device.type == "cpu":
        # PyTorch's CPU SDPA has no fused kernel with dropout; its math fallback is ~2x slower
        # than this eager path (measured in bench/step.py).
        return eager_softmax_attention(q, k, v, attn_mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


def attend(q, k, v, attn_mask, cos, sin, kernel, dropout_p: float):
    """(B, S, H, D) each -> (B, S, H, D). ``attn_mask``: bool (B, 1, 1, S) True = attend, an additive float
    mask, None, or a ``documents.FlexMask`` (flex attention over the rows; SDPA with its dense form when there
    is dropout)."""
    from roformer_dist.nn import documents
    from roformer_dist.nn.rotary import run_kernel

    if cos is not None:
        q, k = run_kernel(kernel, q, k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if isinstance(attn_mask, documents.FlexMask):
        if dropout_p == 0.0:
            return documents.flex_kernel(q, k, v, attn_mask).transpose(1, 2)
        attn_mask = attn_mask.dense()   # flex attention has no dropout
    return softmax_attention(q, k, v, attn_mask, dropout_p).transpose(1, 2)


def activation_bytes(c: MemoryContext) -> float:
    if c.eager_dropout:
        # the eager path: scores' softmax and the dropped probabilities (w each) and the dropout mask (a byte)
        return c.heads * c.seq_len * (2 * c.value_bytes + 1)
    if c.document_mask:
        # rows of several documents: SDPA takes the block-diagonal mask as an additive (S x S) bias of the
        # compute dtype and keeps it for backward, in every layer (the worst case of documents.row_layout)
        return c.seq_len * c.value_bytes
    return 0.0


KIND = AttentionKind(name="softmax", attend=attend, mixing=lambda seq_len, head_dim: seq_len,
                     activation_bytes=activation_bytes, hf_export=True, document_kernels=("blocks", "flex", "varlen"),
                     varlen=True, draws_dropout=True)
