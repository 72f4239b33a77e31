"""Flex attention is compiled once per shape family and never falls back to its eager path without a word.

On CUDA ``documents._flex`` compiles flex attention (eager flex attention materialises the B x H x S x S
scores). A run calls it with a handful of shapes: each curriculum stage's training micro-batch, each eval
length under no grad, each last smaller batch. Sharing one dynamo cache, nine such shapes passed dynamo's
recompile limit of 8 and the ninth silently ran eagerly. Here, where torch 2.13 compiles flex attention's
forward on CPU, a three-stage run's calls with evaluations at three lengths (full and last batches) and a
second pass over new documents are counted with dynamo's own counters: one compile per family, no graph
break, no recompile, no fallback. (A training step's family is compiled here without parameters that need
gradients: CPU has no flex backward; on CUDA the same family also compiles its backward.)
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from roformer_dist.nn import documents as Dm
from test_model import make, tiny
from test_packing import packed_batch

STAGES = [(2, 128), (2, 256), (1, 512)]   # (micro-batch, seq_len)
EVAL_LENGTHS = (128, 256, 512)
EVAL_BATCH, LAST_BATCH = 3, 1


def _rows(n, S, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        lengths, left = [], S
        while left > 0:
            lengths.append(min(left, int(torch.randint(20, 90, (), generator=g))))
            left -= lengths[-1]
        rows.append(lengths)
    return packed_batch(rows, S, seed)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(Dm, "FLEX_COMPILED_ON", ("cuda", "cpu"))
    torch._dynamo.reset()
    Dm.flex_compiles.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    Dm.flex_compiles.reset()


def test_a_three_stage_run_with_evals_compiles_each_shape_family_once(compiled_on_cpu, caplog):
    model = make(tiny(document_attention="flex", num_hidden_layers=1, max_position_embeddings=512))
    model.requires_grad_(False)
    calls = 0
    with caplog.at_level(logging.INFO, logger="roformer_dist.nn.documents"):
        for epoch in range(2):   # the second pass: new documents in every batch, nothing compiles
            for mbs, S in STAGES:
                model.train()
                with torch.enable_grad():
                    model(*_rows(mbs, S, seed=epoch * 10 + S))
                calls += 1
                model.eval()
                with torch.no_grad():   # the eval at every length, a full batch and the last one
                    for L in EVAL_LENGTHS:
                        for n in (EVAL_BATCH, LAST_BATCH):
                            model(*_rows(n, L, seed=epoch * 100 + L + n))
                            calls += 1
    families = len(STAGES) + 2 * len(EVAL_LENGTHS)
    assert len(Dm.flex_compiles.compiled) == families and None not in Dm.flex_compiles.compiled.values()
    assert counters["stats"]["unique_graphs"] == families, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    compiling = [r.getMessage() for r in caplog.records if "flex attention: compiling" in r.getMessage()]
    assert len(compiling) == families and calls > families
    assert any("training" in m for m in compiling) and any("no grad" in m for m in compiling)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_family_that_does_not_compile_says_so_and_runs_the_reference(compiled_on_cpu, monkeypatch, caplog):
    """A graph break is an error under fullgraph: one warning naming the family and the cause, then SDPA with the
    dense block-diagonal mask (the same result) for that family, without trying again."""
    real = Dm._flex_call

    def breaks(q, k, v, block_mask):
        if float(q.sum()) > -1e9:   # a host read: a graph break
            return real(q, k, v, block_mask)
        return q

    monkeypatch.setattr(Dm, "_flex_call", breaks)
    ids, mask = _rows(2, 128, seed=1)
    layout = Dm.row_layout(mask, restart=True, kernel="flex")
    q, k, v = (torch.randn(2, 4, 128, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with caplog.at_level(logging.INFO, logger="roformer_dist.nn.documents"):
        out = Dm._flex(q, k, v, layout.mask)
        again = Dm._flex(q, k, v, layout.mask)
    torch.testing.assert_close(out, Dm.flex_reference(q, k, v, layout.mask))
    torch.testing.assert_close(again, out)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not compiled for q (2, 4, 128, 8)" in warnings[0]
    assert "dense block-diagonal mask" in warnings[0] and "no grad" not in warnings[0]
