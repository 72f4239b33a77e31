"""The recipes of docs/architecture/changing-things.md, done: each kind of change made here with nothing but what
the recipe says (a module of its own, and one line in a table), then run through the framework's own code.

The corpus format's recipe is ``tests/test_corpus.py::test_a_new_format_is_one_reader_and_one_line_in_the_table``.
Every test runs in a few seconds, without DeepSpeed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from roformer_dist.config import replace
from roformer_dist.errors import ConfigError
from roformer_dist.loop.callback import Callback

from test_trainer_loop import FakeLoader, FakeRunner, cfg_with, run_of


# --------------------------------------------------------------------------- a per-step concern


class LossHighWater(Callback):
    """What a new per-step concern's module holds (here: the highest loss so far, in every step's record):
    a Callback with the hooks it needs, built from the build context (the class itself is its ``build``)."""

    def __init__(self, ctx):
        self.highest = -math.inf

    def step_read(self, tr, done):
        if not done.stats.nonfinite:
            self.highest = max(self.highest, done.stats.loss)
        done.record["loss_high_water"] = self.highest


def test_a_per_step_concern_is_one_callback_module_and_one_line(tmp_path, monkeypatch):
    from roformer_dist.loop.callbacks import CALLBACKS, BuildContext, build_callbacks
    from roformer_dist.loop.trainer import Trainer
    from roformer_dist.runtime.process_group import DistEnv, TorchComm

    monkeypatch.setitem(CALLBACKS, "loss_high_water", LossHighWater)  # the one line in the table
    monkeypatch.setitem(CALLBACKS, "checkpointing", lambda ctx: None)  # the fake runner has no files to save
    cfg = cfg_with(f"run_dir={tmp_path / 'run'}", "data.eval_shards=", "trainer.stop_at_step=8", "trainer.log_every=2")
    run, env = run_of(cfg), DistEnv(0, 1, 0)
    callbacks = build_callbacks(BuildContext(run, env, TorchComm(), lambda *_: 0.0))
    assert list(callbacks.named)[-1] == "loss_high_water"
    tr = Trainer(run, env, FakeRunner([], nonfinite_at={3}), FakeLoader(), callbacks)
    try:
        assert tr.fit() == 0
    finally:
        tr.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert all(r["loss_high_water"] == 2.0 for r in lines)  # the fake runner's loss; step 3 non-finite
    assert lines[2]["loss"] is None


# --------------------------------------------------------------------------- an attention kind


def sigmoid_kind():
    """What a new attention kind's module holds (here: sigmoid attention, each weight sigmoid(q.k / sqrt(D) -
    log S), no normalisation over the keys): its ``attend`` and its declarations."""
    from roformer_dist.nn.attention_kinds.kind import AttentionKind
    from roformer_dist.nn.rotary import run_kernel

    def attend(q, k, v, attn_mask, cos, sin, kernel, dropout_p):
        if cos is not None:
            q, k = run_kernel(kernel, q, k, cos, sin)
        S, D = q.shape[1], q.shape[-1]
        scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(D) - math.log(S)
        weights = torch.sigmoid(scores)                                    # (B, H, S, S)
        if attn_mask is not None:
            weights = weights * attn_mask.to(weights.dtype)                # (B, 1, 1, S): padding keys out
        return torch.einsum("bhst,bthd->bshd", weights, v)

    return AttentionKind(name="sigmoid", attend=attend, mixing=lambda seq_len, head_dim: seq_len,
                         activation_bytes=lambda c: c.heads * c.seq_len * c.value_bytes, hf_export=False,
                         document_kernels=("blocks",), document_note="sigmoid attention runs documents in blocks",
                         row_masks=False)


def test_an_attention_kind_is_one_module_and_one_line(monkeypatch):
    from roformer_dist.config import load_config, stage_plans
    from roformer_dist.hf.convert import check_exportable
    from roformer_dist.launch.memory_estimate import estimate_stage
    from roformer_dist.nn.attention_kinds import ATTENTION, check_attention
    from roformer_dist.nn.model import RoFormerForMaskedLM

    monkeypatch.setitem(ATTENTION, "sigmoid", sigmoid_kind())  # the one line in the table
    cfg = load_config(None, ["model=debug", "model.vocab_size=100", "model.attention=sigmoid", "data.shards=/nowhere"])
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    ids = torch.randint(5, cfg.model.vocab_size, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.bool)
    mask[1, 20:] = False
    labels = torch.where(torch.rand(2, 32) < 0.3, ids, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()                                              # it trains
    assert torch.isfinite(out.loss) and model.embeddings.word_embeddings.weight.grad is not None
    softmax = replace(cfg, **{"model.attention": "softmax"})
    # the FLOPs, the memory estimate, the HF export and the document kernels follow from the declarations
    assert model.flops_per_token(512) == RoFormerForMaskedLM(softmax.model).flops_per_token(512)
    plan = stage_plans(cfg, 1)[0]
    assert estimate_stage(cfg, plan, 1).layers_per_sample > estimate_stage(softmax, plan, 1).layers_per_sample
    with pytest.raises(ConfigError, match="model.attention: 'sigmoid' has no HF RoFormer equivalent"):
        check_exportable(cfg.model)
    with pytest.raises(ConfigError, match="model.document_attention: sigmoid attention does not run flex"):
        check_attention("sigmoid", "flex")
    with pytest.raises(ConfigError, match="model.attention: 'cosine' is not an attention kind; expected one of "
                                          "softmax, linear, sigmoid"):
        RoFormerForMaskedLM(replace(cfg, **{"model.attention": "cosine"}).model)


# --------------------------------------------------------------------------- a metrics sink


class CsvSink:
    """What a new sink's module holds (here: the scalars as ``step,tag,value`` lines), with its ``read``."""

    def __init__(self, ctx):
        self.path = ctx.dir / "scalars.csv"
        kept = [x for x in (self.path.read_text().splitlines() if self.path.exists() else [])
                if int(x.split(",")[0]) <= ctx.resume_step]                  # a resume drops the later steps
        self.file = open(self.path, "w", encoding="utf-8")
        self.file.write("".join(x + "\n" for x in kept))

    def log_record(self, record):
        pass

    def log_scalars(self, step, values):
        self.file.write("".join(f"{step},{tag},{value}\n" for tag, value in values.items()))

    def log_text(self, tag, text, step=0):
        pass

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()

    @staticmethod
    def read(directory):
        out = {}
        for line in (directory / "scalars.csv").read_text().splitlines():
            step, tag, value = line.split(",")
            out.setdefault(tag, []).append((int(step), float(value)))
        return out


def test_a_sink_is_one_module_and_one_line(tmp_path, monkeypatch):
    from roformer_dist.observe.metrics import MetricsWriter
    from roformer_dist.observe.sinks import SINKS, check_sinks

    monkeypatch.setitem(SINKS, "csv", CsvSink)  # the one line in the table
    assert check_sinks(["jsonl", "csv"]) == ("jsonl", "csv")
    first = MetricsWriter(tmp_path, 0, 0, ("jsonl", "csv"))
    for step in (1, 2, 3):
        first.scalars(step, {"train/loss": 4.0 - step})
    first.close()
    resumed = MetricsWriter(tmp_path, 0, 2, ("jsonl", "csv"))          # resumed from step 2's checkpoint
    resumed.scalars(3, {"train/loss": 0.5})
    resumed.close()
    assert CsvSink.read(tmp_path) == {"train/loss": [(1, 3.0), (2, 2.0), (3, 0.5)]}


# --------------------------------------------------------------------------- an LR schedule


def test_a_schedule_is_one_shape_and_one_name(monkeypatch):
    """The shape goes into plan/curriculum.SCHEDULES; its name into config/schema.LRSchedule (a Literal, which
    a test cannot extend: the config is built here without the loader's check of the name)."""
    from roformer_dist.plan.curriculum import SCHEDULES, lr_at

    monkeypatch.setitem(SCHEDULES, "step", lambda peak, floor, progress: peak if progress < 0.5 else floor)
    cfg = cfg_with("optim.warmup_steps=2", "optim.min_lr_ratio=0.1")
    optim = replace(cfg.optim, schedule="step")
    stages = cfg.curriculum.stages                              # 18 steps
    lrs = [lr_at(optim, stages, s) for s in range(18)]
    peak = cfg.optim.lr
    assert lrs[0] == peak / 2 and lrs[1] == lrs[2] == peak and lrs[-1] == pytest.approx(0.1 * peak)
    assert sorted(set(round(x / peak, 6) for x in lrs[2:])) == [0.1, 1.0]


# --------------------------------------------------------------------------- a per-stage value


def test_a_per_stage_value_is_one_field_and_where_the_switch_applies_it(tmp_path):
    """``StageConfig.hidden_dropout_prob`` was added this way: its field (``stage_override("model.hidden_dropout_prob")``
    in config/schema.py) and its effect in the stage switch (loop/stage.py). The rest is the framework's: the
    check (as model.hidden_dropout_prob's, naming the stage), the stage plans and the resolved run's JSON, the
    resume's note of a changed value."""
    import dataclasses
    from types import SimpleNamespace

    from roformer_dist.checkpoint.compat import changed_settings
    from roformer_dist.config import stage_plans, to_dict, validate
    from roformer_dist.launch.resolved import ResolvedRun
    from roformer_dist.loop.callback import Callbacks
    from roformer_dist.loop.trainer import Trainer
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.runtime.process_group import DistEnv

    cfg = cfg_with("model.hidden_dropout_prob=0.1")
    stages = list(cfg.curriculum.stages)

    def with_stage(**own):
        st = stages[:1] + [dataclasses.replace(stages[1], **own)] + stages[2:]
        return replace(cfg, **{"curriculum.stages": tuple(st)})

    with pytest.raises(ConfigError, match=r"curriculum.stages\[1\] \(s256\).hidden_dropout_prob: expected a "
                                          r"probability in \[0, 1\), got 1.5"):
        validate(with_stage(hidden_dropout_prob=1.5))
    tuned = with_stage(hidden_dropout_prob=0.0)
    assert [p.settings["model.hidden_dropout_prob"] for p in stage_plans(tuned, 1)] == [0.1, 0.0, 0.1]
    run = run_of(tuned)
    assert ResolvedRun.from_json(json.loads(json.dumps(run.to_json())), "x").stages[1].settings == run.stages[1].settings
    assert "curriculum.stages[1].hidden_dropout_prob: None in the checkpoint, 0.0 now" in \
        changed_settings(to_dict(cfg), tuned)

    runner = FakeRunner([])
    runner.engine = SimpleNamespace(module=RoFormerForMaskedLM(tuned.model))
    tr = Trainer(run, DistEnv(0, 1, 0), runner, FakeLoader(), Callbacks({}))
    dropouts = [m for m in runner.engine.module.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and {m.p for m in dropouts} == {0.1}
    for index, p in ((0, 0.1), (1, 0.0), (2, 0.1)):
        tr.switch_stage(index)
        assert {m.p for m in dropouts} == {p}, index


def test_the_chapter_names_a_test_for_every_change_and_two_files_each():
    """docs/architecture/changing-things.md's table: every change names two package files and a test that
    exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    rows = [line for line in (root / "docs" / "architecture" / "changing-things.md").read_text().splitlines()
            if line.startswith("| ") and "`" in line.split("|")[3]]
    assert len(rows) == 6
    for row in rows:
        change, files, test = (cell.strip() for cell in row.split("|")[1:4])
        assert files.count(";") == 1, change                                   # two files
        path, _, name = test.strip("`").rpartition("::")
        source = (root / (path or "tests/test_changing_things.py")).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{change}: no test {test}"
