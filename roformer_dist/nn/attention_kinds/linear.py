"""Linear attention (``model.attention: linear``; the paper's section 3.3, eq. 19). With a feature map
phi >= 0, position m attends as

    out_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n  /  sum_n phi(q_m)^T phi(k_n)

R_m the rotation of position m: rotary applies to the feature maps in the numerator only; the denominator stays
unrotated, so it is positive (the paper's remark: the rotated weights need not be, nor sum to one). Both sums
over n are computed once per head,

    KV = sum_n (R_n phi(k_n)) v_n^T   (D x D)        Z = sum_n phi(k_n)   (D)

and every query then costs O(D^2): O(S D^2) time and O(S D + D^2) memory per head, no S x S matrix anywhere.
Padded keys are left out of both sums; everything after the projections is accumulated in fp32. phi(x) =
elu(x) + 1 (Katharopoulos et al. 2020): positive, smooth, linear for x > 0. No 1/sqrt(D) scale (the
normalisation divides it out for a homogeneous map; elu+1 is not, and the scale-free form is the one the paper's
linear variant uses). There is no probability matrix, so ``attention_probs_dropout_prob`` does not apply. Packed
documents go in blocks (its sums are per document). HF's RoFormer has no such attention.
"""

from __future__ import annotations

from typing import Optional

from roformer_dist.nn.attention_kinds.kind import AttentionKind, MemoryContext

__all__ = ["KIND", "linear_attention", "feature_map", "key_padding_mask"]


def feature_map(x):
    """phi(x) = elu(x) + 1 > 0, elementwise (so it commutes with any permutation of head dims)."""
    import torch.nn.functional as F

    return F.elu(x) + 1.0


def key_padding_mask(attn_mask):
    """The model's bool mask (B, 1, 1, S), True = attend -> (B, S); None stays None."""
    import torch

    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
        raise ValueError("linear attention takes a boolean key-padding mask of shape (B, 1, 1, S), got "
                         f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
    return attn_mask[:, 0, 0, :]


def linear_attention(q, k, v, key_mask, cos, sin, kernel: Optional[str]):
    """Eq. 19 above. q, k, v (B, S, H, D) (v already rotated with rotary_value); key_mask (B, S) bool,
    True = a token; cos/sin (S, D/2) or None (no rotary); ``kernel`` the rotary dispatch's name.
    Returns the context (B, S, H, D) in v's dtype."""
    import torch

    from roformer_dist.nn.rotary import run_kernel

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


def attend(q, k, v, attn_mask, cos, sin, kernel, dropout_p: float):
    return linear_attention(q, k, v, key_padding_mask(attn_mask), cos, sin, kernel)


def activation_bytes(c: MemoryContext) -> float:
    return 0.0  # the (D x D) state per head is small beside the dense layers' activations


KIND = AttentionKind(name="linear", attend=attend, mixing=lambda seq_len, head_dim: head_dim,
                     activation_bytes=activation_bytes, hf_export=False, document_kernels=("blocks",),
                     document_note="linear attention keeps documents apart in blocks (its sums are per document): "
                                   "use auto or blocks", row_masks=False)
