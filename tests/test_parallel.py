"""Tensor x pipeline x data parallelism on CPU/gloo: equal to one process (roformer_dist/parallel).

Tiny fp32 model without dropout, random MLM batches. A step's global batch is a fixed list of
micro-batches; data rank d takes micro-batches d, d + dp, ..., so every layout averages the same
gradients and the loss traces must agree up to float reordering.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from roformer_dist.testing import run_distributed

VOCAB = 101  # odd: the tensor ranks hold 51 and 50 vocabulary rows
SEQ, GLOBAL_BATCH, MICRO = 16, 8, 2
STEPS = 4


def make_cfg(tensor=1, pipeline=1, world_size=1, zero=1, *extra):
    from roformer_dist.config import load_config

    return load_config(None, [
        f"model.vocab_size={VOCAB}", "model.hidden_size=32", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.intermediate_size=64", "model.max_position_embeddings=64",
        "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0",
        f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}", f"dist.world_size={world_size}",
        f"deepspeed.zero_stage={zero}", "optim.lr=3e-3", "optim.warmup_steps=0", "optim.grad_clip=1.0",
        f"curriculum.stages=[{{name: s, seq_len: {SEQ}, global_batch_size: {GLOBAL_BATCH}, steps: {STEPS}, "
        f"micro_batch_size: {MICRO}}}]", *extra])


DOCUMENTS = ([[2, 3, 2, 2, 4], [3, 3, 5, 5]], [[9, 7], [5, 11]])
"""Document lengths per row of the micro-batches (the mask numbers them, as the loader's document
packing does): many short ones (attended as length blocks) and a few long ones (one call with a
block-diagonal mask), so every layout is compared on both forms."""


def micro_batch(step: int, index: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(5, VOCAB, (MICRO, SEQ), generator=g)
    mask = torch.zeros_like(ids)
    for row, lengths in enumerate(DOCUMENTS[index % 2]):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        for number, (a, b) in enumerate(zip([0] + ends, ends)):
            mask[row, a:b] = number + 1
    mask[0, SEQ - 3:] = 0  # some padding
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.where((torch.rand(MICRO, SEQ, generator=g) < 0.25) & (mask > 0), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": labels}


def batches(first_step: int, dp_rank: int, dp_size: int):
    per_step = GLOBAL_BATCH // MICRO
    for step in range(first_step, 10**6):
        for i in range(dp_rank, per_step, dp_size):
            yield micro_batch(step, i)


def _train(rank, world_size, layout, zero, steps, save_dir=None, resume_dir=None, first_step=0):
    """Train ``steps`` steps in ``layout`` = (tensor, pipeline); returns (losses, accuracies)."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner

    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.config import stage_plans
    from roformer_dist.parallel.runner import build_parallel_engine

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = make_cfg(*layout, world_size, zero)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    first = stage_plans(cfg, world_size)[0]
    engine, runner = build_parallel_engine(cfg, model, first, world_size)
    runner.set_stage(first)
    if resume_dir is not None:
        engine.load_checkpoint(str(resume_dir), tag="t")
    it = batches(first_step, runner.dp_rank, runner.dp_size) if runner.reads_data else None
    losses, accs = [], []
    for _ in range(steps):
        out = runner.read_stats([runner.train_step(it)])[0]
        losses.append(out.loss)
        accs.append(out.mlm_acc)
    ev = runner.eval_step(micro_batch(99, 0))
    torch.distributed.all_reduce(ev)
    if save_dir is not None:
        engine.save_checkpoint(str(save_dir), tag="t", save_latest=False)
    return losses, accs, (ev[0] / ev[2]).item()


def _reference_state(steps):
    """The 1-process model after ``steps`` steps of plain PyTorch AdamW (the same math as DeepSpeed's
    engine in fp32) and its trace: the ground truth every layout is compared with."""
    from roformer_dist.parallel.engine import param_groups
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = make_cfg()
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    it, gas, losses = batches(0, 0, 1), GLOBAL_BATCH // MICRO, []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            loss = model(**next(it)).loss
            (loss / gas).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / gas)
    return model, losses


@pytest.fixture(scope="module")
def reference():
    return _reference_state(STEPS + 2)


@pytest.fixture(scope="module")
def data2():
    """Data parallel 2 alone (ZeRO-1; in fp32 ZeRO 1 and 2 do the same arithmetic)."""
    return run_distributed(_train, world_size=2, args=((1, 1), 1, STEPS), timeout=300)


def assert_close_traces(a, b, tol):
    assert len(a) == len(b), (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol, f"step {i + 1}: {x} vs {y} (|diff| {abs(x - y):.2e} > {tol})\n{a}\n{b}"


# ----------------------------------------------------------------------------- unit


def test_layout_rank_mapping_matches_deepspeed():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from roformer_dist.parallel.topology import Layout

    lay = Layout(tensor=2, pipeline=3, data=2)
    topo = PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=2)
    for r in range(lay.world_size):
        c = lay.coord(r)
        assert tuple(topo.get_coord(r)) == tuple(c) and lay.rank(*c) == r
    assert lay.group_ranks("tensor")[0] == [0, 1]
    assert lay.group_ranks("data")[0] == [0, 2]
    assert lay.group_ranks("pipe")[0] == [0, 4, 8]
    assert lay.group_ranks("model")[1] == [2, 3, 6, 7, 10, 11]


def test_check_layout_names_the_key():
    from roformer_dist.config import replace
    from roformer_dist.parallel.topology import check_layout

    cfg = make_cfg()
    with pytest.raises(ValueError, match="parallel.tensor"):
        check_layout(replace(cfg, **{"parallel.tensor": 3}), 3)  # 4 heads
    with pytest.raises(ValueError, match="deepspeed.zero_stage"):
        check_layout(replace(cfg, **{"parallel.pipeline": 2, "deepspeed.zero_stage": 2}), 2)
    with pytest.raises(ValueError, match="parallel.pipeline"):
        check_layout(replace(cfg, **{"parallel.pipeline": 4}), 4)  # 2 layers
    with pytest.raises(ValueError, match="deepspeed.zero_stage"):
        check_layout(replace(cfg, **{"parallel.tensor": 2, "deepspeed.zero_stage": 3}), 2)
    assert check_layout(replace(cfg, **{"parallel.tensor": 2, "parallel.pipeline": 2}), 8).data == 2


def test_shard_merge_roundtrip():
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.tensor import merge_shards, shard_tensor

    torch.manual_seed(0)
    model = RoFormerForMaskedLM(make_cfg().model)
    for name, p in model.state_dict().items():
        for tp in (2, 4):
            assert torch.equal(merge_shards(name, [shard_tensor(name, p, r, tp) for r in range(tp)]), p), name


# ----------------------------------------------------------------------------- tensor parallel = unsharded


def _tp_vs_unsharded(rank, world_size, attention="softmax"):
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.tensor import parallelize
    from roformer_dist.parallel.topology import Layout, ParallelDims
    from roformer_dist.parallel.tensor import shard_tensor

    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = RoFormerForMaskedLM(make_cfg(1, 1, 1, 1, f"model.attention={attention}").model)
    tp = parallelize(copy.deepcopy(full), ParallelDims(Layout(tensor=world_size)))
    b = micro_batch(0, 0)
    a, o = full(**b), tp(**b)
    a.loss.backward()
    o.loss.backward()
    errs = {"loss": abs(a.loss.item() - o.loss.item()), "acc": abs(a.accuracy.item() - o.accuracy.item())}
    ref_params = dict(full.named_parameters())
    assert {n for n, _ in tp.named_parameters()} == set(ref_params)
    errs["grad"] = max((shard_tensor(n, ref_params[n].grad, rank, world_size) - p.grad).abs().max().item()
                       for n, p in tp.named_parameters())
    with torch.no_grad():
        b.pop("labels")
        errs["logits"] = (full(**b).logits - tp(**b).logits).abs().max().item()
    return errs


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_tensor_parallel_forward_backward_equals_unsharded(attention):
    """Heads split over 2 tensor ranks: loss, accuracy, logits and every gradient shard as unsharded
    (linear attention too: its KV state and normaliser are per head)."""
    for errs in run_distributed(_tp_vs_unsharded, world_size=2, args=(attention,), timeout=120):
        assert max(errs.values()) <= 1e-5, errs


# ----------------------------------------------------------------------------- layouts = one process


def test_tensor2_x_data2_zero2_matches_data2(reference, data2):
    _, ref_losses = reference
    dp2 = data2
    tpdp = run_distributed(_train, world_size=4, args=((2, 1), 2, STEPS), timeout=300)
    assert all(r == tpdp[0] for r in tpdp), "every rank reports the same reduced statistics"
    assert_close_traces(dp2[0][0], ref_losses[:STEPS], 1e-5)
    assert_close_traces(tpdp[0][0], dp2[0][0], 1e-5)
    assert_close_traces(tpdp[0][1], dp2[0][1], 1e-6)
    assert abs(tpdp[0][2] - dp2[0][2]) <= 1e-5


def test_pipeline2_x_data2_zero1_matches_data2(reference, data2):
    _, ref_losses = reference
    dp2 = data2
    ppdp = run_distributed(_train, world_size=4, args=((1, 2), 1, STEPS), timeout=300)
    assert all(r == ppdp[0] for r in ppdp)
    assert_close_traces(ppdp[0][0], dp2[0][0], 1e-5)
    assert_close_traces(ppdp[0][0], ref_losses[:STEPS], 1e-5)
    assert abs(ppdp[0][2] - dp2[0][2]) <= 1e-5


def test_tensor2_x_pipeline2_matches_one_process_resumes_and_consolidates(reference, tmp_path: Path):
    """4 ranks as tensor 2 x pipeline 2: the 1-process trace; stop after 3 steps + resume in fresh
    processes continues it; the consolidated checkpoint gives the 1-process model's logits."""
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.checkpoint.weights import consolidate_state_dict
    from roformer_dist.parallel.topology import Layout

    ref_model, ref_losses = reference
    first = run_distributed(_train, world_size=4, args=((2, 2), 1, 3, tmp_path), timeout=300)
    assert all(r == first[0] for r in first)
    second = run_distributed(_train, world_size=4, args=((2, 2), 1, 3, tmp_path / "after", tmp_path, 3),
                             timeout=300)
    assert_close_traces(first[0][0] + second[0][0], ref_losses, 1e-4)

    cfg = make_cfg()
    mcfg, sd = consolidate_state_dict(tmp_path / "after" / "t", cfg.model, Layout(tensor=2, pipeline=2))
    model = RoFormerForMaskedLM(mcfg)
    model.load_state_dict(sd, strict=True)
    b = micro_batch(7, 0)
    b.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(model(**b).logits, ref_model(**b).logits, atol=1e-4, rtol=1e-4)
