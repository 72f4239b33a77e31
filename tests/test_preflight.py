"""The GPU preflight (``launch/preflight.py``) runs the step as the run will: the worst stage's micro-batch, in the
run's precision, through the plan the loader ships (packed documents and the document kernel), at the stage's
masking rate; the model's own fp32 weights are never cast or moved. On CPU its parts run here (the CUDA gate
apart); its arithmetic agrees with the dry run on the GPU preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roformer_dist.config import load_config, stage_plans
from roformer_dist.errors import ConfigError
from roformer_dist.launch.memory_estimate import estimate_stage
from roformer_dist.nn.model import IGNORE_INDEX, RoFormerForMaskedLM
from roformer_dist.launch.preflight import (forward_backward, mean_document_length, preflight_batch, run_copy,
                                           verdict, worst_stage, _refusal)
from trainer_runs import DEBUG

PRESET = Path(__file__).resolve().parent.parent / "configs" / "experiments" / "base_gpu.yaml"


def _debug(*overrides):
    return load_config(DEBUG, ["model.vocab_size=4000", "dist.world_size=1", *overrides])


@pytest.mark.parametrize("precision,packing,form", [("bf16", "document", "blocks"), ("fp32", "cross_document", "whole")])
def test_the_step_sees_the_runs_dtype_layout_and_masking_rate(precision, packing, form):
    """A hook on the model records what the preflight's forward received: the copy's dtype, the loader's row plan
    (packed documents of the mean length: the blocks on CPU) and the stage's masking rate; the model's own
    fp32 weights are untouched and get no gradient."""
    stages = ("curriculum.stages=[{name: a, seq_len: 128, global_batch_size: 8, steps: 2}, {name: b, seq_len: 512, "
              "global_batch_size: 4, steps: 2, mlm_probability: 0.4}]")
    cfg = _debug(f"deepspeed.precision={precision}", f"data.packing={packing}", stages)
    stage, _ = worst_stage(cfg, stage_plans(cfg, 1), 1)
    assert stage.seq_len == 512  # the longest stage of the debug curriculum has the largest activations
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def hook(module, args, kwargs):
        seen.append((next(module.parameters()).dtype, kwargs.get("layout"), kwargs["input_ids"].shape,
                     kwargs["labels"]))
    model.register_forward_pre_hook(hook, with_kwargs=True)
    batch = preflight_batch(cfg, stage, "cpu", document_length=60.0)
    forward_backward(run_copy(model, cfg, torch.device("cpu")), batch, torch.device("cpu"))

    ((dtype, layout, shape, labels),) = seen
    assert dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    assert shape == (stage.micro_batch_size, 512) and layout.form == form
    rate = (labels != IGNORE_INDEX).float().mean().item()
    assert abs(rate - 0.4) < 0.05
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_cuda_runs_batch_carries_the_flex_plan_of_its_documents():
    """Planned for a CUDA run (on the host, as the loader's workers do): packed rows take flex attention's
    block mask, rows of one document take no mask."""
    cfg = load_config(PRESET, ["model.vocab_size=8000", "curriculum.stages=[{name: s, seq_len: 512, "
                               "global_batch_size: 4, micro_batch_size: 4, steps: 1}]"])
    (stage,) = stage_plans(cfg, 1)
    packed = preflight_batch(cfg, stage, "cuda", document_length=85.0)
    assert packed["layout"].form == "flex"
    assert int(packed["attention_mask"][0].max()) == -(-512 // 85)  # 7 documents a row, the last one cut
    whole = preflight_batch(load_config(PRESET, ["model.vocab_size=8000", "data.packing=cross_document"]),
                            stage, "cuda", document_length=85.0)
    assert whole["layout"].form == "whole"


def test_the_mean_document_length_comes_from_the_manifests():
    assert mean_document_length({"a": {"num_docs": 10, "num_tokens": 900}, "b": {"num_docs": 30, "num_tokens": 100}}) \
        == 25.0
    assert mean_document_length({"a": {}}) == 0.0


def test_the_preset_that_the_dry_run_fits_is_not_refused_by_the_preflights_arithmetic():
    """The GPU preset's micro-batch fits 80 GB by the dry run; with the estimate's activations standing in for the
    measured step (in bf16, packed documents through flex: the step the preflight runs), the preflight's
    verdict agrees. In fp32 (what the preflight measured before it ran the run's precision) the same step is
    refused: twice the activations."""
    cfg = load_config(PRESET, ["model.vocab_size=8000"])
    stage, e = worst_stage(cfg, stage_plans(cfg, 1), 1)
    device = 80 * 10**9
    step = e.activations + e.gradients  # what the copy's step allocates: activations and its full gradients
    v = verdict(stage, e, step, device)
    assert v.fits and v.needed >= e.total and v.largest_micro_batch() >= stage.micro_batch_size
    fp32 = estimate_stage(load_config(PRESET, ["model.vocab_size=8000", "deepspeed.precision=fp32"]), stage, 1,
                          "cuda", True)
    assert not verdict(stage, e, fp32.activations + fp32.gradients, device).fits


def test_a_refusal_names_the_stage_and_the_micro_batch_that_would_fit():
    cfg = load_config(PRESET, ["model.vocab_size=8000"])
    stage, e = worst_stage(cfg, stage_plans(cfg, 1), 1)
    v = verdict(stage, e, 4 * e.activations, 80 * 10**9)
    assert not v.fits and 0 < v.largest_micro_batch() < stage.micro_batch_size
    message = str(_refusal(v, "measured"))
    assert isinstance(_refusal(v, "x"), ConfigError)
    assert "curriculum.stages[0] ('s512'" in message and f"at most {v.largest_micro_batch()}" in message
