"""RoFormer for masked-language-model pretraining: single-device model code, torch only.

Architecture (matches HF ``transformers.RoFormerForMaskedLM``, see ``roformer_dist/hf/convert.py``):
    embeddings   word + token-type (+ learned absolute positions when
                 ``position_embedding="absolute"``, the BERT baseline) -> LayerNorm -> dropout
                 (-> linear embedding_size -> hidden_size when they differ)
    layers       post-LN BERT layers: x = LN(x + drop(out(attn(x)))); x = LN(x + drop(ffn(x)))
                 attention: one fused QKV GEMM, then ``attention.attention_core``: rotary and
                 ``F.scaled_dot_product_attention`` (``attention="softmax"``), or the paper's linear
                 attention with rotary feature maps (``attention="linear"``); packed documents
                 (document numbers in the mask) are kept apart (``documents.row_layout``)
    head         dense -> act -> LayerNorm -> decoder tied to the word embeddings (+ bias)

With labels the vocabulary projection runs only at the predicted positions (labels != -100):
pretraining predicts ~15 % of tokens, so the biggest GEMM of the model shrinks ~7x.
``select_predicted`` + the head + ``masked_lm_loss`` are the masked-LM loss of every layout.

Distribution (DeepSpeed, tensor / pipeline parallelism) is applied from outside; the submodules
``embeddings``, ``layers[i]`` and ``head`` are usable on their own for that, and the seams that
tensor parallelism overrides are methods: ``RoFormerSelfAttention.project / attend / output`` and
``RoFormerMLMHead.decode / full_logits / criterion``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from data_pipeline.masking import IGNORE_INDEX
from roformer_dist.config import ModelConfig, rope_settings, validate_model
from roformer_dist.errors import ConfigError
from roformer_dist.nn import documents
from roformer_dist.nn.attention import attention_core
from roformer_dist.nn.attention_kinds import attention_kind, check_attention
from roformer_dist.nn.documents import Layout, RowMask, RowPlan, device_layout, plan_rows
from roformer_dist.nn.rotary import HALF_LAYOUT, RotaryCache, half_layout_weights, model_kernel


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""``model.hidden_act`` -> function (one entry per value of ``HiddenAct``)."""


@dataclass
class MaskedLMOutput:
    """What :meth:`RoFormerForMaskedLM.forward` returns.

    Without labels only ``logits`` is set. With labels ``loss``, ``accuracy``, ``num_predicted`` and
    ``masked_logits`` are set and ``logits`` is None (the full [B, S, V] projection is never made).
    """

    logits: Optional[torch.Tensor] = None
    """(B, S, V) vocabulary scores, when called without labels."""
    loss: Optional[torch.Tensor] = None
    """fp32 scalar: mean cross-entropy over the predicted positions (0 with a graph if there are none)."""
    accuracy: Optional[torch.Tensor] = None
    """Detached fp32 scalar: fraction of predicted positions whose argmax equals the label."""
    num_predicted: Optional[torch.Tensor] = None
    """int64 scalar tensor on the labels' device: number of positions with labels != -100."""
    masked_logits: Optional[torch.Tensor] = None
    """(N, V) scores at the predicted positions, in row-major (batch, position) order."""


class RoFormerEmbeddings(nn.Module):
    """input_ids, token_type_ids (B, S) -> hidden (B, S, hidden_size)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        emb = cfg.embedding_size or cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, emb, padding_idx=cfg.pad_token_id)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, emb)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings, emb)
                                    if cfg.position_embedding == "absolute" else None)
        self.norm = nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.project = nn.Linear(emb, cfg.hidden_size) if emb != cfg.hidden_size else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``position_ids`` (B, S): the absolute positions' rows (packed documents); None = 0..S-1."""
        x = self.word_embeddings(input_ids)  # (B, S, E)
        if token_type_ids is None:
            # row 0 broadcast: same as embedding a zero tensor, without allocating one
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                x = x + self.position_embeddings.weight[: input_ids.shape[1]]
            else:
                x = x + self.position_embeddings(position_ids)
        x = self.dropout(self.norm(x))
        if self.project is not None:
            x = self.project(x)
        return x


class RoFormerSelfAttention(nn.Module):
    """Fused QKV -> attention core (rotary inside) -> output projection (before the residual and LayerNorm).

    Three seams, each overridable on its own (tensor parallelism adds its collectives there):
    ``project`` (x -> q, k, v), ``attend`` (:func:`roformer_dist.nn.attention.attention_core`) and
    ``output`` (context -> hidden)."""

    SETTINGS = ("num_heads", "head_dim", "rotary_value", "rotary_backend", "dropout_p", "kind", "kernel")
    """Plain attributes (no weights) that a sharded copy takes over."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.rotary_value = cfg.rotary_value
        self.rotary_backend = cfg.rotary_backend
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.kind = cfg.attention
        self.kernel: Optional[str] = None
        """The rotary kernel in use (``rotary.model_kernel``, or a measured choice), set from outside the
        forward by :func:`set_rotary_kernel`; None: not chosen yet (the first eager forward resolves it)."""
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # rows: q, k, v; heads in order
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def project(self, x: torch.Tensor, kernel: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, hidden) -> qkv (B, S, 3, H, D), and the output projection's weight (permuted for the
        rotate-half kernel, see ``rotary.half_layout_weights``)."""
        B, S, _ = x.shape
        weight, bias, out_weight = self.qkv.weight, self.qkv.bias, self.out.weight
        if kernel == HALF_LAYOUT:
            weight, bias, out_weight = half_layout_weights(weight, bias, out_weight, self.num_heads,
                                                           self.head_dim, self.rotary_value)
        qkv = F.linear(x, weight, bias).view(B, S, 3, self.num_heads, self.head_dim)
        return qkv, out_weight

    def attend(self, qkv: torch.Tensor, attn_mask: Optional[torch.Tensor], cos: Optional[torch.Tensor],
               sin: Optional[torch.Tensor], kernel: Optional[str]) -> torch.Tensor:
        """qkv (B, S, 3, H, D) -> context (B, S, H * D)."""
        p = self.dropout_p if self.training else 0.0
        return attention_core(self.kind, qkv, attn_mask, cos, sin, kernel, self.rotary_value, p)

    def output(self, ctx: torch.Tensor, out_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(ctx, out_weight, self.out.bias)

    def kernel_for(self, cos: Optional[torch.Tensor], device: torch.device) -> Optional[str]:
        """The rotary kernel for this layer's inputs: the one held (:attr:`kernel`), None without rotary
        tables. A model nobody chose a kernel for resolves ``rotary_backend`` here once, on the first
        eager forward; a compiled forward must find it chosen (``torch.compile`` cannot trace the
        resolution: it looks for installed packages)."""
        if cos is None:
            return None
        if self.kernel is None:
            self.kernel = model_kernel(self.rotary_backend, device)
        return self.kernel

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        kernel = self.kernel_for(cos, x.device)
        qkv, out_weight = self.project(x, kernel)
        return self.output(self.attend(qkv, attn_mask, cos, sin, kernel), out_weight)


class RoFormerLayer(nn.Module):
    """Post-LN transformer layer: (hidden (B, S, H), mask, cos, sin) -> hidden (B, S, H).

    ``attn_mask``: what ``documents.row_layout`` gives: None, a bool key-padding (B, 1, 1, S) or
    block-diagonal (B, 1, S, S) mask, True = attend, or a ``DocumentPlan`` (an additive float mask works too).
    ``cos``/``sin``: (S, head_dim/2) fp32 rotary tables (or (B, S, head_dim/2), one per row), None for
    absolute positions.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = RoFormerSelfAttention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, hidden: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        kernel = self.attention.kernel_for(cos, hidden.device)
        qkv, out_weight = self.attention.project(hidden, kernel)
        return self.finish(hidden, self.attention.attend(qkv, attn_mask, cos, sin, kernel), out_weight)

    def finish(self, hidden: torch.Tensor, ctx: torch.Tensor, out_weight: torch.Tensor) -> torch.Tensor:
        """After the attention core: output projection, residual + LayerNorm, FFN, residual + LayerNorm.
        ``ctx`` (B, S, hidden) from ``attention.attend``, ``out_weight`` from ``attention.project`` (a seam
        of its own so that the compiled model can run a packed batch's attention eagerly between
        ``project`` and ``finish``)."""
        hidden = self.attention_norm(hidden + self.dropout(self.attention.output(ctx, out_weight)))
        ffn = self.ffn_out(self.act(self.ffn_in(hidden)))
        return self.ffn_norm(hidden + self.dropout(ffn))


class RoFormerMLMHead(nn.Module):
    """hidden (N, H) -> scores (N, V): ``transform`` (dense -> act -> LayerNorm), then ``decode`` (the
    tied decoder + bias); ``criterion`` scores them against the labels.

    The decoder weight is the word-embedding matrix, passed in by the caller (so it is stored
    once in the state dict; a pipeline stage holding the head gets it as a tied parameter).
    The vocabulary-parallel head (parallel/tensor.py) overrides ``decode``, ``full_logits`` and
    ``criterion``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        emb = cfg.embedding_size or cfg.hidden_size
        self.dense = nn.Linear(cfg.hidden_size, emb)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.norm = nn.LayerNorm(emb, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden)))

    def decode(self, h: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, decoder_weight, self.bias)

    def forward(self, hidden: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        return self.decode(self.transform(hidden), decoder_weight)

    def full_logits(self, hidden: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        """Scores over the whole vocabulary at every position (the no-labels output)."""
        return self(hidden, decoder_weight)

    def criterion(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_and_accuracy(logits, target)


def predicted_index(labels: torch.Tensor) -> torch.Tensor:
    """(N,) flat (row-major) positions of a (B, S) label tensor where labels != -100. On the host (the
    loader's workers, :func:`batch_plan`) it costs nothing; on a GPU it is a ``nonzero``, a sync."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def select_predicted(hidden: torch.Tensor, labels: torch.Tensor, index: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, E) states and (B, S) labels -> the (N, E) rows where labels != -100 and their (N,) targets,
    in row-major (batch, position) order. The head then runs on N ~ 0.15 B S rows only. ``index``: those
    positions (:func:`predicted_index`) when the caller has them already."""
    labels = labels.reshape(-1)
    index = predicted_index(labels) if index is None else index  # (N,)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index), labels.index_select(0, index)


def cross_entropy_and_accuracy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and argmax accuracy of (N, V) fp32 scores; the criterion of one device."""
    return F.cross_entropy(logits, target), (logits.detach().argmax(-1) == target).float().mean()


def masked_lm_loss(logits: torch.Tensor, target: torch.Tensor, criterion=cross_entropy_and_accuracy
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLM loss of every layout: (N, V) scores at the predicted positions (or this rank's vocabulary
    slice of them) and their (N,) targets -> (fp32 loss, detached accuracy). ``criterion``: the plain
    cross-entropy or the vocabulary-parallel one. No predicted position: loss 0 that still has a graph
    (so that backward, and DeepSpeed, run as on any batch), accuracy 0."""
    if target.numel() == 0:
        return logits.float().sum() * 0.0, torch.zeros((), device=logits.device)
    return criterion(logits.float(), target)


def document_kernel(cfg: ModelConfig, device) -> str:
    """How this model attends within packed documents on ``device``: ``blocks``, ``flex`` or ``varlen``
    (``model.document_attention``, ``documents.kernel_for``)."""
    return documents.kernel_for(cfg.document_attention, cfg.attention, device)


def plan_batch_rows(cfg: ModelConfig, attention_mask, kernel: str) -> RowPlan:
    """The host's part of :func:`layer_inputs` for a (B, S) mask on the host (``documents.plan_rows`` with
    this model's settings); ``kernel``: :func:`document_kernel` on the device that will run it."""
    return plan_rows(attention_mask, cfg.document_positions == "restart", blocks_only=not attention_kind(cfg.attention).row_masks,
                     kernel=kernel)


def batch_plan(cfg: ModelConfig, device_type: str):
    """What the loader's workers add to each training batch (``ShardLoader(prepare=...)``), so that the
    training step reads nothing back from the device: the document layout (``layout``, a
    ``documents.RowPlan``), the predicted positions (``predicted``) and the number of tokens (``num_tokens``,
    an int). ``device_type``: where the model runs (it decides the document kernel). Flex attention trains
    only on CUDA (torch has no backward for it on CPU), varlen only with flash-attn on CUDA: asked for
    elsewhere, a ConfigError."""
    kernel = document_kernel(cfg, torch.device(device_type))
    if kernel == "flex" and (device_type != "cuda" or not documents.flex_available()):
        raise ConfigError("model.document_attention: flex trains on CUDA only, with torch >= 2.5 (torch "
                          f"{torch.__version__} on {device_type} has no backward for flex attention there); "
                          "use auto or blocks")
    if kernel == "varlen" and (device_type != "cuda" or not documents.flash_varlen_available()):
        raise ConfigError(f"model.document_attention: varlen needs flash-attn and a CUDA device (here: {device_type}, "
                          f"flash-attn {'loads' if documents.flash_varlen_available() else 'not installed or does not load'}); "
                          "use auto or blocks")
    return functools.partial(_batch_plan, cfg, kernel)


def _batch_plan(cfg: ModelConfig, kernel: str, batch: dict) -> dict:
    mask = batch["attention_mask"]
    return {"layout": plan_batch_rows(cfg, mask, kernel), "predicted": predicted_index(batch["labels"]),
            "num_tokens": int(mask.count_nonzero())}


def layer_inputs(cfg: ModelConfig, rotary: Optional[RotaryCache], attention_mask: Optional[torch.Tensor],
                 seq_len: int, device: torch.device, plan: Optional[RowPlan] = None) -> Layout:
    """What every layer takes besides the hidden states (attn_mask, cos, sin) and the embeddings'
    position rows, for a (B, S) mask (0 = padding, else document numbers, see
    :mod:`roformer_dist.nn.documents`); the mask is None when nothing is masked (SDPA's fastest kernels).
    ``plan``: the mask's :class:`~roformer_dist.nn.documents.RowPlan` on ``device`` (from the loader); without
    it the mask is read on the host here. Also the pipeline stages' code."""
    cos, sin = rotary.get(seq_len, device) if rotary is not None else (None, None)
    if attention_mask is None:
        return Layout(None, cos, sin, None)
    if plan is None:
        plan = plan_batch_rows(cfg, attention_mask.detach().cpu(), document_kernel(cfg, device)).to(device)
    return device_layout(plan, attention_mask, cos, sin)


def rotary_cache(cfg: ModelConfig) -> Optional[RotaryCache]:
    """The cos/sin cache of a rotary model with its own rope settings (``config.rope_settings(cfg)``; None
    with absolute positions). ``rotary.set_rope`` changes them on a built model."""
    if cfg.position_embedding != "rotary":
        return None
    return RotaryCache(cfg.hidden_size // cfg.num_attention_heads, cfg.max_position_embeddings, rope_settings(cfg))


class RoFormerForMaskedLM(nn.Module):
    """RoFormer encoder + MLM head. ``forward(input_ids, attention_mask, token_type_ids, labels)``; the mask
    is 0 on padding and may number packed documents (1, 2, ...), which then attend only to themselves."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg.vocab_size, int):
            raise ValueError(f"model.vocab_size: the model needs an integer, got {cfg.vocab_size!r} "
                             "(resolve 'auto' from the shard manifest first)")
        validate_model(cfg)
        check_attention(cfg.attention, cfg.document_attention)
        self.config = cfg
        # Modules draw their default init from the RNG; rewind it so that the weights depend only
        # on init_weights(): seed s -> same weights as ``torch.manual_seed(s); model.init_weights()``.
        rng = torch.get_rng_state()
        self.embeddings = RoFormerEmbeddings(cfg)
        self.layers = nn.ModuleList(RoFormerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.head = RoFormerMLMHead(cfg)
        self.rotary = rotary_cache(cfg)
        self.gradient_checkpointing = False
        torch.set_rng_state(rng)
        self.init_weights()

    # ----------------------------------------------------------------------- init

    def _init_module(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, RoFormerMLMHead):
            nn.init.zeros_(module.bias)

    def init_weights(self) -> None:
        """Deterministic from torch's global RNG: N(0, initializer_range) weights, zero biases,
        LayerNorm ones/zeros, [PAD] embedding row zero. Modules in ``self.modules()`` order."""
        self.apply(self._init_module)

    # ----------------------------------------------------------------------- pieces

    def rotary_tables(self, seq_len: int, device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """fp32 cos/sin (seq_len, head_dim/2) for the layers; (None, None) with absolute positions."""
        if self.rotary is None:
            return None, None
        return self.rotary.get(seq_len, device)

    def encode(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
               token_type_ids: Optional[torch.Tensor] = None, layout: Optional[RowPlan] = None) -> torch.Tensor:
        """Final hidden states (B, S, hidden). ``layout``: the mask's plan on the device (see :meth:`forward`)."""
        S = input_ids.shape[1]
        if S > self.config.max_position_embeddings and self.rotary is None:
            raise ValueError(f"sequence length {S} exceeds model.max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        mask, cos, sin, positions = layer_inputs(self.config, self.rotary, attention_mask, S, input_ids.device,
                                                 layout)
        return self.stack(input_ids, token_type_ids, mask, cos, sin, positions)

    def stack(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor], mask: RowMask,
              cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
              positions: Optional[torch.Tensor]) -> torch.Tensor:
        """Embeddings and layers on :func:`layer_inputs`' layout -> hidden (B, S, hidden). The part of
        ``encode`` with shapes fixed by (B, S): what ``parallel/compiled.py`` compiles (the host-side
        planning of packed documents stays outside)."""
        hidden = self.embeddings(input_ids, token_type_ids, positions)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden = checkpoint(layer, hidden, mask, cos, sin, use_reentrant=False)
            else:
                hidden = layer(hidden, mask, cos, sin)
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None, *,
                layout: Optional[RowPlan] = None, predicted: Optional[torch.Tensor] = None) -> MaskedLMOutput:
        """``layout`` and ``predicted``: what :func:`batch_plan` computed on the host for this batch, on the
        model's device. Given them, the forward reads nothing back from the device (no sync on a GPU);
        without them it computes them from the mask and labels (one copy to the host each)."""
        hidden = self.encode(input_ids, attention_mask, token_type_ids, layout)  # (B, S, H)
        decoder_weight = self.embeddings.word_embeddings.weight
        if labels is None:
            return MaskedLMOutput(logits=self.head.full_logits(hidden, decoder_weight))
        # gather first: the head and the vocabulary GEMM only see the N predicted positions
        h, target = select_predicted(hidden, labels, predicted)
        logits, loss, accuracy = self.predict(h, target)
        # torch.full, not torch.tensor: a fill on the device, where a copy from the host would wait for it
        count = torch.full((), target.numel(), dtype=torch.int64, device=labels.device)
        return MaskedLMOutput(loss=loss, accuracy=accuracy, num_predicted=count, masked_logits=logits)

    def predict(self, h: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head and the loss on the (N, E) predicted rows: (N, V) scores, loss, accuracy. Its own
        method because N changes from batch to batch (``parallel/compiled.py`` compiles it with N dynamic)."""
        logits = self.head(h, self.embeddings.word_embeddings.weight)  # (N, V)
        loss, accuracy = masked_lm_loss(logits, target, self.head.criterion)
        return logits, loss, accuracy

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, predicted_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward = 3x forward) per token, matmuls only.

        Dense layers 2*params-per-token each, attention 2 * 2 * mixing * hidden per layer (the kind's ``mixing``:
        softmax S, its scores and context; linear head_dim, its KV state and the query against it), and the
        vocabulary projection only on ``predicted_fraction`` of the tokens.
        """
        c = self.config
        emb = c.embedding_size or c.hidden_size
        h, f, n = c.hidden_size, c.intermediate_size, c.num_hidden_layers
        mixing = attention_kind(c.attention).mixing(seq_len, h // c.num_attention_heads)
        per_layer = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * mixing * h
        proj = 2 * emb * h if emb != h else 0
        head = predicted_fraction * (2 * h * emb + 2 * emb * c.vocab_size)
        return 3.0 * (n * per_layer + proj + head)


def set_rotary_kernel(module: nn.Module, kernel: Optional[str]) -> int:
    """Make every attention layer reachable from ``module`` (a model, its tensor-parallel form, a pipeline
    stage, a DeepSpeed engine) use the rotary ``kernel`` (a name from ``rotary.model_kernel`` or a measured
    choice; None: resolve again on the next eager forward). Returns how many layers took it. Called when a
    model is built for a device and at each curriculum stage, never inside the forward."""
    layers = [m for m in module.modules() if isinstance(m, RoFormerSelfAttention)]
    for m in layers:
        m.kernel = kernel
    return len(layers)


def rotary_kernel_of(module: nn.Module) -> Optional[str]:
    """The rotary kernel the attention layers of ``module`` hold (None: none chosen, or no layers)."""
    return next((m.kernel for m in module.modules() if isinstance(m, RoFormerSelfAttention)), None)


__all__ = ["RoFormerForMaskedLM", "RoFormerEmbeddings", "RoFormerLayer", "RoFormerSelfAttention",
           "RoFormerMLMHead", "MaskedLMOutput", "IGNORE_INDEX", "ACTIVATIONS", "select_predicted",
           "predicted_index", "cross_entropy_and_accuracy", "masked_lm_loss", "rotary_cache", "layer_inputs",
           "batch_plan", "plan_batch_rows", "set_rotary_kernel", "rotary_kernel_of"]
