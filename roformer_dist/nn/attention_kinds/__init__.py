"""Attention kinds (``model.attention``): each one module that declares, in one place, how it attends and what
the rest of the framework needs to know of it; :data:`ATTENTION` names them.

A kind is an :class:`~roformer_dist.nn.attention_kinds.kind.AttentionKind` (``kind.py``):

- ``attend(q, k, v, mask, cos, sin, kernel, dropout_p)``: projected q, k, v (B, S, H, D) -> context (B, S, H, D);
  the rotary tables are the kind's to apply (softmax rotates q and k, linear its feature maps);
- ``mixing(seq_len, head_dim)``: how many positions (or features) each token's attention spans, for the FLOPs
  per token (``2 * 2 * mixing * hidden`` per layer and forward: ``RoFormerForMaskedLM.flops_per_token``);
- ``activation_bytes(ctx)``: bytes per token and layer its backward keeps beyond the dense layers' (the
  memory estimate, ``launch/memory_estimate.py``);
- ``hf_export``: HF's RoFormer computes it (``roformer-convert to-hf`` refuses the others);
- ``document_kernels``: the ``model.document_attention`` kernels it runs packed documents with (and
  ``document_note``, said when another is asked for); ``row_masks``: a row of several documents may go through
  one masked call; ``varlen``: it takes flash-attn's varlen form;
- ``draws_dropout``: it draws from the RNG when ``attention_probs_dropout_prob`` > 0.

``softmax.py`` and ``linear.py`` are the two the paper describes. A new kind is one module here and one line in :data:`ATTENTION` (docs/architecture/changing-things.md).
torch is imported in the kinds' functions: the launcher checks a config's kind (:func:`check_attention`)
without importing torch.
"""

from __future__ import annotations

from roformer_dist.errors import ConfigError
from roformer_dist.nn.attention_kinds import linear, softmax
from roformer_dist.nn.attention_kinds.kind import AttentionKind, MemoryContext

__all__ = ["ATTENTION", "AttentionKind", "MemoryContext", "attention_kind", "check_attention"]


ATTENTION: dict[str, AttentionKind] = {
    "softmax": softmax.KIND,
    "linear": linear.KIND,
}
"""Every attention kind by its ``model.attention`` name."""


def attention_kind(name: str) -> AttentionKind:
    """The kind ``model.attention`` names; ConfigError naming the key for another name."""
    try:
        return ATTENTION[name]
    except KeyError:
        raise ConfigError(f"model.attention: {name!r} is not an attention kind; expected one of "
                          f"{', '.join(ATTENTION)}") from None


def check_attention(name: str, document_attention: str = "auto") -> AttentionKind:
    """``model.attention``'s kind, and the ``model.document_attention`` it runs packed documents with; ConfigError
    naming the key."""
    kind = attention_kind(name)
    setting = document_attention
    if setting != "auto" and setting not in kind.document_kernels:
        raise ConfigError(f"model.document_attention: {kind.name} attention does not run {setting}; "
                          f"{kind.document_note or 'use one of ' + ', '.join(('auto', *kind.document_kernels))}")
    return kind
