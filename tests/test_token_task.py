"""roformer-finetune --task token: entity spans from BIO tags and their scores against seqeval and an
independent count, pieces labelled through offsets (boundaries inside a piece counted), the dictionary
baseline, People's Daily entities from the corpus's tags, the three input formats read alike, training
end to end on real sentences with a best model that AutoModelForTokenClassification reloads with the same
F1, and clear errors on bad input."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_pipeline.pd_ner import ner_sentences  # noqa: E402
from roformer_dist.cli.finetune import main  # noqa: E402
from roformer_dist.errors import EXIT_CONFIG, EXIT_DATA  # noqa: E402
from roformer_dist.finetune.dictionary import Dictionary  # noqa: E402
from roformer_dist.finetune.entities import (Span, entity_scores, label_pieces, spans_from_pieces,  # noqa: E402
                                             spans_from_tags)
from roformer_dist.finetune.run import run  # noqa: E402
from roformer_dist.finetune.token_data import read_token_examples  # noqa: E402

TYPES = ("PER", "LOC", "ORG")


def random_tags(rng: random.Random, n: int) -> list[str]:
    """BIO tags with every irregularity a model produces: I- after O, I- of another type, B-B runs."""
    return [rng.choice(["O", "O", "O"] + [f"{p}-{t}" for p in "BI" for t in TYPES]) for _ in range(n)]


def conlleval_counts(gold: list[list[str]], pred: list[list[str]]) -> tuple[int, int, int]:
    """(correct, gold, predicted) chunk counts, written as the CoNLL script walks tags: a chunk starts at B-X,
    at I-X after O or another type, and ends before a tag that does not continue it."""
    def chunks(tags):
        out, start, typ = set(), None, None
        for i, tag in enumerate(tags + ["O"]):
            p, t = (tag.split("-", 1) + [None])[:2] if tag != "O" else ("O", None)
            continues = p == "I" and t == typ
            if start is not None and not continues:
                out.add((start, i, typ))
                start, typ = None, None
            if p == "B" or (p == "I" and not continues):
                start, typ = i, t
        return out

    correct = n_gold = n_pred = 0
    for g, p in zip(gold, pred):
        cg, cp = chunks(g), chunks(p)
        correct, n_gold, n_pred = correct + len(cg & cp), n_gold + len(cg), n_pred + len(cp)
    return correct, n_gold, n_pred


def test_entity_scores_match_seqeval_and_an_independent_count():
    rng = random.Random(7)
    gold = [random_tags(rng, rng.randint(1, 30)) for _ in range(300)]
    pred = [[t if rng.random() < 0.7 else rng.choice(["O", "B-PER", "I-PER", "B-LOC", "I-ORG"]) for t in g]
            for g in gold]
    s = entity_scores([spans_from_tags(g) for g in gold], [spans_from_tags(p) for p in pred])
    correct, n_gold, n_pred = conlleval_counts(gold, pred)
    assert (s["correct"], s["gold"], s["predicted"]) == (correct, n_gold, n_pred)
    assert s["precision"] == pytest.approx(correct / n_pred) and s["recall"] == pytest.approx(correct / n_gold)
    seqeval = pytest.importorskip("seqeval.metrics")
    assert s["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    assert s["precision"] == pytest.approx(seqeval.precision_score(gold, pred))
    assert s["recall"] == pytest.approx(seqeval.recall_score(gold, pred))
    report = seqeval.classification_report(gold, pred, output_dict=True)
    for t in TYPES:
        assert s["per_label"][t]["f1"] == pytest.approx(report[t]["f1-score"])
        assert s["per_label"][t]["gold"] == report[t]["support"]


def test_scores_of_edge_cases():
    empty = entity_scores([[]], [[]])
    assert (empty["f1"], empty["precision"], empty["recall"]) == (0.0, 0.0, 0.0)
    one = entity_scores([[Span(0, 2, "PER")]], [[Span(0, 2, "PER"), Span(0, 2, "PER"), Span(3, 4, "LOC")]])
    assert (one["correct"], one["predicted"], one["recall"]) == (1, 2, 1.0)  # a duplicate counts once
    wrong_type = entity_scores([[Span(0, 2, "PER")]], [[Span(0, 2, "LOC")]])
    assert wrong_type["f1"] == 0.0 and wrong_type["per_label"]["LOC"]["predicted"] == 1
    with pytest.raises(ValueError, match="tag 'X-PER' is not BIO"):
        spans_from_tags(["X-PER"])


def test_pieces_that_straddle_a_boundary_are_counted_and_decoded_to_their_own_span():
    text = "AB北京CD"
    gold = [Span(2, 4, "LOC")]
    # piece 0 = "AB北", piece 1 = "京CD": both hold characters inside and outside the entity
    al = label_pieces(text, gold, [(0, 0), (0, 3), (3, 6), (0, 0)])
    assert al.tags == [None, "B-LOC", "I-LOC", None]
    assert (al.crossing_pieces, al.unreachable) == (2, 1)
    assert spans_from_pieces(al.tags, al.bounds) == [Span(0, 6, "LOC")] != gold  # scored as a miss, not hidden
    aligned = label_pieces(text, gold, [(0, 2), (2, 4), (4, 6)])
    assert aligned.tags == ["O", "B-LOC", "O"] and (aligned.crossing_pieces, aligned.unreachable) == (0, 0)
    assert spans_from_pieces(aligned.tags, aligned.bounds) == gold
    cut = label_pieces(text, gold, [(0, 2)])  # truncated before the entity: missed, but not "unreachable"
    assert cut.tags == ["O"] and (cut.crossing_pieces, cut.unreachable) == (0, 0)


def test_alignment_through_the_real_tokenizer(small_shards):
    """Our SentencePiece pieces through the HF fast tokenizer's offsets: a two-character piece holding one
    entity character straddles its boundary; the word-start marker before a Latin word covers no character."""
    from roformer_dist.hf.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(small_shards.tokenizer, 128)
    text = "江泽民在北京会见 Bill Clinton"
    enc = tok(text, return_offsets_mapping=True)
    pieces = [text[s:e] for s, e in enc["offset_mapping"]]
    whole = [i for i, p in enumerate(pieces) if len(p) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in p)]
    assert whole, f"no multi-character Chinese piece in {pieces}"
    i = whole[0]
    s, e = enc["offset_mapping"][i]
    half = [Span(s, s + 1, "LOC")]  # the entity ends inside piece i
    al = label_pieces(text, half, enc["offset_mapping"])
    assert al.crossing_pieces == 1 and al.unreachable == 1 and al.tags[i] == "B-LOC"
    full = [Span(s, e, "LOC"), Span(text.index("Bill"), len(text), "PER")]
    al = label_pieces(text, full, enc["offset_mapping"])
    assert (al.crossing_pieces, al.unreachable) == (0, 0)
    assert spans_from_pieces(al.tags, al.bounds) == full
    assert al.tags[0] is None and al.tags[-1] is None  # [CLS], [SEP]


def test_dictionary_matches_the_longest_entity_with_its_most_frequent_type():
    train = [("北京大学在北京", [Span(0, 4, "ORG"), Span(5, 7, "LOC")]),
             ("北京很大", [Span(0, 2, "LOC")]), ("北京队", [Span(0, 2, "ORG")])]
    d = Dictionary().fit(train)
    assert len(d) == 2 and d.types == {"北京大学": "ORG", "北京": "LOC"}
    assert d.tag("我在北京大学和北京") == [Span(2, 6, "ORG"), Span(7, 9, "LOC")]
    assert d.tag("") == [] and d.tag("上海") == []


def test_peoples_daily_entities_from_the_tags():
    line = "中共中央/nt  总书记/n  、/w  国家/n  主席/n  江/nr  泽民/nr  ，/w  [香港/ns  特区/n]ns  。/w  李鹏/nr  王/nr  说/v"
    (a, sa), (b, sb) = ner_sentences(line)
    assert a == "中共中央总书记、国家主席江泽民,香港特区。" and b == "李鹏王说"  # normalised: ， -> ,
    assert [(a[s:e], t) for s, e, t in sa] == [("中共中央", "ORG"), ("江泽民", "PER"), ("香港", "LOC")]
    assert [(b[s:e], t) for s, e, t in sb] == [("李鹏王", "PER")]  # consecutive nr: one person


def as_tokens(text: str, spans) -> list[tuple[int, int]]:
    """Token boundaries a CoNLL file would have: each CJK character alone, a run of other characters (digits,
    Latin, ASCII punctuation) as one token, never across an entity boundary."""
    from roformer_dist.finetune.token_data import join_tokens

    cuts = {0, len(text)} | {x for s, e, _ in spans for x in (s, e)}
    bounds, start = [], 0
    for i in range(1, len(text) + 1):
        if i in cuts or ord(text[i - 1]) >= 0x2E80 or (i < len(text) and ord(text[i]) >= 0x2E80):
            bounds.append((start, i))
            start = i
    assert join_tokens([text[s:e] for s, e in bounds])[0] == text, "two spaced tokens side by side"
    return bounds


def write_formats(d: Path, sentences) -> dict:
    """The same sentences as jsonl spans, jsonl tokens/tags and CoNLL columns."""
    spans_rows, token_rows, conll = [], [], []
    for text, spans in sentences:
        spans_rows.append({"text": text, "entities": [{"start": s, "end": e, "label": t} for s, e, t in spans]})
        bounds = as_tokens(text, spans)
        tags = ["O"] * len(bounds)
        for s, e, t in spans:
            inside = [k for k, (a, b) in enumerate(bounds) if s <= a and b <= e]
            tags[inside[0]] = f"B-{t}"
            for k in inside[1:]:
                tags[k] = f"I-{t}"
        tokens = [text[a:b] for a, b in bounds]
        token_rows.append({"tokens": tokens, "tags": tags})
        conll += [f"{tok} X {t}" for tok, t in zip(tokens, tags)] + [""]
    paths = {"spans": d / "spans.jsonl", "tokens": d / "tokens.jsonl", "conll": d / "data.conll"}
    paths["spans"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in spans_rows), "utf-8")
    paths["tokens"].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in token_rows), "utf-8")
    paths["conll"].write_text("-DOCSTART- -X- O\n\n" + "\n".join(conll) + "\n", "utf-8")
    return paths


@pytest.fixture(scope="module")
def ner(small_shards, tmp_path_factory):
    """People's Daily NER from the small shard set's own lines (train) and held-out lines (dev)."""
    d = tmp_path_factory.mktemp("ner")
    train = [s for line in Path(small_shards.source).read_text("utf-8").splitlines() for s in ner_sentences(line)]
    dev = [s for line in Path(small_shards.eval_source).read_text("utf-8").splitlines() for s in ner_sentences(line)]
    rng = random.Random(0)
    for name, rows in (("train", rng.sample(train, 240)), ("dev", rng.sample(dev, 80))):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"text": t, "entities": [
            {"start": s, "end": e, "label": lab} for s, e, lab in spans]}, ensure_ascii=False) + "\n"
            for t, spans in rows), "utf-8")
    return d


def test_three_formats_read_alike(ner, tmp_path):
    rows = [json.loads(x) for x in (ner / "dev.jsonl").read_text("utf-8").splitlines()]
    sentences = [(r["text"], [(e["start"], e["end"], e["label"]) for e in r["entities"]]) for r in rows]
    sentences = [(t, sp) for t, sp in sentences if not re.search(r"[ -\u2e7f] [ -\u2e7f]", t)][:30]
    read = {k: read_token_examples(p) for k, p in write_formats(tmp_path, sentences).items()}
    want = [(t, [Span(*s) for s in spans]) for t, spans in sentences]
    for kind, ds in read.items():
        assert [(e.text, e.spans) for e in ds.examples] == want, kind
    assert read["conll"].examples[1].line == 4 + len(as_tokens(*sentences[0]))  # a sentence's first line


def test_tokens_are_joined_with_spaces_only_between_words_of_spaced_scripts(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text(json.dumps({"tokens": ["Bill", "Clinton", "访问", "北京", "and", "1998", "年"],
                             "tags": ["B-PER", "I-PER", "O", "B-LOC", "O", "O", "O"]}) + "\n", "utf-8")
    (ex,) = read_token_examples(p).examples
    assert ex.text == "Bill Clinton访问北京and 1998年"
    assert [ex.text[s.start:s.end] for s in ex.spans] == ["Bill Clinton", "北京"]


def tiny_export(small_shards, out: Path) -> Path:
    from roformer_dist.config import ModelConfig
    from roformer_dist.hf.export import ExportSource, export_hf_repository
    from roformer_dist.nn.model import RoFormerForMaskedLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=small_shards.vocab_size, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=96, max_position_embeddings=128, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    export_hf_repository(RoFormerForMaskedLM(cfg), out, source=ExportSource("test"),
                         tokenizer=Path(small_shards.tokenizer), check_docs=0, say=lambda *_: None)
    return out


def ner_args(model, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--task", "token", *(["--model", str(model)] if model else []), "--train", str(data / "train.jsonl"),
            "--dev", str(data / "dev.jsonl"), "--out", str(out), "--epochs", "4", "--lr", "3e-3", "--batch-size", "16",
            "--max-length", "64", "--no-progress", "--threads", "2", *extra]


def reloaded_f1(best: Path, data: Path, max_length: int = 64) -> float:
    """Entity F1 of the saved model, reloaded with AutoModelForTokenClassification and AutoTokenizer, one
    sentence at a time; tags decoded with seqeval-style chunks over the pieces that cover characters."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(best).eval()
    tok = AutoTokenizer.from_pretrained(best)
    rows = [json.loads(x) for x in (data / "dev.jsonl").read_text("utf-8").splitlines()]
    correct = n_gold = n_pred = 0
    for r in rows:
        enc = tok(r["text"], truncation=True, max_length=max_length, return_offsets_mapping=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")[0].tolist()
        with torch.no_grad():
            ids = model(**enc).logits[0].argmax(-1).tolist()
        kept = [(model.config.id2label[i], (s, e)) for i, (s, e) in zip(ids, offsets) if r["text"][s:e].strip()]
        pred, open_ = set(), None
        for tag, (s, e) in kept + [("O", (0, 0))]:
            p, _, t = tag.partition("-")
            if open_ and p == "I" and t == open_[2]:
                open_ = (open_[0], e, t)
                continue
            if open_:
                pred.add(open_)
            open_ = (s, e, t) if p in "BI" and p else None
        gold = {(e["start"], e["end"], e["label"]) for e in r["entities"]}
        correct, n_gold, n_pred = correct + len(gold & pred), n_gold + len(gold), n_pred + len(pred)
    p, rc = correct / max(1, n_pred), correct / max(1, n_gold)
    return 2 * p * rc / (p + rc) if p + rc else 0.0


def test_token_task_end_to_end_with_hf_reload(small_shards, ner, tmp_path, capsys):
    hf = tiny_export(small_shards, tmp_path / "hf")
    out = tmp_path / "ft"
    assert main(ner_args(hf, ner, out)) == 0
    stdout = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["task"] == "token" and res["labels"] == ["O", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-PER", "I-PER"]
    assert res["backend"] == "transformers" and len(res["epochs"]) == 4
    assert res["best_dev_f1"] > 0.05, stdout  # it learned something in 4 epochs
    assert set(res["best_dev_per_label"]) <= {"LOC", "ORG", "PER"}
    assert f"dev entity F1 {res['best_dev_f1']:.4f}" in stdout.splitlines()[-4]
    assert reloaded_f1(out / "best", ner) == pytest.approx(res["best_dev_f1"], abs=1e-9)
    from roformer_dist.runtime.events import read_scalars

    tags = read_scalars(out / "tb")
    assert len(tags["dev/f1"]) == 4 and "dev/precision" in tags and "train/loss" in tags


def test_dict_baseline_and_from_scratch(small_shards, ner, tmp_path, capsys):
    res = run(ner_args(None, ner, tmp_path / "dict", "--baseline", "dict"))
    rows = {k: [json.loads(x) for x in (ner / f"{k}.jsonl").read_text("utf-8").splitlines()] for k in ("train", "dev")}
    strings = {}
    for r in rows["train"]:
        for e in r["entities"]:
            strings.setdefault(r["text"][e["start"]:e["end"]], []).append(e["label"])
    assert res["dictionary_entries"] == len(strings) and res["baseline"] == "dict"
    n_gold = sum(len(r["entities"]) for r in rows["dev"])
    assert res["best_dev_per_label"] and sum(v["gold"] for v in res["best_dev_per_label"].values()) == n_gold
    # every gold dev entity whose string is in the dictionary under its type, alone in the sentence, is found
    assert res["best_dev_recall"] > 0 and res["best_dev_precision"] > 0
    hf = tiny_export(small_shards, tmp_path / "hf")
    scratch = run(ner_args(hf, ner, tmp_path / "scratch", "--from-scratch", "--epochs", "1"))
    assert scratch["from_scratch"] is True and len(scratch["epochs"]) == 1


def test_native_token_classifier_reloads(small_shards, ner, tmp_path):
    """A model HF cannot express (absolute positions) trains as our encoder with the token head."""
    from roformer_dist.checkpoint.weights import save_weights
    from roformer_dist.config import ModelConfig
    from roformer_dist.finetune.models import load_native_classifier
    from roformer_dist.nn.model import RoFormerForMaskedLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=small_shards.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128, position_embedding="absolute")
    weights = tmp_path / "w.pt"
    save_weights(weights, cfg, RoFormerForMaskedLM(cfg).state_dict())
    res = run(ner_args(weights, ner, tmp_path / "ft", "--tokenizer", str(small_shards.tokenizer), "--epochs", "1"))
    assert res["backend"] == "native"
    model, tok = load_native_classifier(tmp_path / "ft" / "best")
    enc = tok("江泽民在北京", return_tensors="pt")
    logits = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert logits.shape == (1, enc["input_ids"].shape[1], 7) and model.head == "token"


BAD = [
    ('{"tokens": ["a", "b"], "tags": ["O"]}', "train.jsonl:1: 2 tokens but 1 tags"),
    ('{"tokens": ["a"], "tags": ["S-PER"]}', "train.jsonl:1: token 1 ('a'): tag 'S-PER' is not BIO"),
    ('\n{"text": "abc", "entities": [{"start": 0, "end": 2, "label": "X"}, {"start": 1, "end": 3, "label": "Y"}]}',
     "train.jsonl:2: entities 'ab' (0-2) and 'bc' (1-3) overlap"),
    ('{"text": "abc", "entities": [{"start": 2, "end": 9, "label": "X"}]}',
     "train.jsonl:1: entities[0]: start 2 and end 9 must be integers with 0 <= start < end <= 3"),
    ('{"text": "abc", "entities": [{"start": 0, "end": 1}]}', "train.jsonl:1: entities[0]: expected an object"),
    ('{"sentence": "abc", "label": 1}', "train.jsonl:1: expected fields 'tokens' and 'tags', or 'text' and"),
    ('{"text": "abc", "entities": []}', "train.jsonl: no entities in 1 sentences"),
    ('{"text": "abc"', "train.jsonl:1: invalid JSON"),
]


@pytest.mark.parametrize("train,message", BAD)
def test_bad_input_names_file_and_line(ner, tmp_path, capsys, train, message):
    (tmp_path / "train.jsonl").write_text(train + "\n", "utf-8")
    (tmp_path / "dev.jsonl").write_text((ner / "dev.jsonl").read_text("utf-8"), "utf-8")
    code = main(ner_args(None, tmp_path, tmp_path / "out", "--baseline", "dict"))
    err = capsys.readouterr().err
    assert code == EXIT_DATA and message in err and "Traceback" not in err, err


def test_bad_conll_dev_types_and_flags(ner, tmp_path, capsys):
    (tmp_path / "train.conll").write_text("北 B-LOC\n京 I-LOC\n\n上海\n", "utf-8")
    (tmp_path / "dev.conll").write_text("北 B-LOC\n", "utf-8")
    base = ["--task", "token", "--baseline", "dict", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main([*base, "--train", str(tmp_path / "train.conll"), "--dev", str(tmp_path / "dev.conll")]) == EXIT_DATA
    assert "train.conll:4: expected a token and its tag" in capsys.readouterr().err
    (tmp_path / "train.conll").write_text("北 B-LOC\n京 I-LOC\n", "utf-8")
    (tmp_path / "dev.conll").write_text("a O\n\n张 B-PER\n\n北 B-LOC\n京 I-LOC\n", "utf-8")
    assert main([*base, "--train", str(tmp_path / "train.conll"), "--dev", str(tmp_path / "dev.conll")]) == 0
    out = capsys.readouterr().out
    assert "dev.conll:3: entity type 'PER' does not occur in" in out and "1 dev entities are scored as missed" in out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert (res["best_dev_recall"], res["best_dev_precision"]) == (0.5, 1.0)  # the PER entity: missed
    files = ["--train", str(ner / "train.jsonl"), "--dev", str(ner / "dev.jsonl"), "--out", str(tmp_path / "o")]
    assert main(["--task", "token", "--baseline", "ngram", *files]) == EXIT_CONFIG
    assert "--baseline ngram does not apply to --task token (its baseline: dict)" in capsys.readouterr().err
    assert main(["--baseline", "dict", *files]) == EXIT_CONFIG
    assert main(["--task", "token", "--model", "x", "--pooling", "mean", *files]) == EXIT_CONFIG
    assert "--pooling applies to sentence tasks" in capsys.readouterr().err
