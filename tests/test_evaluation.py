"""Baselines and evaluation: the unigram model against an independent count, eval independent of the
data-parallel size, ``roformer-eval``'s errors, and the rotary-vs-absolute ablation end to end
(real roformer-train runs, real TensorBoard events, the length-generalisation report)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from roformer_dist.config import load_config, replace

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ROOT / "configs" / "experiments" / "debug.yaml"
SPECIAL = {0, 1, 2, 3, 4}


def debug_cfg(shards, *overrides):
    cfg = load_config(DEBUG, [f"data.shards={shards.dir}", f"data.eval_shards={shards.eval_dir}", *overrides])
    return replace(cfg, **{"model.vocab_size": shards.vocab_size})


def tar_token_counts(shard_dir: Path) -> Counter:
    """Token ids of every .ids member, read with the standard library's tarfile (not our reader)."""
    counts = Counter()
    for tar in sorted(shard_dir.glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for member in tf.getmembers():
                if member.name.endswith(".ids"):
                    counts.update(np.frombuffer(tf.extractfile(member).read(), "<u2").tolist())
    return counts


def test_unigram_counts_equal_an_independent_count(small_shards):
    from roformer_dist.observe.baselines import count_tokens

    u = count_tokens(small_shards.dir)
    expected = tar_token_counts(small_shards.dir)
    assert u.num_shards_counted == u.num_shards == len(list(small_shards.dir.glob("shard-*.tar")))
    for token_id in range(small_shards.vocab_size):
        want = 0 if token_id in SPECIAL else expected.get(token_id, 0)
        assert u.counts[token_id] == want, token_id
    probs = np.exp(u.log_probs)
    assert probs[sorted(SPECIAL)].sum() == 0 and probs.sum() == pytest.approx(1.0, abs=1e-9)


def test_unigram_count_stops_at_the_cap_on_whole_shards(small_shards):
    from data_pipeline.shards import read_manifest
    from roformer_dist.observe.baselines import count_tokens

    sizes = {e["num_tokens"] for e in read_manifest(small_shards.dir)["shards"]}
    one = count_tokens(small_shards.dir, max_tokens=1)
    assert one.num_shards_counted == 1 and one.num_tokens in sizes   # no special ids in stored documents
    assert count_tokens(small_shards.dir, max_tokens=1).counts.tolist() == one.counts.tolist()  # seeded
    two = count_tokens(small_shards.dir, max_tokens=one.num_tokens + 1)
    assert two.num_shards_counted == 2
    with pytest.raises(ValueError, match="max_tokens"):
        count_tokens(small_shards.dir, max_tokens=0)


def test_baselines_at_the_eval_positions(small_shards):
    """Unigram cross-entropy and most-frequent-token accuracy, recomputed by hand on the same batches."""
    from roformer_dist.observe.evaluation import Evaluator, eval_loader

    cfg = debug_cfg(small_shards, "data.eval_batches=3")
    counts = tar_token_counts(small_shards.dir)
    for s in SPECIAL:
        counts.pop(s, None)
    total, predictable = sum(counts.values()), small_shards.vocab_size - len(SPECIAL)
    top = max(sorted(counts), key=lambda t: counts[t])
    nll, hits, n = 0.0, 0, 0
    it = iter(eval_loader(cfg, 256))
    for _ in range(3):
        for t in next(it)["labels"].flatten().tolist():
            if t != -100:
                nll -= math.log((counts.get(t, 0) + 1) / (total + predictable))
                hits += t == top
                n += 1
    calls = []

    def no_model(batch):
        calls.append(batch["input_ids"].shape)
        return torch.zeros(3, dtype=torch.float64)

    r = Evaluator(cfg).evaluate_length(256, no_model)
    assert r["unigram_loss"] == pytest.approx(nll / n, rel=1e-9)
    assert r["most_frequent_acc"] == pytest.approx(hits / n, rel=1e-12)
    assert len(calls) == 3 and calls[0][1] == 256


def test_eval_does_not_depend_on_the_data_parallel_size(small_shards):
    """Replicas split the eval batches; their summed result equals one process's, and each replica
    runs the same number of forwards (an odd batch count makes one replica discard a forward)."""
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.observe.evaluation import Evaluator, model_eval_step

    cfg = debug_cfg(small_shards, "data.eval_batches=3")
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model).eval()
    step = model_eval_step(model)
    one = Evaluator(cfg).evaluate_length(128, step)
    parts, forwards = [], []
    for rank in range(2):
        count = [0]

        def counted(batch, count=count):
            count[0] += 1
            return step(batch)

        Evaluator(cfg).evaluate_length(128, counted, dp_rank=rank, dp_size=2, reduce=lambda s: parts.append(s.clone()))
        forwards.append(count[0])
    total = parts[0] + parts[1]
    assert forwards == [2, 2]
    assert int(total[2]) == one["predicted"] > 0
    assert total[0].item() / total[2].item() == pytest.approx(one["loss"], rel=1e-6)
    assert total[1].item() / total[2].item() == pytest.approx(one["mlm_acc"], rel=1e-9)


def test_eval_cli_explains_bad_input(tmp_path, capsys):
    from roformer_dist.cli.eval import main

    assert main([str(tmp_path / "missing")]) == 5
    assert "no such checkpoint" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 5
    assert "not a roformer-dist checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "empty"), "--lengths", "128,100"])
    assert e.value.code == 2 and "100 is not a positive multiple of 8" in capsys.readouterr().err


def test_length_notes():
    from roformer_dist.observe.length_report import length_note

    assert length_note("rotary", 512, 512, 1536) == (True, "")
    assert length_note("rotary", 2048, 512, 1536)[0] is True
    ok, note = length_note("absolute", 1024, 512, 1536)
    assert ok and "512..1023 untrained" in note
    ok, note = length_note("absolute", 2048, 512, 1536)
    assert not ok and "1536" in note


TINY_STAGES = ("curriculum.stages=[{name: a, seq_len: 128, global_batch_size: 4, steps: 2}, "
               "{name: b, seq_len: 256, global_batch_size: 4, steps: 2}, "
               "{name: c, seq_len: 512, global_batch_size: 4, steps: 2, eval_lengths: [128, 512]}]")


@pytest.mark.slow
def test_ablation_and_length_generalisation_end_to_end(small_shards, tmp_path):
    """bench/ablation.py: two real 2-rank ZeRO-2 runs in one TensorBoard logdir, the per-eval-step
    table, and roformer-eval's report (one row per length) reproducing the trainer's own eval."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    from roformer_dist.runtime.events import read_scalars

    out = tmp_path / "abl"
    cmd = [sys.executable, str(ROOT / "bench" / "ablation.py"), "--config", str(DEBUG), "--out", str(out),
           "--lengths", "128,512,1024", f"data.shards={small_shards.dir}",
           f"data.eval_shards={small_shards.eval_dir}", "data.eval_batches=3", "trainer.eval_every=0",
           "trainer.save_every=0", "trainer.log_every=1", TINY_STAGES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])

    runs = EventMultiplexer().AddRunsFromDirectory(str(out)).Runs()
    assert {"rotary/tb", "absolute/tb"} <= set(runs)
    report = json.loads((out / "ablation.json").read_text())
    tb = {enc: read_scalars(out / enc / "tb") for enc in ("rotary", "absolute")}
    assert [r["step"] for r in report["eval_steps"]] == [2, 4, 6]
    assert [r["seq_len"] for r in report["eval_steps"]] == [128, 256, 512]
    for row in report["eval_steps"]:
        for enc in ("rotary", "absolute"):
            assert row[enc] == pytest.approx(dict(tb[enc]["eval/loss"])[row["step"]], abs=1e-6)
    final = report["final"]
    assert summary["absolute_minus_rotary"] == pytest.approx(final["absolute"] - final["rotary"], abs=1e-4)
    assert "eval/unigram_loss_512" in tb["rotary"] and "eval/most_frequent_acc_128" in tb["rotary"]
    assert "unigram" in (out / "rotary" / "logs" / "rank0.log").read_text()

    for enc in ("rotary", "absolute"):
        rows = report["lengths"][enc]["rows"]
        assert [r["length"] for r in rows] == [128, 512, 1024]
        assert report["lengths"][enc]["trained_max_len"] == 512
        # at a length the trainer evaluated, one process over the consolidated weights gives its number
        at512 = rows[1]
        assert at512["loss"] == pytest.approx(tb[enc]["eval/loss_512"][-1][1], abs=2e-5)
        assert at512["unigram_loss"] == pytest.approx(tb[enc]["eval/unigram_loss_512"][-1][1], abs=1e-6)
    rot, ab = report["lengths"]["rotary"]["rows"][2], report["lengths"]["absolute"]["rows"][2]
    assert rot["loss"] is not None and "beyond the trained length 512" in rot["note"]
    assert ab["loss"] is None and "not run" in ab["note"]   # the debug model has 512 position rows
    assert "absolute positions end at 512" in proc.stdout


class WeightsRunner:
    """Writes what a 1-rank ZeRO-0 DeepSpeed save writes of the model: its fp32 weights."""

    def __init__(self, model):
        self.model = model

    def save_checkpoint(self, root, tag):
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.model.state_dict()}, Path(root) / tag / "mp_rank_00_model_states.pt")


def tiny_checkpoint(shards, run_dir: Path, step: int, *overrides) -> Path:
    """A complete checkpoint (the trainer's own save) of a 1-layer debug model at ``step``, untrained."""
    from roformer_dist.checkpoint import store
    from roformer_dist.checkpoint.trainer_state import TrainCounters, TrainerState
    from roformer_dist.config import to_dict
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = debug_cfg(shards, "dist.world_size=1", "deepspeed.zero_stage=0", "model.num_hidden_layers=1",
                    "model.initializer_range=0.2", "data.eval_batches=1", f"run_dir={run_dir}", *overrides)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    sha = json.loads((shards.dir / "manifest.json").read_text())["tokenizer"]["sha256"]
    state = TrainerState(trainer=TrainCounters(step=step), loader={"format": 1}, rng={}, world_size=1, rank=0,
                         config=to_dict(cfg), tokenizer_sha256=sha, stage_index=0)
    return store.save(WeightsRunner(model), run_dir / "checkpoints", step, state, 0, 1, keep_last=1)


def test_eval_cli_sweeps_rope_settings_past_max_position_embeddings(small_shards, tmp_path, capsys):
    """One table: the checkpoint's settings, two bases, yarn, each at 128 and at 1024 (twice the model's
    512 positions); each row equals an eval of a model built with those settings; bad values exit 2."""
    from roformer_dist.checkpoint.store import read_trainer_state, resolve
    from roformer_dist.cli.eval import main
    from roformer_dist.config import from_dict, rope_settings
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.observe.evaluation import Evaluator, evaluate_model
    from roformer_dist.observe.length_report import load_model

    ckpt = tiny_checkpoint(small_shards, tmp_path / "run", 6)  # stage s128 done: trained up to 128
    out = tmp_path / "sweep.json"
    assert main([str(ckpt), "--lengths", "128,1024", "--rope-theta", "10000,500", "--rope-scaling", "none,yarn:8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    sweep = json.loads(out.read_text())[0]
    labels = [r["label"] for r in sweep["rows"]]
    assert labels == ["theta 10000 (checkpoint)", "theta 10000, yarn x8 (L 128)", "theta 500",
                      "theta 500, yarn x8 (L 128)"]
    for label in labels + ["unigram baseline"]:
        assert label in printed
    assert sweep["lengths"] == [128, 1024] and sweep["max_position_embeddings"] == 512

    cfg = from_dict(read_trainer_state(ckpt, 0).config)
    weights = load_model(resolve(ckpt)).state_dict()
    evaluator = Evaluator(cfg)
    for row in sweep["rows"][1:]:
        model = RoFormerForMaskedLM(dataclasses.replace(cfg.model, **row["rope"]))
        model.load_state_dict(weights)
        assert rope_settings(model.config).to_dict() == row["rope"]
        want = evaluate_model(model, cfg, [128, 1024], evaluator)
        assert row["loss"] == pytest.approx([want[128]["loss"], want[1024]["loss"]], rel=1e-6)
        assert sweep["unigram_loss"] == pytest.approx([want[128]["unigram_loss"], want[1024]["unigram_loss"]])
    losses = [r["loss"][1] for r in sweep["rows"]]
    assert len(set(losses)) == len(losses)  # the settings change the loss

    for flag, value, message in [("--rope-scaling", "none:2", "model.rope_scaling_factor: 2.0 has no effect"),
                                 ("--rope-scaling", "ntk:0.5", "model.rope_scaling_factor: expected a number >= 1"),
                                 ("--rope-scaling", "cubic", "model.rope_scaling: expected one of none, linear"),
                                 ("--rope-theta", "1", "model.rope_theta: expected a number > 1"),
                                 ("--rope-theta", "big", "'big': expected a number")]:
        with pytest.raises(SystemExit) as e:
            main([str(ckpt), flag, value])
        assert e.value.code == 2 and message in capsys.readouterr().err, (flag, value)
    absolute = tiny_checkpoint(small_shards, tmp_path / "abs", 6, "model.position_embedding=absolute")
    assert main([str(absolute), "--rope-theta", "500"]) == 2
    assert "only rotary models have rope settings to sweep" in capsys.readouterr().err
