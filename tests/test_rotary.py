"""Rotary embedding: the convention, the paper's properties, and every backend against the reference."""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys

import numpy as np
import pytest
import torch

from roformer_dist.nn import rotary as R


def naive_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Written straight from the paper, pair by pair: (x[2i], x[2i+1]) rotated by theta_i; x (B, S, H, D)."""
    out = torch.empty_like(x, dtype=torch.float32)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x1 * c + x0 * s
    return out.to(x.dtype)


def make_qk(B=2, S=16, H=3, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = torch.randn(B, S, H, D, generator=g).to(dtype)
    return q, k


def test_tables_match_hf_sinusoidal():
    from transformers.models.roformer.modeling_roformer import RoFormerSinusoidalPositionalEmbedding

    emb = RoFormerSinusoidalPositionalEmbedding(300, 64)
    hf = emb.create_weight()  # (S, D): [sin | cos]
    cos, sin = R.rotary_tables(300, 64)
    torch.testing.assert_close(torch.cat((sin, cos), -1), hf, atol=1e-7, rtol=0)
    assert cos.dtype == torch.float32


def test_cache_extends_on_demand_and_stays_fp32():
    cache = R.RotaryCache(head_dim=8, max_len=32)
    cos, sin = cache.get(16)
    assert cos.shape == (16, 4) and cos.dtype == torch.float32
    cos2, sin2 = cache.get(100)  # longer than max_len: rebuilt, prefix identical
    assert cos2.shape == (100, 4)
    assert torch.equal(cos2[:16], cos) and torch.equal(sin2[:16], sin)
    ref_cos, ref_sin = R.rotary_tables(100, 8)
    assert torch.equal(cos2, ref_cos) and torch.equal(sin2, ref_sin)


def test_reference_matches_naive_and_hf():
    from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention

    q, k = make_qk(D=16)
    cos, sin = R.rotary_tables(q.shape[1], 16)
    qr, kr = R.apply_rotary(q, k, cos, sin, backend="reference")
    torch.testing.assert_close(qr, naive_rotary(q, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kr, naive_rotary(k, cos, sin), atol=1e-6, rtol=1e-6)
    table = torch.cat((sin, cos), -1)[None, :, None, :]  # HF's layout, broadcast over (B, S, H, D)
    hq, hk = RoFormerSelfAttention.apply_rotary_position_embeddings(table, q, k)
    torch.testing.assert_close(qr, hq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kr, hk, atol=1e-6, rtol=1e-6)


def _assert_reference_backward_matches_naive(S: int, D: int, **rope) -> None:
    q, k = make_qk(S=S, D=D)
    cos, sin = R.rotary_tables(S, D, **rope)
    gq, gk = make_qk(S=S, D=D, seed=1)
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(R.apply_rotary(q1, k1, cos, sin, "reference"), (gq, gk))
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward((naive_rotary(q2, cos, sin), naive_rotary(k2, cos, sin)), (gq, gk))
    torch.testing.assert_close(q1.grad, q2.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k1.grad, k2.grad, atol=1e-6, rtol=1e-6)


def test_reference_backward_matches_autograd_of_naive():
    _assert_reference_backward_matches_naive(16, 8)


def test_reference_accepts_strided_views_of_a_fused_projection():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 10, 3, 4, 8, generator=g)  # (B, S, 3, H, D) as the model's QKV GEMM gives
    q, k, _ = qkv.unbind(2)
    cos, sin = R.rotary_tables(10, 8)
    qr, kr = R.apply_rotary(q, k, cos, sin, "reference")
    torch.testing.assert_close(qr, naive_rotary(q.contiguous(), cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kr, naive_rotary(k.contiguous(), cos, sin), atol=1e-6, rtol=1e-6)


def test_score_depends_only_on_relative_offset():
    """q.k after rotation at positions (m, n) equals that at (m + s, n + s): RoFormer's key property."""
    D, S = 16, 64
    g = torch.Generator().manual_seed(0)
    qv, kv = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q = qv.expand(1, S, 1, D).contiguous()  # the same vectors at every position
    k = kv.expand(1, S, 1, D).contiguous()
    cos, sin = R.rotary_tables(S, D)
    qr, kr = R.apply_rotary(q, k, cos, sin, "reference")
    scores = qr[0, :, 0] @ kr[0, :, 0].T  # (S, S): scores[m, n]
    for m, n in [(0, 5), (7, 3), (10, 10), (2, 40)]:
        for shift in (1, 9, 20):
            torch.testing.assert_close(scores[m + shift, n + shift], scores[m, n], atol=1e-4, rtol=1e-5)
    # and it does depend on the offset (not a trivial identity)
    assert not torch.allclose(scores[0, 1], scores[0, 9], atol=1e-3)


def test_rotation_preserves_norms_per_pair():
    q, k = make_qk(S=50, D=32)
    cos, sin = R.rotary_tables(50, 32)
    qr, _ = R.apply_rotary(q, k, cos, sin, "reference")
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)
    pair = lambda x: x.unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair(qr), pair(q), atol=1e-5, rtol=1e-5)


def test_position_zero_is_identity():
    q, k = make_qk(S=4, D=8)
    cos, sin = R.rotary_tables(4, 8)
    qr, _ = R.apply_rotary(q, k, cos, sin, "reference")
    assert torch.equal(qr[:, 0], q[:, 0])


def test_resolve_backend():
    assert R.resolve_backend("auto", "cpu") == "reference"
    assert R.resolve_backend("compiled", "cpu") == "compiled"
    with pytest.raises(ValueError, match="rotary_backend"):
        R.resolve_backend("nope", "cpu")


# --------------------------------------------------------------------------- backends vs reference


SCALED = dict(base=500.0, scaling="yarn", factor=4.0, original_len=32)
"""rotary_tables settings whose tables are not rotations: yarn's mscale 1.139 on cos and sin, a ramp over
pairs 0..3 (head_dim 16), another base."""


def _compare_backend(backend: str, device: str, dtype: torch.dtype, S: int = 24, H: int = 3, D: int = 16,
                     rope: dict | None = None):
    """Forward and backward of ``backend`` against the reference (fp32: equal to rounding; bf16: 1 ulp).

    q and k are strided views of one fused (B, S, 3, H, D) projection, as in the model; ``rope``: the
    tables' settings (``rotary_tables`` keywords; default RoFormer's)."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, S, 3, H, D, generator=g).to(device=device, dtype=dtype)
    gq, gk = (torch.randn(2, S, H, D, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    cos, sin = R.rotary_tables(S, D, device=device, **(rope or {}))
    outs = {}
    for name in ("reference", backend):
        base = qkv.clone().requires_grad_()
        q, k, _ = base.unbind(2)
        qo, ko = R.apply_rotary(q, k, cos, sin, name)
        torch.autograd.backward((qo, ko), (gq, gk))
        outs[name] = (qo.detach(), ko.detach(), base.grad[:, :, 0], base.grad[:, :, 1])
        assert qo.dtype == dtype and qo.shape == q.shape
        assert torch.all(base.grad[:, :, 2] == 0)
    if dtype == torch.float32:
        tol = dict(atol=1e-6, rtol=1e-6)
    else:  # both compute in fp32 and round once; allow one bf16 ulp (Triton's interpreter truncates)
        tol = dict(atol=1.6e-2, rtol=1.6e-2)
    for a, b in zip(outs["reference"], outs[backend]):
        torch.testing.assert_close(b.float(), a.float(), **tol)
    # the single-tensor path (v with rotary_value), on a contiguous tensor
    v = qkv[:, :, 2].contiguous()
    torch.testing.assert_close(R.rotate(v, cos, sin, backend).float(),
                               R.rotate(v, cos, sin, "reference").float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_backend_matches_reference(dtype):
    _compare_backend("compiled", "cpu", dtype)


def test_compiled_backend_matches_reference_with_scaled_tables():
    _compare_backend("compiled", "cpu", torch.float32, rope=SCALED)


@pytest.fixture
def triton_device(monkeypatch):
    """Where the Triton kernel runs: "cuda" on a GPU machine; otherwise "cpu" under Triton's interpreter,
    switched on for this test only (triton reads TRITON_INTERPRET when a kernel is defined, which
    happens on first use, here; nothing is set in a GPU run)."""
    if not R.triton_available():
        pytest.skip("triton is not installed (the `dev` and `gpu` extras have it: pip install -e '.[dev]')")
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = sys.modules.get("roformer_dist.nn.rotary_triton")
    if kernels is not None and type(kernels.rope_kernel).__name__ != "InterpretedFunction":
        importlib.reload(kernels)  # defined earlier in this process without the interpreter
        monkeypatch.setattr(R, "_TRITON", None)
    return "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S, H, D", [(24, 3, 16), (7, 5, 12), (13, 16, 64)],
                         ids=["even", "odd_len_heads_dims", "several_row_tiles"])
def test_triton_backend_matches_reference(triton_device, dtype, S, H, D):
    """Forward and backward, q and k as strided views of one fused projection; odd lengths, head counts
    and head sizes (D 12: 6 pairs in a tile of 8); (13, 16, 64) spans several tiles of rows (64 rows of
    D 64 each) with a partial last one."""
    _compare_backend("triton", triton_device, dtype, S=S, H=H, D=D)


def test_triton_rotates_q_and_k_of_different_head_counts(triton_device):
    """x1 and x2 of different shapes (a launch each) still rotate each at its positions."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=g).to(triton_device)
    k = torch.randn(2, 9, 2, 8, generator=g).to(triton_device)
    cos, sin = R.rotary_tables(9, 8, device=triton_device)
    for got, ref in zip(R.apply_rotary(q, k, cos, sin, "triton"), R.apply_rotary(q, k, cos, sin, "reference")):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_triton_backend_matches_reference_with_scaled_tables(triton_device):
    _compare_backend("triton", triton_device, torch.float32, rope=SCALED)


def test_triton_rotates_q_and_k_in_one_launch(triton_device, monkeypatch):
    launches = []
    real = R._triton_launch

    def counting(x1, x2, cos, sin, backward):
        launches.append((x2 is not None, backward))
        return real(x1, x2, cos, sin, backward)

    monkeypatch.setattr(R, "_triton_launch", counting)
    q, k = (t.to(triton_device).requires_grad_() for t in make_qk(S=9))
    cos, sin = R.rotary_tables(9, q.shape[-1], device=triton_device)
    qo, ko = R.apply_rotary(q, k, cos, sin, "triton")
    (qo.sum() + 2 * ko.sum()).backward()
    assert launches == [(True, False), (True, True)]  # one forward and one backward launch, both tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_accepts_any_strides(triton_device, dtype):
    """A (B, H, S, D) tensor seen as (B, S, H, D) (permuted strides) and one whose last dim is strided."""
    g = torch.Generator().manual_seed(0)
    S, H, D = 11, 3, 8
    bhsd = torch.randn(2, H, S, D, generator=g).to(triton_device, dtype)
    wide = torch.randn(2, S, H, 2 * D, generator=g).to(triton_device, dtype)
    q, k = bhsd.transpose(1, 2), wide[..., ::2]  # k: stride(-1) == 2
    assert not q.is_contiguous() and k.stride(-1) == 2
    cos, sin = R.rotary_tables(S, D, device=triton_device)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    for got, ref in zip(R.apply_rotary(q, k, cos, sin, "triton"), R.apply_rotary(q, k, cos, sin, "reference")):
        torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_model_with_triton_backend_matches_reference(triton_device, attention):
    """The whole model (rotary_value on: q, k and v rotated) through the Triton kernel: loss and gradients."""
    from roformer_dist.config import ModelConfig
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=48, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, rotary_value=True, attention=attention,
                      rotary_backend="reference")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (2, 9), generator=g).to(triton_device)
    labels = torch.where(torch.rand(2, 9, generator=g).to(triton_device) < 0.4, ids, -100)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    results = []
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        model = RoFormerForMaskedLM(dataclasses.replace(cfg, rotary_backend=backend)).to(triton_device)
        out = model(ids, mask, labels=labels)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(R, "triton_available", lambda: True)
    R._resolve.cache_clear()
    try:
        with pytest.raises(ValueError, match="rotary_backend: triton runs on CUDA devices"):
            R.resolve_backend("triton", "cpu")
    finally:
        R._resolve.cache_clear()


@pytest.mark.skipif(not (R.flash_attn_available() and torch.cuda.is_available()),
                    reason="flash_attn backend needs flash-attn installed and a CUDA device")
@pytest.mark.parametrize("rope", [None, SCALED], ids=["roformer", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_attn_backend_matches_reference(dtype, rope):
    if dtype == torch.float32:
        _compare_backend("flash_attn", "cuda", dtype, rope=rope)
    else:  # flash-attn takes cos/sin in the input dtype: angles rounded to bf16, so a looser bound
        q, k = make_qk(dtype=dtype)
        cos, sin = R.rotary_tables(q.shape[1], q.shape[-1], device="cuda", **(rope or {}))
        a = R.apply_rotary(q.cuda(), k.cuda(), cos, sin, "reference")[0].float()
        b = R.apply_rotary(q.cuda(), k.cuda(), cos, sin, "flash_attn")[0].float()
        torch.testing.assert_close(b, a, atol=6e-2, rtol=3e-2)


@pytest.mark.skipif(not (R.apex_available() and torch.cuda.is_available()),
                    reason="apex backend needs NVIDIA apex (with its CUDA extensions) and a CUDA device")
@pytest.mark.parametrize("rope", [None, SCALED], ids=["roformer", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apex_backend_matches_reference(dtype, rope):
    _compare_backend("apex", "cuda", dtype, rope=rope)


# --------------------------------------------------------------------------- rotate-half permutation (apex)


def test_half_permutation_gives_same_scores_with_rotate_half():
    """Evens-then-odds per head + rotate-half == interleaved rotary, as far as q.k is concerned."""
    B, S, H, D = 2, 12, 3, 8
    q, k = make_qk(B, S, H, D)
    cos, sin = R.rotary_tables(S, D)
    qi, ki = R.apply_rotary(q, k, cos, sin, "reference")
    idx = R.interleaved_to_half_index(D)
    qh = R.rotate_half_reference(q[..., idx], cos, sin)
    kh = R.rotate_half_reference(k[..., idx], cos, sin)
    scores_i = torch.einsum("bshd,bthd->bhst", qi, ki)
    scores_h = torch.einsum("bshd,bthd->bhst", qh, kh)
    torch.testing.assert_close(scores_h, scores_i, atol=1e-5, rtol=1e-5)
    # the rotated vectors themselves are the same, only in permuted order
    torch.testing.assert_close(qh, qi[..., idx], atol=1e-6, rtol=1e-6)


def test_qk_half_permutation_rows_of_fused_projection():
    H, D = 3, 4
    perm = R.qk_half_permutation(H, D)
    hid = H * D
    assert sorted(perm.tolist()) == list(range(3 * hid))
    assert perm[:D].tolist() == [0, 2, 1, 3]
    assert perm[hid:hid + D].tolist() == [hid + 0, hid + 2, hid + 1, hid + 3]
    assert perm[2 * hid:].tolist() == list(range(2 * hid, 3 * hid))  # v untouched by default
    x = torch.randn(5, hid)
    w = torch.randn(3 * hid, hid)
    q = (x @ w.T)[:, :hid].view(5, H, D)
    qp = (x @ w[perm].T)[:, :hid].view(5, H, D)
    assert torch.equal(qp, q[..., R.interleaved_to_half_index(D)])


def test_apex_slow_path_equals_reference_with_rotate_half_stand_in(monkeypatch):
    monkeypatch.setattr(R, "rotate_half_kernel", R.rotate_half_reference)
    q, k = make_qk()
    cos, sin = R.rotary_tables(q.shape[1], q.shape[-1])
    ref = R.apply_rotary(q, k, cos, sin, "reference")
    got = (R._apex_interleaved(q, cos, sin), R._apex_interleaved(k, cos, sin))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- rope base and context extension


def formula_tables(S: int, d: int, theta: float, scaling: str, factor: float, L: float):
    """cos, sin (S, d/2) float64 from the formulas of rotary.py's docstring, element by element in Python
    floats (yarn's pair bounds solved from "pair j turns r times over L": L / (2 pi theta^(2j/d)) = r)."""
    j_fast = d / 2 * math.log(L / (2 * math.pi * 32), theta)
    j_slow = d / 2 * math.log(L / (2 * math.pi * 1), theta)
    lo, hi = max(math.floor(j_fast), 0), min(math.ceil(j_slow), d - 1)
    hi = hi + 0.001 if hi == lo else hi
    mscale = 0.1 * math.log(factor) + 1 if scaling == "yarn" and factor > 1 else 1.0
    cos, sin = np.zeros((S, d // 2)), np.zeros((S, d // 2))
    for m in range(S):
        for i in range(d // 2):
            inv_freq = theta ** (-2 * i / d)
            if scaling == "none":
                angle = m * inv_freq
            elif scaling == "linear":
                angle = (m / factor) * inv_freq
            elif scaling == "ntk":
                angle = m * (theta * factor ** (d / (d - 2))) ** (-2 * i / d)
            else:
                t = min(max((i - lo) / (hi - lo), 0.0), 1.0)
                angle = m * (inv_freq * (1 - t) + inv_freq / factor * t)
            cos[m, i], sin[m, i] = mscale * math.cos(angle), mscale * math.sin(angle)
    return cos, sin


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 4.0), ("ntk", 4.0), ("yarn", 4.0),
                                             ("yarn", 1.0)])
def test_scaled_tables_equal_their_formula(scaling, factor):
    """Through the cache, as the model builds it: yarn's original length is max_len / factor."""
    S, d, theta, max_len = 64, 16, 10000.0, 8192
    rope = R.DEFAULT_ROPE.replace(rope_theta=theta, rope_scaling=scaling, rope_scaling_factor=factor)
    cos, sin = R.RotaryCache(d, max_len, rope).get(S)
    want_cos, want_sin = formula_tables(S, d, theta, scaling, factor, max_len / factor)
    torch.testing.assert_close(cos, torch.from_numpy(want_cos).float(), atol=2e-7, rtol=0)
    torch.testing.assert_close(sin, torch.from_numpy(want_sin).float(), atol=2e-7, rtol=0)


def test_default_settings_give_the_roformer_tables_bit_for_bit():
    cos, sin = R.RotaryCache(64, 300, R.DEFAULT_ROPE).get(300)
    ref_cos, ref_sin = R.rotary_tables(300, 64)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert R.DEFAULT_ROPE.to_dict() == {"rope_theta": 10000.0, "rope_scaling": "none", "rope_scaling_factor": 1.0,
                                        "rope_original_max_position": None}


def test_yarn_equals_hf_and_the_papers_limits():
    """inv_freq and attention factor as HF's _compute_yarn_parameters (fp32 there); pairs that turn more
    than 32 times over L keep their frequency, those under once are interpolated by the factor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d, theta, factor, L = 64, 10000.0, 8.0, 512
    hf_cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, max_position_embeddings=int(factor * L),
                         rope_parameters={"rope_type": "yarn", "factor": factor, "rope_theta": theta,
                                          "original_max_position_embeddings": L})
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    w, mscale = R.pair_divisors(d, theta, "yarn", factor, L)
    torch.testing.assert_close(1 / w, hf_inv.double(), rtol=1e-6, atol=0)
    assert mscale == pytest.approx(hf_factor, rel=1e-12) and mscale == pytest.approx(0.1 * math.log(8) + 1)
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turns = L * inv / (2 * math.pi)
    torch.testing.assert_close((1 / w)[turns > 32], inv[turns > 32], rtol=1e-15, atol=0)
    torch.testing.assert_close((1 / w)[turns < 1], inv[turns < 1] / factor, rtol=1e-15, atol=0)
    assert (turns > 32).any() and (turns < 1).any()


def test_yarn_mscale_scales_every_score_by_its_square():
    S, D = 32, 16
    cos, sin = R.rotary_tables(S, D, **SCALED)
    mscale = 0.1 * math.log(SCALED["factor"]) + 1
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, mscale ** 2), atol=1e-6, rtol=0)
    q, k = make_qk(S=S, D=D)
    qr, kr = R.apply_rotary(q, k, cos, sin, "reference")
    qu, ku = R.apply_rotary(q, k, cos / mscale, sin / mscale, "reference")  # the same angles, unit length
    torch.testing.assert_close(torch.einsum("bshd,bthd->bhst", qr, kr),
                               mscale ** 2 * torch.einsum("bshd,bthd->bhst", qu, ku), atol=1e-4, rtol=1e-5)


def test_reference_backward_with_scaled_tables_matches_autograd_of_naive():
    """Backward is the conjugate rotation, which is right for tables of any length (not the inverse)."""
    _assert_reference_backward_matches_naive(24, 16, **SCALED)


def _tiny_model(**changes):
    from roformer_dist.config import ModelConfig
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = ModelConfig(**{**dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, initializer_range=0.3), **changes})
    torch.manual_seed(0)  # weights large enough that attention, and so the positions, matter
    return RoFormerForMaskedLM(cfg).eval()


def test_set_rope_changes_a_built_model_and_restores_it():
    """The config's settings reach the built model; set_rope on a default model gives the same output,
    reaches every cache (tensor-parallel form, pipeline stage layers, an engine's .module) and restores."""
    from roformer_dist.config import rope_settings
    from roformer_dist.parallel.pipeline import PipeLayer
    from roformer_dist.parallel.tensor import TensorParallelMLM

    yarn = dict(rope_theta=500.0, rope_scaling="yarn", rope_scaling_factor=2.0)
    ids = torch.randint(1, 50, (2, 48), generator=torch.Generator().manual_seed(0))  # longer than 32
    with torch.no_grad():
        model = _tiny_model()
        before = model(ids).logits
        configured = _tiny_model(**yarn)
        want = configured(ids).logits
        assert (want - before).abs().max() > 0.1
        assert R.set_rope(model, rope_settings(configured.config)) == 1
        torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
        assert R.set_rope(model, R.DEFAULT_ROPE) == 1
        torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)

        engine = torch.nn.Module()  # as a DeepSpeed engine holds the model
        engine.module = torch.nn.ModuleList([TensorParallelMLM(_tiny_model(), 0, 1, None),
                                             PipeLayer(_tiny_model(), 0, 0, 1, None),
                                             PipeLayer(_tiny_model(), 1, 0, 1, None)])
        assert R.set_rope(engine, rope_settings(configured.config), max_len=64) == 3
        caches = [engine.module[0].rotary, engine.module[1].rotary, engine.module[2].rotary]
        assert all(c.rope.rope_scaling == "yarn" and c.max_len == 64 and c.original_len == 32.0 for c in caches)
        forked = _tiny_model(max_position_embeddings=64, **yarn)  # a fork that raised the length
        torch.testing.assert_close(engine.module[0](ids).logits, forked(ids).logits, atol=0, rtol=0)
    assert R.set_rope(_tiny_model(position_embedding="absolute"), R.DEFAULT_ROPE) == 0
    with pytest.raises(TypeError, match="expected a config.RopeSettings, got dict"):
        R.set_rope(model, {"rope_theta": 500.0})
