"""Our RoFormerForMaskedLM on its own: outputs, loss, init, masks, absolute positions, backends."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from roformer_dist.config import ModelConfig
from roformer_dist.nn import attention as A
from roformer_dist.nn import rotary as R
from roformer_dist.nn.attention_kinds.softmax import eager_softmax_attention
from roformer_dist.nn.model import RoFormerForMaskedLM

VOCAB = 101


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, rotary_backend="reference")
    base.update(kw)
    return ModelConfig(**base)


def make(cfg: ModelConfig, seed: int = 0, perturb: bool = True) -> RoFormerForMaskedLM:
    torch.manual_seed(seed)
    model = RoFormerForMaskedLM(cfg)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(B=3, S=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    labels = torch.where(torch.rand(B, S, generator=g) < 0.25, ids, -100)
    return ids, labels


def test_logits_shape_and_output_fields():
    model = make(tiny()).eval()
    ids, labels = batch()
    out = model(ids)
    assert out.logits.shape == (3, 20, VOCAB) and out.loss is None
    out = model(ids, labels=labels)
    assert out.logits is None
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0 and out.loss.requires_grad
    assert out.accuracy.dim() == 0 and not out.accuracy.requires_grad
    assert out.num_predicted.dtype == torch.int64 and out.num_predicted.item() == int((labels != -100).sum())
    assert out.masked_logits.shape == (out.num_predicted.item(), VOCAB)


def test_masked_loss_equals_full_logits_loss_and_grads():
    model = make(tiny(embedding_size=16)).eval()
    ids, labels = batch()
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(ids).logits
    full = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    full.backward()
    torch.testing.assert_close(out.loss, full, atol=1e-6, rtol=1e-6)
    sel = labels != -100
    torch.testing.assert_close(out.accuracy, (logits[sel].argmax(-1) == labels[sel]).float().mean())
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_no_predicted_positions_gives_zero_loss_with_graph():
    model = make(tiny())
    ids, _ = batch()
    out = model(ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0 and out.num_predicted.item() == 0
    out.loss.backward()  # must not raise


def test_init_is_deterministic_and_follows_the_recipe():
    cfg = tiny(initializer_range=0.05, pad_token_id=3, embedding_size=16)
    a, b = make(cfg, perturb=False), make(cfg, perturb=False)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert torch.all(a.embeddings.word_embeddings.weight[3] == 0)
    assert torch.all(a.layers[0].attention_norm.weight == 1) and torch.all(a.layers[0].attention_norm.bias == 0)
    assert torch.all(a.layers[0].attention.qkv.bias == 0) and torch.all(a.head.bias == 0)
    std = a.layers[0].ffn_in.weight.std().item()
    assert 0.04 < std < 0.06
    c = make(cfg, seed=1, perturb=False)
    assert not torch.equal(a.layers[0].ffn_in.weight, c.layers[0].ffn_in.weight)
    # re-initialising from the same RNG state reproduces the weights
    torch.manual_seed(0)
    a.init_weights()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_padding_does_not_leak_into_real_tokens():
    model = make(tiny()).eval()
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    other = ids.clone()
    other[1, 12:] = torch.randint(1, VOCAB, (8,))  # different content at padded positions
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
    torch.testing.assert_close(a[1, :12], b[1, :12], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[0], b[0])


def test_token_types_change_the_output():
    model = make(tiny()).eval()
    ids, _ = batch()
    with torch.no_grad():
        a = model(ids).logits
        b = model(ids, token_type_ids=torch.zeros_like(ids)).logits
        c = model(ids, token_type_ids=torch.ones_like(ids)).logits
    torch.testing.assert_close(a, b)  # None = all type 0
    assert not torch.allclose(a, c)


def test_submodules_compose_to_forward():
    model = make(tiny(embedding_size=16)).eval()
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    with torch.no_grad():
        h = model.embeddings(ids, None)
        bias = mask.bool()[:, None, None, :]
        cos, sin = model.rotary_tables(ids.shape[1], ids.device)
        for layer in model.layers:
            h = layer(h, bias, cos, sin)
        logits = model.head(h, model.embeddings.word_embeddings.weight)
        torch.testing.assert_close(logits, model(ids, mask).logits)


def test_gradient_checkpointing_gives_same_loss_and_grads():
    cfg = tiny()
    ids, labels = batch()
    results = []
    for ckpt in (False, True):
        model = make(cfg).train()
        model.gradient_checkpointing = ckpt
        loss = model(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for g0, g1 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g0, g1)


def test_dropout_only_in_training_and_eager_cpu_path():
    cfg = tiny(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)
    model = make(cfg)
    ids, _ = batch()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
    model.train()
    with torch.no_grad():
        torch.manual_seed(1)
        a = model(ids).logits
        torch.manual_seed(1)
        b = model(ids).logits
        c = model(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_eager_attention_matches_sdpa_without_dropout():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., 6:] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.manual_seed(0)
    got = eager_softmax_attention(q, k, v, mask, 1e-9)  # dropout on, with a negligible probability
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_absolute_position_switch():
    cfg = tiny(position_embedding="absolute")
    model = make(cfg).eval()
    assert model.rotary is None and model.embeddings.position_embeddings is not None
    assert "embeddings.position_embeddings.weight" in model.state_dict()
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    assert model.embeddings.position_embeddings.weight.grad.abs().sum() > 0
    # without position embeddings (zeroed) and without rotary the encoder is permutation-equivariant:
    # that shows no rotary is applied when position_embedding=absolute
    with torch.no_grad():
        model.embeddings.position_embeddings.weight.zero_()
        perm = torch.randperm(ids.shape[1])
        a = model(ids).logits[:, perm]
        b = model(ids[:, perm]).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    rotary_model = make(tiny()).eval()
    with torch.no_grad():
        assert not torch.allclose(rotary_model(ids).logits[:, perm], rotary_model(ids[:, perm]).logits, atol=1e-3)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 65, dtype=torch.long))


def test_rotary_cache_extends_beyond_max_positions():
    model = make(tiny(max_position_embeddings=16)).eval()
    with torch.no_grad():
        out = model(torch.ones(1, 40, dtype=torch.long)).logits
    assert out.shape == (1, 40, VOCAB) and torch.isfinite(out).all()


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("rotary_value", [False, True], ids=["qk", "qkv"])
def test_apex_weight_permutation_path_matches_reference(monkeypatch, rotary_value, attention):
    """The model's apex path (permuted QKV rows + rotate-half kernel) with the reference rotate-half
    formula standing in for apex's kernel gives the reference model's outputs and gradients. With
    linear attention too: its feature map is elementwise, so it commutes with the permutation."""
    cfg = tiny(rotary_value=rotary_value, attention=attention)
    ids, labels = batch()
    ref = make(cfg)
    apex = make(dataclasses.replace(cfg, rotary_backend="apex"))
    apex.load_state_dict(ref.state_dict())
    monkeypatch.setattr(R, "rotate_half_kernel", R.rotate_half_reference)
    real_resolve = R.resolve_backend
    monkeypatch.setattr(R, "resolve_backend", lambda b, d: "apex" if b == "apex" else real_resolve(b, d))
    out_ref, out_apex = ref(ids, labels=labels), apex(ids, labels=labels)
    torch.testing.assert_close(out_apex.loss, out_ref.loss, atol=1e-6, rtol=1e-6)
    out_ref.loss.backward()
    out_apex.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), apex.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_bf16_model_runs_and_loss_is_fp32():
    model = make(tiny()).to(torch.bfloat16)
    ids, labels = batch()
    out = model(ids, labels=labels)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.layers[0].attention.qkv.weight.grad.dtype == torch.bfloat16
    # the rotary tables stay fp32 after .to(bfloat16)
    assert model.rotary_tables(8, torch.device("cpu"))[0].dtype == torch.float32


def test_vocab_size_must_be_resolved():
    with pytest.raises(ValueError, match="vocab_size"):
        RoFormerForMaskedLM(ModelConfig(vocab_size="auto", hidden_size=32, num_attention_heads=4))


def test_flops_per_token_counts_masked_projection():
    model = make(tiny(), perturb=False)
    full, masked = model.flops_per_token(128, 1.0), model.flops_per_token(128, 0.15)
    assert masked < full
    assert full - masked == pytest.approx(3 * 0.85 * (2 * 32 * 32 + 2 * 32 * VOCAB))
