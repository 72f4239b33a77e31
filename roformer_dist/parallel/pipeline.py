"""RoFormer as a DeepSpeed ``PipelineModule`` (with tensor parallelism inside each stage).

Layer list (the indices are those of DeepSpeed's per-layer checkpoint files ``layer_XX-model_YY``)::

    0        TiedLayerSpec "vocab" -> VocabPipe        embeddings (vocab-parallel words, token types,
                                                        norm, ...) + the MLM decoder bias
    1..L     LayerSpec PipeLayer                        one RoFormerLayer each (tensor-parallel)
    L+1      LayerSpec HeadPipe                         head dense -> act -> LayerNorm, all positions
    L+2      TiedLayerSpec "vocab", forward_fn=decode   predicted positions x tied word embedding shard

Every activation that crosses a stage boundary has a fixed shape for a given (micro-batch, seq_len):
``(hidden (B, S, H) float, attention_mask (B, S) int64, labels (B, S) int64)``; the mask carries the
packed documents' numbers (``roformer_dist.nn.documents``), and each layer derives its attention plan
from it. The labels travel with
the activations, so only the first stage reads data (the last stage gets a dummy iterator); the
gather of the predicted positions (a data-dependent shape) happens inside the last layer.

The decoder weight and bias are tied between the first and the last stage (DeepSpeed broadcasts them
from the first at start and after loading, and all-reduces their gradients across the two). The
bias is used only on the last stage; the first stage adds ``0 * bias[0]`` so that it has a (zero)
gradient to all-reduce.

Stage modules are built from the pieces of an already initialised full ``RoFormerForMaskedLM`` (deep
copies, then sharded), so any layout starts from exactly the weights of the 1-process model.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from roformer_dist.nn.documents import row_layout
from roformer_dist.nn.model import (RoFormerForMaskedLM, RoFormerMLMHead, layer_inputs, masked_lm_loss, rotary_cache,
                                    select_predicted)
from roformer_dist.parallel.tensor import (VocabParallelEmbedding, parallelize_layer, vocab_parallel_bias,
                                           vocab_parallel_decode, vocab_parallel_loss, vocab_range)
from roformer_dist.runtime.deepspeed_import import import_deepspeed

CHECKPOINTABLE = ["PipeLayer"]


class VocabPipe(nn.Module):
    """Embeddings + decoder bias: (input_ids, attention_mask, token_type_ids, labels) -> (hidden, mask, labels)."""

    def __init__(self, model: RoFormerForMaskedLM, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.embeddings = copy.deepcopy(model.embeddings)
        self.embeddings.word_embeddings = VocabParallelEmbedding(model.embeddings.word_embeddings, tp_rank,
                                                                 tp_size, group)
        self.bias = vocab_parallel_bias(model.head.bias, tp_rank, tp_size)
        self.restart = model.config.document_positions == "restart"

    @property
    def weight(self) -> torch.Tensor:
        return self.embeddings.word_embeddings.weight

    def forward(self, inputs):
        input_ids, attention_mask, token_type_ids, labels = inputs
        positions = None
        if self.embeddings.position_embeddings is not None:  # packed documents may restart their positions
            positions = row_layout(attention_mask, self.restart).position_ids
        hidden = self.embeddings(input_ids, token_type_ids, positions)
        hidden = hidden + 0.0 * self.bias[0]  # a zero gradient for the tied bias on this stage
        return hidden, attention_mask, labels


TIED_ATTRS = ["embeddings.word_embeddings.weight", "bias"]


class PipeLayer(nn.Module):
    """One (tensor-parallel) RoFormerLayer: (hidden, mask, labels) -> (hidden, mask, labels)."""

    def __init__(self, model: RoFormerForMaskedLM, index: int, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.layer = parallelize_layer(copy.deepcopy(model.layers[index]), tp_rank, tp_size, group)
        self.config = model.config
        self.rotary = rotary_cache(model.config)

    def forward(self, inputs):
        hidden, attention_mask, labels = inputs
        mask, cos, sin, _ = layer_inputs(self.config, self.rotary, attention_mask, hidden.shape[1], hidden.device)
        return self.layer(hidden, mask, cos, sin), attention_mask, labels


class HeadPipe(nn.Module):
    """Head dense -> act -> LayerNorm on all positions: (hidden, mask, labels) -> (h (B, S, E), labels).

    All positions (not only the predicted ones, as the plain model does) so that the tensor handed to
    the decoder has a fixed shape even if a stage boundary falls here; the head's dense layer is ~1/24
    of a transformer layer's FLOPs."""

    def __init__(self, model: RoFormerForMaskedLM):
        super().__init__()
        self.dense = copy.deepcopy(model.head.dense)
        self.norm = copy.deepcopy(model.head.norm)
        self.act = model.head.act

    transform = RoFormerMLMHead.transform  # the head's own code, on this copy of its dense / act / norm

    def forward(self, inputs):
        hidden, _, labels = inputs
        return self.transform(hidden), labels


def decode(vocab: VocabPipe, inputs):
    """Tied decoder on the predicted positions: (h, labels) -> (logits (N, V_local), target (N,))."""
    h, labels = inputs
    h, target = select_predicted(h, labels)
    return vocab_parallel_decode(h, vocab.weight, vocab.bias, vocab.embeddings.word_embeddings.group), target


class MLMLoss:
    """``loss_fn(outputs, labels)`` of the last stage: vocab-parallel cross-entropy of ``decode``'s output.

    Records (loss, correct, predicted) per micro-batch in ``records`` for the runner's statistics
    (DeepSpeed's pipeline engine returns only the loss). ``inject_nan`` multiplies the loss by NaN
    (the trainer's fault-injection hook)."""

    def __init__(self, vocab_start: int, group):
        self.criterion = functools.partial(vocab_parallel_loss, vocab_start=vocab_start, group=group)
        self.records: list[tuple[float, float, int]] = []
        self.inject_nan = False
        self.__name__ = "MLMLoss"

    def __call__(self, outputs, _labels) -> torch.Tensor:
        logits, target = outputs
        loss, accuracy = masked_lm_loss(logits, target, self.criterion)
        if self.inject_nan:
            loss = loss * float("nan")
        self.records.append((float(loss.detach()), float(accuracy) * target.numel(), target.numel()))
        return loss


def build_pipeline_module(model: RoFormerForMaskedLM, dims, partition_method: str = "type:PipeLayer",
                          activation_checkpointing: bool = False):
    """The ``PipelineModule`` of this rank's stage (built from ``model``'s weights) and its loss function.

    ``partition_method``: ``type:PipeLayer`` balances the transformer layers (embeddings go to the first
    stage, the head to the last), ``parameters`` balances parameter counts, ``uniform`` list entries."""
    import_deepspeed()
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    t = (dims.tp_rank, dims.tp_size, dims.tp_group)
    specs = [TiedLayerSpec("vocab", VocabPipe, model, *t, tied_weight_attr=TIED_ATTRS)]
    specs += [LayerSpec(PipeLayer, model, i, *t) for i in range(len(model.layers))]
    specs += [LayerSpec(HeadPipe, model),
              TiedLayerSpec("vocab", VocabPipe, model, *t, forward_fn=decode, tied_weight_attr=TIED_ATTRS)]
    layout = dims.layout
    topology = PipeModelDataParallelTopology(num_pp=layout.pipeline, num_mp=layout.tensor, num_dp=layout.data)
    assert tuple(topology.get_coord(dims.rank)) == tuple(dims.coord), "rank layouts differ"
    start, _ = vocab_range(model.config.vocab_size, dims.tp_size, dims.tp_rank)
    loss_fn = MLMLoss(start, dims.tp_group)
    module = PipelineModule(layers=specs, topology=topology, loss_fn=loss_fn, partition_method=partition_method,
                            activation_checkpoint_interval=1 if activation_checkpointing else 0,
                            checkpointable_layers=CHECKPOINTABLE)
    return module, loss_fn


def layer_name_map(num_layers: int) -> dict[int, str]:
    """Pipeline layer index -> prefix of the plain model's parameter names (for consolidation)."""
    out = {0: ""}  # VocabPipe: "embeddings.*" as is, "bias" -> "head.bias" (see to_plain_names)
    out.update({i + 1: f"layers.{i}." for i in range(num_layers)})
    out[num_layers + 1] = "head."
    return out


def to_plain_names(index: int, state: dict, num_layers: int) -> dict:
    """One pipeline layer file's state dict -> plain-model names."""
    prefix = layer_name_map(num_layers).get(index)
    if prefix is None:
        return {}
    out = {}
    for k, v in state.items():
        if index == 0:
            out["head.bias" if k == "bias" else k] = v
        elif index <= num_layers:
            out[prefix + k.removeprefix("layer.")] = v
        else:
            out[prefix + k] = v
    return out
