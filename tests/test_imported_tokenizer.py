"""Shards made with an imported tokenizer (a BERT-style WordPiece vocab.txt, an HF tokenizer.json) with its
own special ids, on real text (People's Daily 1998): the manifest, the word marks, the loader's framing,
padding and masking, the model config taken from the manifest, the HF export, and the errors."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline import cli
from data_pipeline.corpus import normalize, read_documents
from data_pipeline.errors import EXIT_USAGE, DataError
from data_pipeline.imported import ImportedTokenizer, manifest_kind
from data_pipeline.loader import ShardLoader
from data_pipeline.manifest import check_same_tokenizer, check_tokenizer, parse_manifest, read_manifest
from data_pipeline.shards import load_shard, verify_shard_set
from data_pipeline.tokenizer import sha256_file

BERT_IDS = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
ROOT = Path(__file__).resolve().parent.parent


def bert_vocab(texts, path: Path, front=("[PAD]",), min_count: int = 2) -> Path:
    """A vocab.txt laid out as Google's Chinese BERT: ``front`` then [unused1..99] up to id 99, [UNK] [CLS]
    [SEP] [MASK] at 100..103, then the corpus's characters seen ``min_count`` times, and ##0 .. ##9."""
    chars = collections.Counter(c for t in texts for c in t.lower() if not c.isspace())
    head = list(front) + [f"[unused{i}]" for i in range(len(front), 100)]
    vocab = head + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [c for c, n in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_count]
    vocab += [f"##{d}" for d in "0123456789"]
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return path


def _prepare(source, tokenizer, out, *extra) -> int:
    return cli.main(["prepare", "--input", str(source), "--tokenizer", str(tokenizer), "--out", str(out),
                     "--workers", "1", "--no-progress", "--max-docs-per-shard", "400", *extra])


@pytest.fixture(scope="module")
def texts(small_shards) -> list[str]:
    return [d.text for d in read_documents(small_shards.source)]


@pytest.fixture(scope="module")
def wordpiece(small_shards, texts, tmp_path_factory):
    """(vocab.txt, shard set) made by ``roformer-data prepare --tokenizer vocab.txt``."""
    root = tmp_path_factory.mktemp("wordpiece")
    vocab = bert_vocab(texts, root / "vocab.txt")
    assert _prepare(small_shards.source, vocab, root / "set") == 0
    return vocab, root / "set"


def _documents(shard_dir):
    """Every document of a set: (token ids, word marks) in shard order."""
    m = read_manifest(shard_dir)
    out = []
    for i in range(len(m["shards"])):
        sd = load_shard(shard_dir, m, i)
        for k, (s, n) in enumerate(zip(sd.tok_start, sd.lengths)):
            w = sd.wwm_start[k]
            out.append((sd.tokens[s:s + n].astype(np.int64), sd.marks[w:w + n]))
    return out


def test_the_manifest_records_the_imported_tokenizer_and_bert_ids(wordpiece):
    vocab, d = wordpiece
    m = read_manifest(d)
    assert m["tokenizer"] == {"path": "vocab.txt", "sha256": sha256_file(vocab), "kind": "wordpiece-vocab"}
    assert manifest_kind(m) == "wordpiece-vocab"
    assert m["special_ids"] == BERT_IDS
    assert m["vocab_size"] == len(vocab.read_text(encoding="utf-8").splitlines()) and m["dtype"] == "uint16"
    assert (d / "vocab.txt").read_bytes() == vocab.read_bytes()
    assert verify_shard_set(d) == []
    check_tokenizer(d, m, tokenizer=vocab)


def test_shards_hold_bert_tokenizer_ids_of_the_normalised_documents(wordpiece, texts):
    """The vocab.txt conventions are transformers.BertTokenizer's (lowercase, CJK split, accents stripped),
    documents encoded without [CLS]/[SEP]."""
    transformers = pytest.importorskip("transformers")
    vocab, d = wordpiece
    bert = transformers.BertTokenizer.from_pretrained(str(vocab.parent))
    docs = _documents(d)
    assert len(docs) == len(texts)
    for text, (ids, _) in zip(texts[:300], docs):
        assert ids.tolist() == bert(text, add_special_tokens=False)["input_ids"]
    mixed = "Héllo WORLD，中国1998年"
    assert ImportedTokenizer(vocab, "wordpiece-vocab").encode(mixed).tolist() == \
        bert(mixed, add_special_tokens=False)["input_ids"]


def test_word_marks_follow_gold_words_and_never_start_at_a_continuation(wordpiece, small_shards):
    vocab, d = wordpiece
    tok = ImportedTokenizer(vocab, "wordpiece-vocab")
    cont = np.array([tok.id_to_piece(i).startswith("##") for i in range(tok.vocab_size)])
    docs = _documents(d)
    gold = [doc.words for doc in read_documents(small_shards.source)]
    marks_seen = 0
    for (ids, marks), words in zip(docs, gold):
        assert marks[0] == 1 and not (marks.astype(bool) & cont[ids]).any()
        offsets = tok.tok.encode("".join(words), add_special_tokens=False).offsets
        starts = set(np.cumsum([0] + [len(w) for w in words[:-1]]).tolist())
        want = [1] + [int(s in starts) for s, _ in offsets[1:]]
        assert marks.tolist() == want
        marks_seen += int(marks.sum())
    total = sum(len(ids) for ids, _ in docs)
    assert 0.3 * total < marks_seen < 0.9 * total     # words of several characters are masked whole


def test_loader_frames_pads_and_masks_with_the_manifest_ids(wordpiece):
    _, d = wordpiece
    m = read_manifest(d)
    special = np.array(sorted(BERT_IDS.values()))
    ld = ShardLoader(d, seq_len=64, micro_batch_size=8, num_workers=0, seed=1, max_epochs=1,
                     whole_word_mask=True, mlm_probability=0.3)
    labelled = masked = padded = 0
    for b in ld:
        ids, labels, att = b["input_ids"].numpy(), b["labels"].numpy(), b["attention_mask"].numpy()
        original = np.where(labels != -100, labels, ids)
        assert (original[:, 0] == 101).all()
        for row, a in zip(original, att):
            n = int((a != 0).sum())
            assert row[n - 1] == 102 and (row[n:] == 0).all()
            padded += len(row) - n
        chosen = labels != -100
        assert not np.isin(labels[chosen], special).any()          # specials are never predicted
        assert not np.isin(ids[chosen & (ids != 103)], special).any()  # nor drawn as random replacements
        assert (ids[~chosen] == original[~chosen]).all()
        assert (labels[att == 0] == -100).all()
        labelled += int(chosen.sum())
        masked += int((ids == 103).sum())
    assert padded > 0 and masked > 0.6 * labelled > 0
    assert ld.state_dict()["stats"]["tokens"] >= m["num_tokens"]


@pytest.fixture(scope="module")
def json_set(small_shards, texts, tmp_path_factory):
    """A tokenizer.json (an HF repository directory holding it) whose [PAD] is not 0, and its shard set."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("tokjson")
    vocab = bert_vocab(texts, root / "vocab.txt", front=("[unused0]", "[PAD]"))
    (root / "repo").mkdir()
    tok = ImportedTokenizer(vocab, "wordpiece-vocab").tok
    data = json.loads(tok.to_str())
    data["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    Tokenizer.from_str(json.dumps(data)).save(str(root / "repo" / "tokenizer.json"))
    assert _prepare(small_shards.source, root / "repo", root / "set") == 0
    return root / "repo" / "tokenizer.json", root / "set"


def test_a_tokenizer_json_with_its_own_pad_id(json_set, wordpiece):
    tok_json, d = json_set
    m = read_manifest(d)
    assert m["tokenizer"]["kind"] == "tokenizer-json" and m["tokenizer"]["path"] == "tokenizer.json"
    assert m["special_ids"] == {**BERT_IDS, "pad": 1}
    assert (d / "tokenizer.json").read_bytes() == tok_json.read_bytes()
    assert verify_shard_set(d) == []
    lengths = [len(ids) for ids, _ in _documents(d)]
    assert max(lengths) > 16                                        # its truncation setting is not applied
    pads = []
    for b in ShardLoader(d, seq_len=512, micro_batch_size=8, num_workers=0, seed=0, max_epochs=1):
        pads.append(b["input_ids"].numpy()[b["attention_mask"].numpy() == 0])
        assert b["input_ids"].numpy()[:, 0].tolist() == [101] * len(b["input_ids"])
    pads = np.concatenate(pads)
    assert len(pads) and (pads == 1).all()                          # padded with its [PAD], id 1
    # two sets of different tokenizers are never mixed
    with pytest.raises(DataError, match="field 'tokenizer.sha256'.*made with another tokenizer"):
        check_same_tokenizer(m, read_manifest(wordpiece[1]), "source 'b'", "source 'a''s")


def test_the_model_takes_vocab_size_and_pad_id_from_the_manifest(json_set):
    from roformer_dist.config import load_config
    from roformer_dist.errors import ConfigError
    from roformer_dist.plan.data import resolve_data

    _, d = json_set
    debug = ROOT / "configs" / "experiments" / "debug.yaml"
    cfg, _ = resolve_data(load_config(debug, [f"data.shards={d}", "data.eval_shards="]))
    assert cfg.model.pad_token_id == 1 and cfg.model.vocab_size == read_manifest(d)["vocab_size"]
    with pytest.raises(ConfigError, match=r"model.pad_token_id: 7 differs from the \[PAD\] id 1 of the shards "
                                          r"\(data.shards: .*manifest.json: field 'special_ids.pad'\)"):
        resolve_data(load_config(debug, [f"data.shards={d}", "data.eval_shards=", "model.pad_token_id=7"]))


def test_a_bad_tokenizer_file_is_a_usage_error_naming_it(small_shards, texts, tmp_path, capsys):
    good = bert_vocab(texts[:50], tmp_path / "good.txt", min_count=1).read_text(encoding="utf-8")
    no_mask = tmp_path / "no_mask" / "vocab.txt"
    no_mask.parent.mkdir()
    no_mask.write_text(good.replace("[MASK]\n", "[unused100]\n"), encoding="utf-8")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0", "model": ', encoding="utf-8")
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes(good.encode("utf-8") + b"\xff\xfe\n")
    (tmp_path / "empty_repo").mkdir()
    cases = [(no_mask, f"tokenizer {no_mask}: no [MASK] token in the vocabulary"),
             (no_mask.parent, f"tokenizer {no_mask}: no [MASK] token"),
             (broken, f"tokenizer {broken}: not valid JSON"),
             (not_utf8, f"tokenizer {not_utf8}: not UTF-8 text"),
             (tmp_path / "empty_repo", "holds no tokenizer.json, vocab.txt or tokenizer.model"),
             (tmp_path / "tok.bin", "expected a SentencePiece .model, an HF tokenizer.json, a WordPiece vocab.txt")]
    for path, message in cases:
        out = tmp_path / "out"
        assert _prepare(small_shards.source, path, out) == EXIT_USAGE, path
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert not out.exists()
    assert _prepare(small_shards.source, tmp_path / "good.txt", tmp_path / "out", "--vocab-size", "100") == EXIT_USAGE
    assert "--vocab-size 100 with --tokenizer" in capsys.readouterr().err


def test_an_old_manifest_still_reads_as_sentencepiece(small_shards):
    m = read_manifest(small_shards.dir)
    assert "kind" not in m["tokenizer"] and manifest_kind(m) == "sentencepiece"
    assert m["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    check_tokenizer(small_shards.dir, m)
    raw = json.loads((small_shards.dir / "manifest.json").read_text())
    raw["tokenizer"]["kind"] = "bpe-merges"
    with pytest.raises(DataError, match=r"x/manifest.json: field 'tokenizer.kind': expected 'sentencepiece' or "
                                        r"'tokenizer-json' or 'wordpiece-vocab', got 'bpe-merges'"):
        parse_manifest(json.dumps(raw), "x/manifest.json")


def test_export_writes_the_imported_tokenizer_with_its_ids(wordpiece, peoples_daily, reviews, tmp_path, capsys):
    """The HF repository of a model on WordPiece shards: AutoTokenizer gives the shards' ids on real text."""
    transformers = pytest.importorskip("transformers")
    from roformer_dist.config import ModelConfig
    from roformer_dist.hf.export import ExportSource, export_hf_repository
    from roformer_dist.hf.tokenizer import agreement
    from roformer_dist.nn.model import RoFormerForMaskedLM

    vocab, d = wordpiece
    m = read_manifest(d)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=m["vocab_size"], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64)
    out = tmp_path / "hf"
    said = []
    res = export_hf_repository(RoFormerForMaskedLM(cfg), out, source=ExportSource("test", shard_dir=d, manifest=m),
                               tokenizer=d / "vocab.txt", check_docs=400, say=said.append)
    assert {"vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(res.files)
    assert "tokenizer.model" not in res.files and not res.jieba
    assert (out / "vocab.txt").read_bytes() == vocab.read_bytes()
    info = json.loads((out / "roformer_export.json").read_text())["tokenizer"]
    assert info["kind"] == "wordpiece-vocab" and info["special_ids"] == BERT_IDS
    assert res.agreement.num_docs == 400 and res.agreement.rate == 1.0, res.agreement.examples
    assert any("400/400 documents give identical ids" in s for s in said)

    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id) == \
        (0, 100, 101, 102, 103)
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0
    # the training documents against the ids in the shards
    pd = [doc.text for doc in read_documents(peoples_daily)]
    for text, (ids, _) in zip(pd[:300], _documents(d)):
        assert hf(text)["input_ids"] == [101, *ids.tolist(), 102]
    # other documents, and raw reviews (full-width punctuation: the pipeline's NFKC comes first)
    tok = ImportedTokenizer(d / "vocab.txt", "wordpiece-vocab")
    on_pd = agreement(hf, pd[6000:6500], tok)
    on_reviews = agreement(hf, reviews[0].read_text(encoding="utf-8").splitlines()[:500], tok)
    print(f"agreement: People's Daily {on_pd.summary()}; reviews {on_reviews.summary()}")
    assert on_pd.rate == 1.0 and on_reviews.rate == 1.0, (on_pd.examples, on_reviews.examples)
    assert hf("ＡＢＣ，")["input_ids"] == [101, *tok.encode(normalize("ＡＢＣ，")).tolist(), 102]


def test_prepare_over_local_tasks_gives_the_single_process_set(wordpiece, small_shards, tmp_path, capsys):
    from launcher import prepare

    vocab, single = wordpiece
    out = tmp_path / "set"
    assert prepare.main(["prepare", "--input", str(small_shards.source), "--tokenizer", str(vocab), "--out",
                         str(out), "--max-docs-per-shard", "400", "--cluster", "local", "--tasks", "2"]) == 0
    assert "2 task(s)" in capsys.readouterr().out
    m, ref = read_manifest(out), read_manifest(single)
    assert m["tokenizer"] == ref["tokenizer"] and m["special_ids"] == BERT_IDS and verify_shard_set(out) == []
    assert [(a.tolist(), b.tolist()) for a, b in _documents(out)] == \
        [(a.tolist(), b.tolist()) for a, b in _documents(single)]


@pytest.mark.slow
def test_continuing_a_roformer_repository_on_its_own_vocabulary(wordpiece, small_shards, tmp_path):
    """The whole path of an existing model: an HF RoFormer repository with its vocab.txt -> shards with that
    vocabulary -> roformer-train warm-started from the repository -> to-hf -> AutoTokenizer: the shards'
    ids, and an HF model that loads the trained weights."""
    import shutil
    import types

    transformers = pytest.importorskip("transformers")
    from roformer_dist.cli.convert import main as convert
    from trainer_runs import make_cfg, records, train

    vocab, d = wordpiece
    repo = tmp_path / "repo"
    hf_cfg = transformers.RoFormerConfig(vocab_size=read_manifest(d)["vocab_size"], embedding_size=64, hidden_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                         max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(0)
    transformers.RoFormerForMaskedLM(hf_cfg).save_pretrained(str(repo))
    shutil.copy(vocab, repo / "vocab.txt")
    shards = tmp_path / "shards"
    assert _prepare(small_shards.source, repo, shards) == 0  # the repository's directory: its vocab.txt
    assert read_manifest(shards)["special_ids"] == BERT_IDS
    run = tmp_path / "run"
    cfg = make_cfg(types.SimpleNamespace(dir=shards, eval_dir=shards), run, f"init.from={repo}",
                   "trainer.stop_at_step=2", world_size=1)
    assert train(cfg) == [0]
    assert [r["step"] for r in records(run)] == [1, 2]
    assert json.loads((run / "parent.json").read_text())["kind"] == "hf-roformer"
    out = tmp_path / "hf"
    assert convert(["to-hf", "--checkpoint", str(run), "--out", str(out), "--check-docs", "100"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (0, 101, 102, 103)
    for text, (ids, _) in list(zip([doc.text for doc in read_documents(small_shards.source)], _documents(shards)))[:200]:
        assert tok(text)["input_ids"] == [101, *ids.tolist(), 102]
    model = transformers.RoFormerForMaskedLM.from_pretrained(str(out))
    assert model.config.vocab_size == hf_cfg.vocab_size and model.config.pad_token_id == 0
    card = (out / "README.md").read_text()
    assert f"initialised from: hf-roformer `{repo}`" in card and "WordPiece `vocab.txt`" in card
    assert "`[CLS]`=101" in card and "rotary (RoPE), base 10000" in card
    assert json.loads((out / "roformer_export.json").read_text())["parent"]["kind"] == "hf-roformer"
    # fine-tuning straight from the run (not the export) takes the shards' vocabulary too
    from roformer_dist.finetune.run import run as finetune

    docs = [doc.text[:40] for doc in read_documents(small_shards.source, limit=24)]
    rows = [{"sentence": text, "label": i % 2} for i, text in enumerate(docs)]
    data = tmp_path / "cls"
    data.mkdir()
    for name, part in (("train.jsonl", rows[:16]), ("dev.jsonl", rows[16:24])):
        (data / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    res = finetune(["--model", str(run), "--train", str(data / "train.jsonl"), "--dev", str(data / "dev.jsonl"),
                    "--out", str(tmp_path / "ft"), "--epochs", "1", "--batch-size", "8", "--max-length", "32",
                    "--no-progress", "--threads", "1"])
    best = tmp_path / "ft" / "best"
    assert res["dev_examples"] == 8 and (best / "vocab.txt").read_bytes() == vocab.read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(str(best))("中国")["input_ids"] == tok("中国")["input_ids"]
