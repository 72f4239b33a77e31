"""Linear attention with rotary feature maps (the paper's section 3.3): the O(S) path against a naive
O(S^2) evaluation of eq. 19, the model built with it, and an exact resume of a run that uses it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import test_model
from roformer_dist.nn import attention as A
from roformer_dist.nn import rotary as R
from roformer_dist.config import ModelConfig
from roformer_dist.nn.model import RoFormerForMaskedLM
from test_model import VOCAB, batch, make


def rotation_matrices(S: int, D: int) -> torch.Tensor:
    """(S, D, D) float64: R_m, block-diagonal 2x2 rotations of the pairs (2i, 2i+1) by m / 10000^(2i/D)."""
    rot = torch.zeros(S, D, D, dtype=torch.float64)
    for m in range(S):
        for i in range(D // 2):
            theta = m / 10000 ** (2 * i / D)
            c, s = math.cos(theta), math.sin(theta)
            rot[m, 2 * i, 2 * i], rot[m, 2 * i, 2 * i + 1] = c, -s
            rot[m, 2 * i + 1, 2 * i], rot[m, 2 * i + 1, 2 * i + 1] = s, c
    return rot


def naive_linear_attention(q, k, v, mask, rotary: bool):
    """Eq. 19 written out with an explicit (B, H, S, S) weight matrix, in float64.
    q, k, v (B, S, H, D); mask (B, S) 1 = token. Returns (B, S, H, D)."""
    q, k, v = q.double(), k.double(), v.double()
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    S, D = q.shape[1], q.shape[-1]
    if rotary:
        rot = rotation_matrices(S, D)
        rq = torch.einsum("sde,bshe->bshd", rot, phi_q)
        rk = torch.einsum("sde,bshe->bshd", rot, phi_k)
    else:
        rq, rk = phi_q, phi_k
    keep = mask.double()[:, None, None, :]                               # (B, 1, 1, S_n)
    numer = torch.einsum("bmhd,bnhd->bhmn", rq, rk) * keep               # (B, H, S_m, S_n)
    denom = (torch.einsum("bmhd,bnhd->bhmn", phi_q, phi_k) * keep).sum(-1, keepdim=True)
    weights = numer / denom
    return torch.einsum("bhmn,bnhd->bmhd", weights, v)


def random_qkv(B=2, S=13, H=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, S, 3, H, D, generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[-1, S - 4:] = 0  # padding at the end of the last sequence
    return qkv, mask


@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "no_rope"])
def test_linear_path_equals_naive_formula_with_padding_and_gradients(rotary):
    qkv, mask = random_qkv()
    S, D = qkv.shape[1], qkv.shape[-1]
    cos, sin = R.rotary_tables(S, D) if rotary else (None, None)
    attn_mask = mask.bool()[:, None, None, :]

    ours_in = qkv.clone().requires_grad_()
    ours = A.attention_core("linear", ours_in, attn_mask, cos, sin, "reference" if rotary else None,
                            rotary_value=False, dropout_p=0.0)  # (B, S, H * D)
    ref_in = qkv.double().requires_grad_()
    ref = naive_linear_attention(*ref_in.unbind(2), mask, rotary).reshape(ours.shape)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)

    grad_out = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    ours.backward(grad_out)
    ref.backward(grad_out.double())
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, atol=1e-5, rtol=1e-5)
    # padded keys contribute nothing: their q/k/v receive no gradient from the real positions' output
    assert torch.all(ours_in.grad[1, S - 4:, 1:] == 0)


def test_linear_path_is_not_trivially_position_free():
    """With rotary the output depends on the positions (a shifted copy of the keys changes it); the
    naive test above would pass for a path that ignored rotation only if rotation did nothing."""
    qkv, mask = random_qkv(B=1)
    S, D = qkv.shape[1], qkv.shape[-1]
    cos, sin = R.rotary_tables(S, D)
    with_rope = A.attention_core("linear", qkv, None, cos, sin, "reference", False, 0.0)
    without = A.attention_core("linear", qkv, None, None, None, None, False, 0.0)
    assert not torch.allclose(with_rope, without, atol=1e-3)


def test_bf16_inputs_accumulate_in_fp32():
    qkv, mask = random_qkv(S=64)
    cos, sin = R.rotary_tables(64, 8)
    attn_mask = mask.bool()[:, None, None, :]
    low = A.attention_core("linear", qkv.bfloat16(), attn_mask, cos, sin, "reference", False, 0.0)
    exact = A.attention_core("linear", qkv.bfloat16().float(), attn_mask, cos, sin, "reference", False, 0.0)
    assert low.dtype == torch.bfloat16
    # the only bf16 rounding is the final cast: within one bf16 ulp of the fp32 result on the same inputs
    torch.testing.assert_close(low.float(), exact, atol=1e-2, rtol=8e-3)


def test_all_padding_row_gives_zeros_not_nan():
    qkv, _ = random_qkv(B=1)
    mask = torch.zeros(1, 1, 1, qkv.shape[1], dtype=torch.bool)
    out = A.attention_core("linear", qkv, mask, None, None, None, False, 0.0)
    assert torch.all(out == 0)


def test_linear_attention_rejects_float_masks():
    qkv, _ = random_qkv(B=1)
    with pytest.raises(ValueError, match="key-padding mask"):
        A.attention_core("linear", qkv, torch.zeros(1, 1, 1, qkv.shape[1]), None, None, None, False, 0.0)


# --------------------------------------------------------------------------- the model with it


def tiny(**kw) -> ModelConfig:
    return test_model.tiny(**{"attention": "linear", **kw})


def test_linear_model_trains_and_padding_does_not_leak():
    model = make(tiny())
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    out = model(ids, mask, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.layers[0].attention.qkv.weight.grad.abs().sum() > 0
    other = ids.clone()
    other[1, 12:] = torch.randint(1, VOCAB, (8,))
    model.eval()
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask).logits, model(other, attention_mask=mask).logits
    torch.testing.assert_close(a[1, :12], b[1, :12], atol=1e-6, rtol=1e-6)


def test_linear_without_rope_uses_absolute_positions():
    """The comparison's "linear without RoPE" is position_embedding=absolute: no rotation anywhere
    (with the position table zeroed the encoder is permutation-equivariant), unlike the rotary model."""
    model = make(tiny(position_embedding="absolute")).eval()
    ids, labels = batch()
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.zero_()
        perm = torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(ids).logits[:, perm], model(ids[:, perm]).logits, atol=1e-5, rtol=1e-5)
        rope = make(tiny()).eval()
        assert not torch.allclose(rope(ids).logits[:, perm], rope(ids[:, perm]).logits, atol=1e-3)


def test_linear_flops_do_not_grow_with_length():
    soft = make(tiny(attention="softmax"))
    lin = make(tiny())
    assert lin.flops_per_token(4096) == lin.flops_per_token(128)
    assert soft.flops_per_token(4096) > soft.flops_per_token(128)
    assert lin.flops_per_token(128) < soft.flops_per_token(128)  # head_dim 8 < 128 positions


def test_finetune_native_classifier_takes_a_linear_encoder():
    """roformer-finetune trains models HF cannot express with our encoder (the native backend): a linear
    model's weights load into it and it computes the pretrained model's [CLS] state, with gradients."""
    from roformer_dist.finetune.models import NativeClassifier

    cfg = tiny()
    pretrained = make(cfg).eval()
    clf = NativeClassifier(cfg, num_labels=3)
    clf.load_encoder(pretrained.state_dict())
    clf.eval()
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    with torch.no_grad():
        torch.testing.assert_close(clf.encoder.encode(ids, mask), pretrained.encode(ids, mask))
    logits = clf(ids, mask)
    assert logits.shape == (3, 3)
    logits.sum().backward()
    assert clf.encoder.layers[0].attention.qkv.weight.grad.abs().sum() > 0


def test_attention_dropout_is_not_drawn_by_linear_attention():
    """Linear attention has no probabilities: in training, attention_probs_dropout_prob changes nothing."""
    ids, labels = batch()
    losses = []
    for p in (0.0, 0.5):
        model = make(tiny(attention_probs_dropout_prob=p)).train()
        torch.manual_seed(3)
        losses.append(model(ids, labels=labels).loss)
    assert torch.equal(losses[0], losses[1])


# --------------------------------------------------------------------------- training: curriculum, ZeRO-3, resume


@pytest.mark.slow  # ~25 s on 2 quiet cores, ~55 s under load
def test_linear_model_stops_and_resumes_exactly(small_shards, tmp_path):
    """2 gloo ranks, ZeRO-3, a two-stage curriculum (128 -> 256): stopped inside the second stage and
    resumed in fresh processes, the loss trace equals the uninterrupted run's; the checkpoint
    consolidates into a linear-attention model."""
    from test_trainer import assert_traces_equal, make_cfg, trace, train

    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    common = ("curriculum.stages=[{name: a, seq_len: 128, global_batch_size: 8, steps: 3}, "
              "{name: b, seq_len: 256, global_batch_size: 8, steps: 3}]",
              "model.attention=linear", "deepspeed.zero_stage=3")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train(make_cfg(small_shards, ref, *common)) == [0, 0]
    assert train(make_cfg(small_shards, run, *common, "trainer.stop_at_step=4")) == [0, 0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert train(make_cfg(small_shards, run, *common)) == [0, 0]
    assert trace(run, "seq_len") == [128] * 3 + [256] * 3
    assert_traces_equal(trace(ref), trace(run), tol=0.0)

    mcfg, sd = load_checkpoint_weights(run / "checkpoints" / "step_00000006")
    assert mcfg.attention == "linear"
    model = RoFormerForMaskedLM(mcfg)
    model.load_state_dict(sd, strict=False)  # strict=False: the consolidated dict may hold tied copies
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())
