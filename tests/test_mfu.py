"""MFU's two halves (roformer_dist/observe/metrics.py): the dense peak follows the GPU and the run's matmul
precision (CUDA faked: no GPU here), an unknown GPU gives no MFU and one log line; and
``RoFormerForMaskedLM.flops_per_token`` equals an independent count of a tiny model's matmul FLOPs
(``torch.utils.flop_counter.FlopCounterMode``) at several lengths, so attention's S-dependent part is right."""

from __future__ import annotations

import logging

import pytest
import torch

from roformer_dist.observe import metrics


@pytest.fixture
def gpu(monkeypatch):
    """Pretend CUDA is there with the given device name; the once-per-GPU warning cache starts empty."""
    def fake(name: str):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    metrics._peak.cache_clear()
    yield fake
    metrics._peak.cache_clear()


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA H200", "fp16", 989.5),
    ("NVIDIA H200", "tf32", 494.5),
    ("NVIDIA H200", "fp32", 67.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "tf32", 417.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100-SXM2-16GB", "tf32", 15.7),  # no TF32 units: the fp32 peak
])
def test_peak_follows_gpu_and_precision(gpu, name, precision, tflops):
    gpu(name)
    assert metrics.peak_flops(precision) == pytest.approx(tflops * 1e12)


def test_fp32_run_is_tf32_when_torch_allows_it():
    matmul = torch.backends.cuda.matmul  # a module object monkeypatch cannot restore: set and reset by hand
    saved = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert [metrics.matmul_precision(p) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
        matmul.allow_tf32 = True
        assert [metrics.matmul_precision(p) for p in ("fp32", "bf16", "fp16")] == ["tf32", "bf16", "fp16"]
    finally:
        matmul.allow_tf32 = saved


@pytest.mark.parametrize("name, precision", [("NVIDIA A10G", "bf16"), ("NVIDIA B200", "bf16"),
                                             ("Tesla V100-SXM2-16GB", "bf16")])
def test_unknown_peak_no_mfu_one_log_line(gpu, caplog, name, precision):
    gpu(name)
    assert [metrics.peak_flops(precision) for _ in range(5)] == [None] * 5  # as if called at every log step
    said = [r for r in caplog.records if r.name == metrics.log.name]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "no MFU" in said[0].getMessage()
    assert name in said[0].getMessage()


def test_no_cuda_no_peak(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert metrics.peak_flops("bf16") is None and not caplog.records


def _counted(model, seq_len: int, backward: bool) -> tuple[float, float]:
    """(FLOPs FlopCounterMode counts for one forward [+ backward] of a (2, seq_len) batch with every 4th
    position predicted, the predicted fraction)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(5, model.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    # SDPA's math backend is matmuls the counter sees; the fused CPU kernel has no FLOP formula in torch
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(ids, labels=labels)
        if backward:
            out.loss.backward()
    return counter.get_total_flops(), float((labels != -100).float().mean())


FORWARD_TOL = {"softmax": 1e-9, "linear": 1e-2}
"""Softmax: exact. Linear: the formula leaves out the normaliser phi(q) . Z (2 h per layer and token, 0.3%
of this model's forward)."""


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_flops_per_token_matches_an_independent_count(attention):
    """Forward: exact for softmax attention (the formula counts the model's matmuls one by one; linear:
    FORWARD_TOL); forward + backward: within 1%
    of 3 x forward (every matmul's backward is two of the same size). Softmax attention adds 12 L h S per
    token, so its count grows linearly with S at that slope; linear attention's does not grow."""
    from roformer_dist.config import ModelConfig
    from roformer_dist.nn.model import RoFormerForMaskedLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attention=attention)
    model = RoFormerForMaskedLM(cfg)
    per_token = {}
    for seq_len in (16, 64, 128):
        tokens = 2 * seq_len
        forward, frac = _counted(model, seq_len, backward=False)
        assert forward == pytest.approx(model.flops_per_token(seq_len, frac) / 3 * tokens, rel=FORWARD_TOL[attention])
        total, _ = _counted(model, seq_len, backward=True)
        assert total == pytest.approx(model.flops_per_token(seq_len, frac) * tokens, rel=1e-2), seq_len
        per_token[seq_len] = forward / tokens
    slope = (per_token[128] - per_token[16]) / (128 - 16)  # forward FLOPs per token per position
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    assert slope == pytest.approx(4 * L * h if attention == "softmax" else 0.0, abs=1e-6)


@pytest.mark.parametrize("name, tbps", [
    ("NVIDIA H200", 4.8), ("NVIDIA H200 NVL", 4.8), ("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", 3.9), ("NVIDIA A100-SXM4-80GB", 2.039), ("NVIDIA A100 80GB PCIe", 1.935),
    ("NVIDIA A100-PCIE-40GB", 1.555), ("NVIDIA L40S", 0.864), ("Tesla V100S-PCIE-32GB", 1.134),
    ("NVIDIA GH200 480GB", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_memory_bandwidth_follows_the_gpu(name, tbps):
    """The first pattern that matches wins: PCIe and NVL parts before the SXM entry, GH200 (HBM3 or HBM3e)
    unknown rather than taken for an H200 or H100."""
    got = metrics.peak_memory_bandwidth(name)
    assert got == (None if tbps is None else pytest.approx(tbps * 1e12)), name
