"""Document packing: the loader numbers the documents of each row, and the model keeps them apart.

The ground truth is each document run by itself: for every document of a packed row, the packed
logits equal the logits of its tokens as a batch of one (softmax and linear attention, rotary and
absolute positions, every form of the layout: length blocks, the dense block-diagonal mask and flex
attention's block-sparse mask (torch's own flex attention where no gradient is taken, its CPU stand-in
where one is: torch 2.13 has no flex backward on CPU), every rotary kernel this machine can run, the
varlen path through its CPU stand-in). The flex tiles classified on the host equal torch's
``create_block_mask``; on a GPU flex attention's forward and backward equal the blocks'. The tensor- and
pipeline-parallel layouts are compared with the plain model on document-numbered batches in
tests/test_parallel.py; exact and elastic resume run with the loader's default (document) packing in
tests/test_loader.py and tests/test_trainer.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_pipeline.loader import ShardLoader
from data_pipeline.shards import write_shard_set
from roformer_dist.config import load_config
from roformer_dist.errors import ConfigError
from roformer_dist.nn import documents as Dm
from roformer_dist.nn import rotary as R
from roformer_dist.nn.documents import DocumentPlan, row_layout
from test_model import VOCAB, make, tiny
from test_rotary import triton_device  # noqa: F401 - a fixture

SEP, CLS = 3, 2


def packed_batch(lengths_per_row, S, seed=0):
    """(ids, mask): rows of documents of the given lengths, numbered 1, 2, ... (0 = padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (len(lengths_per_row), S), generator=g)
    mask = torch.zeros(len(lengths_per_row), S, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_row):
        p = 0
        for k, n in enumerate(lengths):
            mask[b, p:p + n] = k + 1
            p += n
        ids[b, p:] = 0
    return ids, mask


def documents_of(mask):
    """(row, start, length) of every document."""
    out = []
    for b, row in enumerate(mask.tolist()):
        p = 0
        while p < len(row):
            q = p
            while q < len(row) and row[q] == row[p]:
                q += 1
            if row[p] > 0:
                out.append((b, p, q - p))
            p = q
    return out


ROWS = [[5, 9, 3, 7, 1], [20, 4], [24]]   # several documents; two; one whole row (S = 25 with one pad)
S = 25


def flex_or_stand_in(q, k, v, mask):
    """Flex attention itself where no gradient is needed (CPU: forward only), else its stand-in."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (Dm.flex_reference if needs_grad else Dm._flex)(q, k, v, mask)


@pytest.fixture(params=["blocks", "dense_mask", "flex"])
def form(request, monkeypatch):
    """Force the layout's form: length blocks, one call with a block-diagonal mask, or flex attention's
    block-sparse mask (softmax attention; linear attention keeps its blocks)."""
    monkeypatch.setattr(Dm, "BLOCKS_BELOW", 1e9 if request.param == "blocks" else 0.0)
    if request.param == "flex":
        monkeypatch.setattr(Dm, "kernel_for", lambda setting, kind, device: "flex" if kind == "softmax" else "blocks")
        monkeypatch.setattr(Dm, "flex_kernel", flex_or_stand_in)
    return request.param


def assert_each_document_as_alone(model, ids, mask, tol=2e-5):
    with torch.no_grad():
        packed = model(ids, mask).logits
        for b, p, n in documents_of(mask):
            alone = model(ids[b:b + 1, p:p + n], torch.ones(1, n, dtype=torch.long)).logits[0]
            torch.testing.assert_close(packed[b, p:p + n], alone, atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("positions", ["rotary", "absolute"])
def test_each_document_of_a_packed_row_computes_what_it_computes_alone(form, attention, positions):
    model = make(tiny(attention=attention, position_embedding=positions, rotary_value=True)).eval()
    ids, mask = packed_batch(ROWS, S)
    layout = row_layout(mask, True, kernel=Dm.kernel_for("auto", attention, "cpu"), blocks_only=attention == "linear")
    if attention == "softmax":   # linear attention always takes the blocks (per-document sums)
        expected = {"blocks": DocumentPlan, "dense_mask": torch.Tensor, "flex": Dm.FlexMask}[form]
        assert isinstance(layout.mask, expected)
    else:
        assert isinstance(layout.mask, DocumentPlan)
    assert_each_document_as_alone(model, ids, mask)
    with torch.no_grad():   # and the same rows with a 0/1 mask do attend across documents
        crossed = model(ids, (mask > 0).long()).logits
        assert (crossed - model(ids, mask).logits).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["triton", "half_layout"])
def test_every_rotary_kernel_gives_the_reference_packed_logits(form, backend, monkeypatch, request):
    """Blocks rotate with (L, D/2) tables, the dense mask with one table per row ((B, S, D/2), the rows
    as one sequence, for every kernel alike): each kernel equals the reference on both. (The compiled
    kernel takes the same shapes; it is compared with the reference in tests/test_rotary.py, and costs
    a compile per block shape here.)"""
    if backend == "triton":
        request.getfixturevalue("triton_device")   # tests/test_rotary.py: Triton's interpreter on CPU, or skip
    cfg = tiny(num_hidden_layers=1)
    ids, mask = packed_batch(ROWS, S)
    ref = make(cfg).eval()
    if backend == "half_layout":   # apex's rotate-half kernel, by its CPU stand-in, on permuted weights
        monkeypatch.setattr(R, "rotate_half_kernel", R.rotate_half_reference)
        monkeypatch.setattr("roformer_dist.nn.model.model_kernel", lambda b, d: R.HALF_LAYOUT)
        other = make(cfg).eval()
    else:
        other = make(dataclasses.replace(cfg, rotary_backend=backend)).eval()
    with torch.no_grad():
        torch.testing.assert_close(other(ids, mask).logits, ref(ids, mask).logits, atol=2e-5, rtol=2e-5)


def test_restart_and_continue_positions():
    """Rotary scores depend only on relative positions, so for a rotary model restarting or continuing
    the row's positions gives the same logits; learned absolute positions do not."""
    ids, mask = packed_batch(ROWS, S)
    for positions, same in (("rotary", True), ("absolute", False)):
        out = []
        for mode in ("restart", "continue"):
            with torch.no_grad():
                out.append(make(tiny(position_embedding=positions, document_positions=mode)).eval()(ids, mask).logits)
        assert torch.allclose(out[0], out[1], atol=2e-5) == same, positions


def test_a_packed_loss_and_its_gradients_are_the_sum_over_its_documents(form):
    """Sum of the token losses of a packed micro-batch = the sum over its documents run alone, and so
    are the parameter gradients."""
    ids, mask = packed_batch(ROWS, S)
    g = torch.Generator().manual_seed(1)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.4) & (mask > 0), ids, -100)
    model = make(tiny())
    out = model(ids, mask, labels=labels)
    (out.loss * out.num_predicted).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    packed_sum = float(out.loss.detach() * out.num_predicted)
    model.zero_grad()
    total = 0.0
    for b, p, n in documents_of(mask):
        lab = labels[b:b + 1, p:p + n]
        if (lab != -100).any():
            o = model(ids[b:b + 1, p:p + n], torch.ones(1, n, dtype=torch.long), labels=lab)
            (o.loss * o.num_predicted).backward()
            total += float(o.loss.detach() * o.num_predicted)
    assert abs(packed_sum - total) <= 1e-4 * abs(total)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_with_attention_dropout_no_gradient_crosses_a_document(form):
    """Training mode, dropout on the probabilities (the eager CPU path, which takes the same masks): the
    loss of one document has no gradient on the embeddings of any other."""
    ids, mask = packed_batch(ROWS, S)
    model = make(tiny(attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1)).train()
    emb = model.embeddings.word_embeddings
    captured = {}

    def keep(module, inputs, output):
        output.retain_grad()
        captured["x"] = output

    handle = emb.register_forward_hook(keep)
    hidden = model.encode(ids, mask)
    handle.remove()
    hidden[0, 5:14].sum().backward()   # row 0, document 2 (tokens 5..13)
    grad = captured["x"].grad.abs().sum(-1)
    assert grad[0, 5:14].sum() > 0
    assert grad[0, :5].sum() == 0 and grad[0, 14:].sum() == 0 and grad[1:].sum() == 0


def test_varlen_path_equals_the_blocks(monkeypatch):
    """The varlen layout (documents end to end, cu_seqlens) through flash-attn's CPU stand-in equals the
    blocks, forward and backward."""
    from roformer_dist.nn.attention import attention_core

    monkeypatch.setattr(Dm, "varlen_kernel", Dm.varlen_reference)
    ids, mask = packed_batch(ROWS, S)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, S, 3, 4, 8, generator=g, requires_grad=True)
    cos, sin = R.rotary_tables(S, 8)
    out = []
    for varlen in (False, True):
        plan = row_layout(mask, True, cos, sin, blocks_only=True, kernel="varlen" if varlen else "blocks").mask
        assert (plan.varlen is not None) == varlen
        ctx = attention_core("softmax", qkv, plan, cos, sin, "reference", True, 0.0)
        (grad,) = torch.autograd.grad((ctx * torch.arange(ctx.numel()).view_as(ctx).sin()).sum(), qkv)
        out.append((ctx, grad))
    valid = (mask > 0)[..., None]
    torch.testing.assert_close(out[1][0] * valid, out[0][0] * valid, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not (Dm.flash_varlen_available() and torch.cuda.is_available()),
                    reason="flash-attn's varlen kernel needs flash-attn and a CUDA GPU")
def test_flash_varlen_kernel_equals_its_reference_on_gpu():
    g = torch.Generator().manual_seed(0)
    T, H, D = 57, 4, 64
    q, k, v = (torch.randn(T, H, D, generator=g).cuda().bfloat16() for _ in range(3))
    cu = torch.tensor([0, 5, 30, 31, 57], dtype=torch.int32, device="cuda")
    got = Dm._flash_varlen(q, k, v, cu, 26, 0.0)
    ref = Dm.varlen_reference(q.float(), k.float(), v.float(), cu, 26, 0.0)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def random_document_mask(rng, B, S, pad_inside=False):
    """(B, S) document numbers: runs of random length, some rows padded at the end (or in the middle)."""
    mask = np.zeros((B, S), np.int64)
    for b in range(B):
        p, k = 0, 1
        while p < S and not (p and rng.random() < 0.15):
            n = int(rng.integers(1, S // 2 + 2))
            mask[b, p:p + n] = k
            p, k = p + n, k + 1
            if pad_inside and rng.random() < 0.2:
                p += int(rng.integers(1, 4))
    return mask


@pytest.mark.parametrize("S,block", [(25, 8), (64, 16), (300, 128), (512, 128)])
def test_flex_tiles_classified_on_the_host_equal_torchs_create_block_mask(S, block):
    """The partial and full tiles of every row (and their order) from the host's interval arithmetic equal
    what torch's ``create_block_mask`` finds by evaluating ``same document`` at every score; also where S
    is not a multiple of the tile and where padding sits between documents."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = np.random.default_rng(S)
    for trial in range(12):
        mask = random_document_mask(rng, 3, S, pad_inside=trial % 3 == 0)
        plan = Dm.plan_rows(mask, True, kernel="flex")
        if plan.form != "flex":   # a draw of one document per row takes no document mask at all
            continue
        doc = plan.doc
        want = create_block_mask(lambda b, h, q, kv: doc[b, q] == doc[b, kv], 3, None, S, S, device="cpu",
                                 BLOCK_SIZE=block)
        got = Dm.flex_tiles(doc.numpy(), block)
        for name, mine in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), got):
            np.testing.assert_array_equal(mine, getattr(want, name).numpy(), err_msg=f"S {S} trial {trial} {name}")


def test_flex_attention_equals_its_stand_in_and_the_blocks(monkeypatch):
    """Several tiles per row (8-token tiles on rows of 25): torch's flex attention (forward, CPU) equals the
    stand-in, and the stand-in's forward and backward equal the blocks', at the attention core with rotary
    on q, k and v."""
    from roformer_dist.nn.attention import attention_core

    monkeypatch.setattr(Dm, "FLEX_BLOCK", 8)
    ids, mask = packed_batch(ROWS, S)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, S, 3, 4, 8, generator=g, requires_grad=True)
    cos, sin = R.rotary_tables(S, 8)
    flex = row_layout(mask, True, cos, sin, kernel="flex")
    assert isinstance(flex.mask, Dm.FlexMask) and flex.mask.block_mask.BLOCK_SIZE == (8, 8)
    with torch.no_grad():
        real = attention_core("softmax", qkv, flex.mask, flex.cos, flex.sin, "reference", True, 0.0)
        monkeypatch.setattr(Dm, "flex_kernel", Dm.flex_reference)
        stand_in = attention_core("softmax", qkv, flex.mask, flex.cos, flex.sin, "reference", True, 0.0)
    torch.testing.assert_close(real, stand_in, atol=1e-5, rtol=1e-5)
    out = []
    for layout in (flex, row_layout(mask, True, cos, sin, blocks_only=True)):
        ctx = attention_core("softmax", qkv, layout.mask, layout.cos, layout.sin, "reference", True, 0.0)
        (grad,) = torch.autograd.grad((ctx * torch.arange(ctx.numel()).view_as(ctx).sin()).sum(), qkv)
        out.append((ctx, grad))
    valid = (mask > 0)[..., None]
    torch.testing.assert_close(out[0][0] * valid, out[1][0] * valid, atol=1e-5, rtol=1e-5)
    grad_valid = valid[..., None, None]   # padding's q, k, v: the blocks never read them
    torch.testing.assert_close(out[0][1] * grad_valid, out[1][1] * grad_valid, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention trains on CUDA only (no CPU backward)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_on_gpu_equals_the_blocks_forward_and_backward(dtype):
    """torch's compiled flex attention (128-token tiles, rows of 300 with documents across tile edges)
    against the blocks on the same GPU, in the model's attention core."""
    from roformer_dist.nn.attention import attention_core

    rng = np.random.default_rng(1)
    mask = torch.from_numpy(random_document_mask(rng, 4, 300)).cuda()
    mask[0, :40], mask[0, 40:] = 1, 2   # at least one row of two documents
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(4, 300, 3, 4, 64, generator=g).cuda().to(dtype).requires_grad_(True)
    cos, sin = (t.cuda() for t in R.rotary_tables(300, 64))
    out = []
    for kernel in ("flex", "blocks"):
        layout = row_layout(mask, True, cos, sin, kernel=kernel, blocks_only=kernel == "blocks")
        ctx = attention_core("softmax", qkv, layout.mask, layout.cos, layout.sin, "reference", False, 0.0)
        weights = torch.arange(ctx.numel(), device="cuda").view_as(ctx).sin().to(dtype)
        (grad,) = torch.autograd.grad((ctx * weights).float().sum(), qkv)
        out.append((ctx.float(), grad.float()))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    valid = (mask > 0)[..., None]
    torch.testing.assert_close(out[0][0] * valid, out[1][0] * valid, atol=tol, rtol=tol)
    grad_valid = valid[..., None, None]
    torch.testing.assert_close(out[0][1] * grad_valid, out[1][1] * grad_valid, atol=tol, rtol=tol)


def test_the_document_kernel_is_chosen_by_device_and_asked_for_kernels_are_checked():
    from roformer_dist.nn.attention_kinds import check_attention
    from roformer_dist.nn.model import batch_plan

    assert Dm.kernel_for("auto", "softmax", "cpu") == "blocks"
    assert Dm.kernel_for("auto", "softmax", "cuda") == ("varlen" if Dm.flash_varlen_available() else "flex")
    assert Dm.kernel_for("flex", "linear", "cuda") == "blocks"
    assert Dm.kernel_for("flex", "softmax", "cpu") == "flex"
    with pytest.raises(ConfigError, match="model.document_attention: flex trains on CUDA only"):
        batch_plan(tiny(document_attention="flex"), "cpu")
    with pytest.raises(ConfigError, match="model.document_attention: varlen needs flash-attn"):
        batch_plan(tiny(document_attention="varlen"), "cpu")
    with pytest.raises(ConfigError, match="model.document_attention: linear attention does not run flex; linear attention keeps documents apart in blocks"):
        check_attention("linear", "flex")
    with pytest.raises(ConfigError, match="model.document_attention"):
        load_config(None, ["model=debug", "model.document_attention=sparse"])
    assert batch_plan(tiny(), "cpu").args[1] == "blocks"


def test_whole_rows_pass_no_mask_and_padded_rows_a_key_mask(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = make(tiny(num_hidden_layers=1)).eval()
    ids, mask = packed_batch([[S], [S]], S)          # one document per row, no padding
    with torch.no_grad():
        model(ids, mask)
        assert seen == [None]
        seen.clear()
        model(ids, torch.ones_like(ids))              # a plain all-ones mask: the same
        assert seen == [None]
        seen.clear()
        ids, mask = packed_batch([[S], [S - 4]], S)   # padding: a key-padding mask, one call
        model(ids, mask)
        assert len(seen) == 1 and seen[0].shape == (2, 1, 1, S)
        seen.clear()
        ids, mask = packed_batch([[6, 6, 6, 7], [S]], S)
        monkeypatch.setattr(Dm, "BLOCKS_BELOW", 1e9)    # blocks: one call per block; uniform ones unmasked
        model(ids, mask)
        plan = row_layout(mask, True).mask
        assert isinstance(plan, DocumentPlan) and len(seen) == len(plan.blocks) == 2
        assert [m is None for m in seen] == [b.key_mask is None for b in plan.blocks] == [True, False]
        seen.clear()
        monkeypatch.setattr(Dm, "BLOCKS_BELOW", 0.0)    # the dense form: one call, a (B, 1, S, S) mask
        model(ids, mask)
        assert len(seen) == 1 and seen[0].shape == (2, 1, S, S)


def test_blocks_group_documents_of_similar_length():
    lengths = np.array([3, 100, 60, 45, 7, 12, 51, 200])
    groups = Dm.group_by_length(lengths, ratio=2.0)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    for g in groups:
        assert lengths[g].max() <= 2.0 * lengths[g].min()
    assert [sorted(lengths[g].tolist(), reverse=True) for g in groups] == [[200, 100], [60, 51, 45], [12, 7], [3]]


@pytest.fixture(scope="module")
def named_docs(tmp_path_factory):
    """Shards whose token ids name their document: ids of document i are all 5 + i."""
    rng = np.random.default_rng(0)
    docs = [np.full(int(rng.integers(3, 40)), 5 + i) for i in range(60)]
    d = tmp_path_factory.mktemp("named")
    write_shard_set(docs, d, vocab_size=100, max_docs_per_shard=10)
    return d


def test_the_loader_numbers_each_rows_documents(named_docs):
    """[CLS] opens document 1, each [SEP] closes one; the tokens, masks and labels are those of
    cross-document packing, whose mask is 1 on every token."""
    kw = dict(seq_len=32, micro_batch_size=4, num_workers=0, seed=1, max_epochs=1, whole_word_mask=False)
    doc = list(ShardLoader(named_docs, packing="document", **kw))
    cross = list(ShardLoader(named_docs, packing="cross_document", **kw))
    assert len(doc) == len(cross) > 3
    several = 0
    for a, b in zip(doc, cross):
        for key in ("input_ids", "labels", "token_type_ids"):
            assert torch.equal(a[key], b[key])
        assert torch.equal(b["attention_mask"], (a["attention_mask"] > 0).long())
        original = torch.where(a["labels"] != -100, a["labels"], a["input_ids"])
        for row, numbers in zip(original.tolist(), a["attention_mask"].tolist()):
            assert numbers[0] == 1 and row[0] == CLS
            owner = {}
            for i, (tok, n) in enumerate(zip(row, numbers)):
                if n == 0:
                    assert tok == 0
                    continue
                if i > 0 and numbers[i - 1] not in (0, n):
                    assert row[i - 1] == SEP and n == numbers[i - 1] + 1   # a [SEP] closed the previous one
                if tok >= 5:
                    assert owner.setdefault(n, tok) == tok                 # one document per number
            several += max(numbers) > 1
    assert several > 0


def test_packing_keys_are_checked(named_docs):
    from data_pipeline.errors import UsageError
    from data_pipeline.loader import PACKINGS
    from roformer_dist.config import Packing, choices

    assert choices(Packing) == PACKINGS        # the config's values are the loader's (it cannot import config)
    assert load_config(None, []).data.packing == "document"
    with pytest.raises(ConfigError, match="data.packing"):
        load_config(None, ["data.packing=diagonal"])
    with pytest.raises(ConfigError, match="model.document_positions"):
        load_config(None, ["model.document_positions=reset"])
    with pytest.raises(UsageError, match="packing: expected one of document, cross_document, got 'rows'"):
        ShardLoader(named_docs, seq_len=32, micro_batch_size=4, num_workers=0, packing="rows")


def test_a_resumed_run_may_change_its_packing_and_the_change_is_named():
    """Packing, document positions and the document kernel have no parameters: the resume check lets them
    change, and the trainer logs each change (a checkpoint from before document packing counts as the default)."""
    from roformer_dist.checkpoint.compat import changed_settings, differences
    from roformer_dist.config import to_dict

    saved = to_dict(load_config(None, ["data.packing=cross_document"]))
    now = load_config(None, ["model.document_positions=continue", "model.document_attention=blocks"])
    assert differences(saved, 1, now, 1) == []
    assert changed_settings(saved, now) == ["data.packing: 'cross_document' in the checkpoint, 'document' now",
                                            "model.document_positions: 'restart' in the checkpoint, 'continue' now",
                                            "model.document_attention: 'auto' in the checkpoint, 'blocks' now"]
    older = {k: v for k, v in saved.items() if k != "data"}
    assert changed_settings(older, load_config(None, [])) == []


def test_a_flash_attn_that_does_not_load_is_said_once_and_auto_takes_flex(tmp_path, monkeypatch, caplog):
    """NGC-style images ship a flash-attn built for another torch: installed (found by importlib), but its import
    fails. ``auto`` then takes flex attention on CUDA instead of crashing in the first forward; one warning."""
    import logging
    import sys

    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    Dm.flash_varlen_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="roformer_dist.nn.documents"):
            assert Dm.kernel_for("auto", "softmax", "cuda") == "flex"
            assert Dm.kernel_for("auto", "softmax", "cuda") == "flex"
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "flash-attn is installed but does not load (ImportError: " in warnings[0]
        assert "undefined symbol" in warnings[0]
    finally:
        Dm.flash_varlen_available.cache_clear()
