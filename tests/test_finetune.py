"""roformer-finetune: one short epoch end to end on real product reviews, reloadable best model, the
pretrained vs from-scratch start, sentence pairs from tsv, the native path for models HF cannot express,
mean pooling,
the naive Bayes baseline against a direct evaluation of its formula, clear errors on bad input, torchrun."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from roformer_dist.config import ModelConfig  # noqa: E402
from roformer_dist.checkpoint.weights import save_weights  # noqa: E402
from roformer_dist.errors import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA  # noqa: E402
from roformer_dist.cli.finetune import main  # noqa: E402
from roformer_dist.finetune.run import run  # noqa: E402
from roformer_dist.nn.model import RoFormerForMaskedLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONTRACT_KEYS = {"task", "num_labels", "labels", "train_examples", "dev_examples", "truncated", "epochs",
                 "best_epoch", "best_dev_accuracy", "best_dev_macro_f1", "model", "from_scratch", "baseline"}
LAST_LINE = re.compile(r"^dev accuracy (\d\.\d{4})  macro-F1 (\d\.\d{4})  \(best epoch (\d+)\)$")


def tiny_config(vocab_size: int, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0), **kw})


@pytest.fixture(scope="module")
def tiny_export(small_shards, tmp_path_factory):
    """A tiny (untrained) RoFormer with the small shards' tokenizer, exported as an HF repository."""
    from roformer_dist.hf.export import ExportSource, export_hf_repository

    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config(small_shards.vocab_size))
    out = tmp_path_factory.mktemp("finetune") / "hf"
    export_hf_repository(model, out, source=ExportSource("test"), tokenizer=Path(small_shards.tokenizer),
                         check_docs=0, say=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def sentiment(reviews, tmp_path_factory):
    """40 training and 24 dev reviews (half positive), deduplicated."""
    pos = list(dict.fromkeys(reviews[0].read_text(encoding="utf-8").splitlines()))[:32]
    neg = list(dict.fromkeys(reviews[1].read_text(encoding="utf-8").splitlines()))[:32]
    rows = [{"sentence": t, "label": 1} for t in pos] + [{"sentence": t, "label": 0} for t in neg]
    rng = np.random.default_rng(0)
    rows = [rows[i] for i in rng.permutation(len(rows))]
    d = tmp_path_factory.mktemp("sentiment")
    for name, part in (("train.jsonl", rows[:40]), ("dev.jsonl", rows[40:])):
        (d / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    return d


def args(model, data: Path, out: Path, *extra: str) -> list[str]:
    return (["--model", str(model)] if model else []) + [
        "--train", str(data / "train.jsonl"), "--dev", str(data / "dev.jsonl"), "--out", str(out),
        "--epochs", "1", "--batch-size", "8", "--max-length", "48", "--no-progress", "--threads", "1", *extra]


def dev_predictions(model, tokenizer, data: Path, max_length: int = 48):
    """Labels predicted by a reloaded model, example by example (no padding involved)."""
    rows = [json.loads(x) for x in (data / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    with torch.no_grad():
        return [int(model(**tokenizer(r["sentence"], truncation=True, max_length=max_length,
                                      return_tensors="pt")).logits.argmax(-1)) for r in rows], \
            [r["label"] for r in rows]


def native_accuracy(best: Path, data: Path, max_length: int = 48) -> float:
    """Dev accuracy of a classifier.pt model reloaded with load_native_classifier, example by example."""
    from roformer_dist.finetune.models import load_native_classifier

    model, tok = load_native_classifier(best)
    rows = [json.loads(x) for x in (data / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    with torch.no_grad():
        pred = [int(model(**tok(r["sentence"], truncation=True, max_length=max_length, return_tensors="pt"))
                    .argmax(-1)) for r in rows]
    return float(np.mean(np.equal(pred, [r["label"] for r in rows])))


def test_finetune_one_epoch_end_to_end(tiny_export, sentiment, tmp_path, capsys):
    """The command: results.json (the contract), the last line, TensorBoard, and a best model that
    AutoModelForSequenceClassification + AutoTokenizer reload with the same accuracy."""
    out = tmp_path / "ft"
    assert main(args(tiny_export, sentiment, out)) == 0
    stdout = capsys.readouterr().out
    lines = stdout.strip().splitlines()
    m = LAST_LINE.match(lines[-1])
    assert m, lines[-1]
    res = json.loads((out / "results.json").read_text())
    assert CONTRACT_KEYS <= set(res)
    assert res["task"] == "single" and res["num_labels"] == 2 and res["labels"] == [0, 1]
    assert (res["train_examples"], res["dev_examples"], res["best_epoch"]) == (40, 24, 1)
    assert res["from_scratch"] is False and res["baseline"] is None
    [ep] = res["epochs"]
    assert set(ep) == {"epoch", "dev_accuracy", "dev_macro_f1", "train_loss", "seconds"}
    assert float(m.group(1)) == round(res["best_dev_accuracy"], 4) and int(m.group(3)) == 1
    assert 0 < ep["train_loss"] < 5 and ep["seconds"] > 0
    # reviews longer than 48 tokens are truncated and counted, naming the file
    assert res["truncated"] > 0 and re.search(r"train\.jsonl: \d+ of 40 examples are longer", stdout)

    from roformer_dist.runtime.events import read_scalars

    scalars = read_scalars(out / "tb")
    assert scalars["dev/accuracy"] == [(1, pytest.approx(ep["dev_accuracy"]))]
    assert len(scalars["train/loss"]) == 5  # 40 examples / 8

    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "best").eval()
    tok = transformers.AutoTokenizer.from_pretrained(out / "best")
    pred, gold = dev_predictions(model, tok, sentiment)
    assert np.mean(np.equal(pred, gold)) == pytest.approx(res["best_dev_accuracy"])
    assert model.config.id2label == {0: "0", 1: "1"}


def test_console_entry_point():
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.finetune", "--help"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert r.returncode == 0 and "--baseline" in r.stdout and "results.json" in r.stdout
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.finetune", "--baseline", "ngram", "--train", "x.jsonl",
                        "--dev", "y.jsonl", "--out", "o"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert r.returncode == EXIT_DATA and "x.jsonl: no such file" in r.stderr


def test_pretrained_start_and_from_scratch(tiny_export, sentiment, tmp_path):
    """With a vanishing learning rate the best model's encoder is the start point: the export's weights,
    or fresh ones with --from-scratch (seeded: the same twice)."""
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tiny_export)
    start = hf.roformer.embeddings.word_embeddings.weight
    emb = {}
    for name, extra in (("pre", []), ("scratch", ["--from-scratch"])):
        res = run(args(tiny_export, sentiment, tmp_path / name, "--lr", "1e-30", *extra))
        assert res["from_scratch"] is (name != "pre")
        best = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / name / "best")
        emb[name] = best.roformer.embeddings.word_embeddings.weight
    torch.testing.assert_close(emb["pre"], start, rtol=0, atol=1e-6)
    assert (emb["scratch"] - start).abs().max() > 1e-3
    from roformer_dist.finetune.models import load_classifier

    again = load_classifier(str(tiny_export), [0, 1], from_scratch=True, seed=0).model
    torch.testing.assert_close(again.roformer.embeddings.word_embeddings.weight, emb["scratch"], rtol=0, atol=1e-6)


def test_sentence_pairs_from_tsv(tiny_export, sentiment, tmp_path):
    from roformer_dist.finetune.data import read_examples
    from roformer_dist.finetune.tasks import encode
    from roformer_dist.hf.tokenizer import load_hf_tokenizer

    rows = [json.loads(x) for x in (sentiment / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    tsv = ["sentence1\tsentence2\tlabel"] + [f"{a['sentence'][:20]}\t{b['sentence'][:20]}\t{'same' if a['label'] == b['label'] else 'diff'}"
                                              for a, b in zip(rows, rows[1:] + rows[:1])]
    (tmp_path / "train.tsv").write_text("\n".join(tsv[:31]) + "\n", encoding="utf-8")
    (tmp_path / "dev.tsv").write_text("\n".join(tsv[:1] + tsv[31:]) + "\n", encoding="utf-8")
    ds = read_examples(tmp_path / "train.tsv")
    assert ds.task == "pair" and ds.examples[0].line == 2
    enc = encode(load_hf_tokenizer(tiny_export), ds.examples, [0] * len(ds), 64)
    ids, types = enc.ids[0], enc.type_ids[0]
    first_sep = ids.index(3)
    assert ids[0] == 2 and ids[-1] == 3 and types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    res = run(["--model", str(tiny_export), "--train", str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"),
               "--out", str(tmp_path / "ft"), "--epochs", "1", "--batch-size", "8", "--no-progress", "--threads", "1"])
    assert res["task"] == "pair" and res["labels"] == ["diff", "same"] and res["dev_examples"] == 10


def test_native_backend_for_a_model_hf_cannot_express(small_shards, sentiment, tmp_path):
    """Absolute positions (no HF RoFormer equivalent): our encoder with the same head, saved as
    classifier.pt, reloaded with the same predictions."""
    cfg = tiny_config(small_shards.vocab_size, position_embedding="absolute")
    torch.manual_seed(0)
    save_weights(tmp_path / "abs.pt", cfg, RoFormerForMaskedLM(cfg).state_dict())
    res = run(args(tmp_path / "abs.pt", sentiment, tmp_path / "ft", "--tokenizer", str(small_shards.dir),
                   "--lr", "1e-3"))
    assert res["backend"] == "native"
    assert {"classifier.pt", "tokenizer.json", "tokenizer.model"} <= {p.name for p in (tmp_path / "ft" / "best").iterdir()}
    assert native_accuracy(tmp_path / "ft" / "best", sentiment) == pytest.approx(res["best_dev_accuracy"])


def test_mean_pooling_reads_only_real_tokens():
    """The mean-pooled classifier gives an example the same logits alone and padded inside a batch
    (padding would shift a mean that counted it), and [CLS] pooling reads position 0 only."""
    from roformer_dist.finetune.models import NativeClassifier, pool

    torch.manual_seed(0)
    model = NativeClassifier(tiny_config(50), num_labels=3, pooling="mean").eval()
    short, long = torch.tensor([[2, 7, 8, 3]]), torch.tensor([[2, 9, 10, 11, 12, 13, 3]])
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, :4], batch[1] = short[0], long[0]
    mask = (batch != 0).long()
    with torch.no_grad():
        together = model(batch, mask, torch.zeros_like(batch))
        alone = model(short, torch.ones_like(short), torch.zeros_like(short))
        unmasked = model(batch, None, torch.zeros_like(batch))
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    assert (unmasked[0] - alone[0]).abs().max() > 1e-4  # the padding does change an unmasked mean
    h = torch.randn(2, 5, 4)
    m = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(pool(h, m, "mean")[0], h[0, :2].mean(0))
    torch.testing.assert_close(pool(h, m, "cls"), h[:, 0])


def test_mean_pooling_end_to_end_from_an_hf_export(tiny_export, sentiment, tmp_path):
    """--pooling mean on an HF export: our encoder starts from the export's weights (from scratch: not),
    the best model is classifier.pt with its pooling, reloaded with the same accuracy; results.json holds
    the last epoch beside the best one."""
    from roformer_dist.finetune.models import load_native_classifier

    start = transformers.AutoModelForMaskedLM.from_pretrained(tiny_export).roformer.embeddings.word_embeddings.weight
    for name, extra in (("pre", []), ("scratch", ["--from-scratch"])):
        # seed 1: the export itself was initialised from seed 0, as our encoder would be
        res = run(args(tiny_export, sentiment, tmp_path / name, "--pooling", "mean", "--lr", "1e-30", "--seed", "1",
                       *extra))
        assert (res["backend"], res["pooling"]) == ("native", "mean")
        model, _ = load_native_classifier(tmp_path / name / "best")
        assert model.pooling == "mean"
        diff = (model.encoder.embeddings.word_embeddings.weight - start).abs().max()
        assert (diff < 1e-6) if name == "pre" else (diff > 1e-3)

    res = run(args(tiny_export, sentiment, tmp_path / "ft", "--pooling", "mean", "--lr", "1e-3", "--epochs", "2"))
    assert (res["last_dev_accuracy"], res["last_dev_macro_f1"]) == (res["epochs"][-1]["dev_accuracy"],
                                                                    res["epochs"][-1]["dev_macro_f1"])
    assert native_accuracy(tmp_path / "ft" / "best", sentiment) == pytest.approx(res["best_dev_accuracy"])


def test_mean_pooling_needs_a_roformer(sentiment, tmp_path, capsys):
    transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(tmp_path / "bert")
    code = main(args(tmp_path / "bert", sentiment, tmp_path / "o", "--pooling", "mean"))
    err = capsys.readouterr().err
    assert code == EXIT_CHECKPOINT and "--pooling mean needs a RoFormer model" in err and "'bert'" in err, err


def test_ngram_baseline_is_multinomial_naive_bayes(sentiment, tmp_path, capsys):
    from data_pipeline.corpus import normalize
    from roformer_dist.finetune.ngram import NaiveBayes

    train = [json.loads(x) for x in (sentiment / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    dev = [json.loads(x) for x in (sentiment / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    nb = NaiveBayes().fit([(r["sentence"], None) for r in train], [r["label"] for r in train], 2)
    scores = nb.scores([(r["sentence"], None) for r in dev])

    def grams(t):
        t = normalize(t)
        return list(t) + [t[i:i + 2] for i in range(len(t) - 1)]

    counts = {c: Counter(g for r in train if r["label"] == c for g in grams(r["sentence"])) for c in (0, 1)}
    vocab = set(counts[0]) | set(counts[1])
    for r, s in zip(dev, scores):
        for c in (0, 1):
            want = math.log(sum(x["label"] == c for x in train) / len(train)) + sum(
                math.log((counts[c][g] + 1) / (sum(counts[c].values()) + len(vocab))) for g in grams(r["sentence"])
                if g in vocab)
            assert s[c] == pytest.approx(want, rel=1e-9)

    res = run(["--baseline", "ngram", "--train", str(sentiment / "train.jsonl"), "--dev", str(sentiment / "dev.jsonl"),
               "--out", str(tmp_path / "nb")])
    gold = [r["label"] for r in dev]
    assert res["best_dev_accuracy"] == pytest.approx(np.mean(scores.argmax(1) == gold))
    assert res["baseline"] == "ngram" and CONTRACT_KEYS <= set(res) and len(res["epochs"]) == 1
    assert LAST_LINE.match(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "nb" / "results.json").read_text()) == res
    assert not (tmp_path / "nb" / "best").exists()


BAD_INPUTS = [  # train, dev, message (file:line and what is wrong)
    ('{"sentence": "好"}\n', None, "train.jsonl:1: missing field 'label'"),
    ('{"sentence": "好", "label": 1}\n{"sentence": "好", "label": 1\n', None, "train.jsonl:2: invalid JSON"),
    ('{"text": "好", "label": 1}\n', None, "train.jsonl:1: expected a field 'sentence'"),
    ('{"sentence": 5, "label": 1}\n', None, "train.jsonl:1: field 'sentence' must be a string"),
    ('{"sentence": "好", "label": [1]}\n', None, "train.jsonl:1: field 'label' must be a string or an integer"),
    ('{"sentence": "好", "label": 1}\n{"sentence1": "a", "sentence2": "b", "label": 0}\n', None,
     "train.jsonl:2: a pair example in a file of single examples"),
    ("\n\n", None, "train.jsonl: no examples"),
    ('{"sentence": "好", "label": 1}\n', None, "at least two labels"),
    (None, '{"sentence": "好", "label": 1}\n{"sentence": "差", "label": 7}\n',
     "dev.jsonl:2: label 7 does not occur in"),
]


@pytest.mark.parametrize("train,dev,message", BAD_INPUTS)
def test_bad_input_names_file_and_line(sentiment, tmp_path, capsys, train, dev, message):
    for name, content in (("train.jsonl", train), ("dev.jsonl", dev)):
        (tmp_path / name).write_text(content if content is not None else (sentiment / name).read_text(),
                                     encoding="utf-8")
    code = main(["--baseline", "ngram", "--train", str(tmp_path / "train.jsonl"), "--dev",
                 str(tmp_path / "dev.jsonl"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == EXIT_DATA and message in err and "Traceback" not in err, err


def test_bad_tsv_and_flags(tiny_export, sentiment, tmp_path, capsys):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n好\t1\n差\n", encoding="utf-8")
    base = ["--train", str(tmp_path / "train.tsv"), "--dev", str(sentiment / "dev.jsonl"), "--out", str(tmp_path / "o")]
    assert main(["--baseline", "ngram", *base]) == EXIT_DATA
    assert "train.tsv:3: 1 tab-separated fields, the header has 2" in capsys.readouterr().err
    base = args(None, sentiment, tmp_path / "o")
    assert main(base) == EXIT_CONFIG and "--model is required" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope"), *base]) == EXIT_CHECKPOINT
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert main(["--model", str(tiny_export), *base, "--max-length", "4096"]) == EXIT_CONFIG
    assert "has 128 positions" in capsys.readouterr().err


def _two_ranks(rank, world_size, model, data, out):
    res = run(args(model, data, out))
    return res["best_dev_accuracy"], res["epochs"][0]["train_loss"]


@pytest.mark.slow
def test_under_torchrun_two_ranks_train_one_model(tiny_export, sentiment, tmp_path):
    """WORLD_SIZE 2 (as torchrun sets it): DDP over gloo, each rank half of the batches; both ranks end
    with the same metrics and rank 0 alone writes the outputs."""
    from roformer_dist.testing import run_distributed

    from roformer_dist.runtime.events import read_scalars

    results = run_distributed(_two_ranks, world_size=2, args=(tiny_export, sentiment, tmp_path / "ft"),
                              timeout=300)
    assert results[0] == results[1]
    res = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert (res["best_dev_accuracy"], res["epochs"][0]["train_loss"]) == results[0]
    assert len(read_scalars(tmp_path / "ft" / "tb")["train/loss"]) == 2  # 5 batches of 8: 2 per rank
    assert transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ft" / "best")
