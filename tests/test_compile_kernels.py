"""The compiled forward traces no backend resolution and no host read, for every rotary kernel and layout.

``torch.compile`` cannot trace ``rotary.resolve_backend`` on CUDA (it looks for installed packages with
``importlib.util.find_spec``); on CPU the resolution returned before that call, which is how the failure
hid from the CPU tests. Now the model holds its kernel (``model.set_rotary_kernel``, chosen when the model
is built for a device and at each stage switch) and the layout of packed documents comes from the host
(``model.batch_plan``): these tests replace every resolver with one that fails, compile the model the way
``trainer.compile`` does (``parallel.compiled.StageCompiler``: the stack with ``fullgraph=True``, or for a
block plan the layers' projections and the rest with ``fullgraph=True``), and compare loss and gradients
with the eager model.
"""

from __future__ import annotations

import pytest
import torch

from roformer_dist.nn import documents as Dm
from roformer_dist.nn import rotary as R
from roformer_dist.nn.model import batch_plan, rotary_kernel_of, set_rotary_kernel
from roformer_dist.parallel.compiled import StageCompiler
from test_model import make, tiny
from test_packing import packed_batch
from test_rotary import triton_device  # noqa: F401 - a fixture

REL_TOL = 1e-4  # as tests/test_compile.py: inductor reorders fp32 arithmetic
ROWS = {  # name -> (documents per row, BLOCKS_BELOW): each form of documents.plan_rows
    "whole": ([[24], [24]], None),
    "padding": ([[20], [24]], None),
    "blocks": ([[5, 9, 3, 7], [20, 4]], 1e9),
    "dense_mask": ([[5, 9, 3, 7], [20, 4]], 0.0),
}
S = 24


def _batch(rows):
    ids, mask = packed_batch(rows, S)
    g = torch.Generator().manual_seed(3)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & (mask > 0), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture
def no_resolution(monkeypatch):
    """Every way of resolving a backend or planning a layout fails: the forward must need none of them."""
    def fail(*args, **kwargs):
        raise AssertionError("resolved inside the forward")
    for name in ("resolve_backend", "model_kernel", "triton_available", "flash_attn_available", "apex_available"):
        monkeypatch.setattr(R, name, fail)
    monkeypatch.setattr(R, "_resolve", fail)
    monkeypatch.setattr(Dm, "plan_rows", fail)
    import roformer_dist.nn.model as M
    monkeypatch.setattr(M, "model_kernel", fail)
    monkeypatch.setattr(M, "plan_rows", fail)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _check(backend, form, tmp_path, monkeypatch, request):
    rows, blocks_below = ROWS[form]
    if blocks_below is not None:
        monkeypatch.setattr(Dm, "BLOCKS_BELOW", blocks_below)
    cfg = tiny(rotary_backend=backend, num_hidden_layers=1, rotary_value=True)
    batch = _batch(rows)
    batch.update(batch_plan(cfg, "cpu")(batch))     # what the loader's workers add
    assert batch["layout"].form == ("blocks" if form == "blocks" else "dense" if form == "dense_mask" else form)
    del batch["num_tokens"]
    eager, compiled = make(cfg), make(cfg)
    for m in (eager, compiled):
        set_rotary_kernel(m, R.model_kernel(backend, "cpu"))  # what the trainer does before a stage
    want = _loss_and_grads(eager, batch)
    torch._dynamo.reset()
    compiler = StageCompiler(compiled, tmp_path / "cache")
    compiler.compile_stage("s", S, 2)
    request.getfixturevalue("no_resolution")
    got = _loss_and_grads(compiled, batch)
    assert abs(got[0] - want[0]) <= REL_TOL * abs(want[0]), (got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("form", list(ROWS))
def test_every_layout_compiles_without_a_graph_break(form, tmp_path, monkeypatch, request):
    _check("reference", form, tmp_path, monkeypatch, request)


@pytest.mark.slow
def test_the_compiled_backend_compiles_inside_the_model(tmp_path, monkeypatch, request):
    _check("compiled", "padding", tmp_path, monkeypatch, request)


def test_an_eager_forward_resolves_nothing_once_the_kernel_is_chosen(triton_device, monkeypatch, request):
    """The CUDA branch of the old failure, on CPU: triton (under its interpreter here) chosen before the
    forward; then forward and backward call no resolver and plan nothing."""
    cfg = tiny(rotary_backend="triton", num_hidden_layers=1)
    model = make(cfg).to(triton_device)
    set_rotary_kernel(model, R.model_kernel("triton", triton_device))
    assert rotary_kernel_of(model) == "triton"
    batch = _batch(ROWS["blocks"][0])
    batch.update(batch_plan(cfg, triton_device)(batch))
    del batch["num_tokens"]
    batch = {k: v.to(triton_device) for k, v in batch.items()}
    request.getfixturevalue("no_resolution")
    model(**batch).loss.backward()


def test_a_stage_is_not_compiled_before_its_kernel_is_chosen(tmp_path):
    model = make(tiny())
    with pytest.raises(RuntimeError, match="choose the rotary kernel"):
        StageCompiler(model, tmp_path).compile_stage("s", S, 2)


@pytest.mark.parametrize("packing", ["cross_document", "document"])
def test_the_rotary_kernel_runs_the_way_the_stage_measures_it(packing, tmp_path, monkeypatch):
    """``model.rotary_backend: auto`` times its candidates compiled or eagerly by
    ``compiled.rotary_runs_compiled``; a compiled training step of each packing runs the rotary kernel that way:
    whole rows inside the compiled stack, packed documents (every batch, a row of one document too) on the
    split path, eagerly."""
    import roformer_dist.nn.attention as A
    from roformer_dist.config import load_config
    from roformer_dist.parallel.compiled import rotary_runs_compiled, splits_documents

    run = load_config(overrides=["trainer.compile=true", f"data.packing={packing}"])
    compiled_run = rotary_runs_compiled(run)
    assert compiled_run == (packing == "cross_document")
    seen = []
    real = R.run_kernel

    def spy(*args, **kwargs):
        seen.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    monkeypatch.setattr(A, "run_kernel", spy)  # rotary on v and flash-attn's varlen form
    monkeypatch.setattr(R, "run_kernel", spy)  # q and k, rotated by the attention kind (nn/attention_kinds/)
    cfg = tiny(num_hidden_layers=1)
    model = make(cfg)
    set_rotary_kernel(model, R.model_kernel("reference", "cpu"))
    torch._dynamo.reset()
    StageCompiler(model, tmp_path / "cache", split=splits_documents(run)).compile_stage("s", S, 2)
    for rows in ([[24], [24]], [[5, 9, 3, 7], [20, 4]]) if packing == "document" else ([[24], [24]],):
        batch = _batch(rows)
        batch.update(batch_plan(cfg, "cpu")(batch))
        del batch["num_tokens"]
        seen.clear()
        model(**batch).loss.backward()
        assert seen and set(seen) == {compiled_run}, (rows, seen)
