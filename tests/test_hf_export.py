"""The complete HF repository of ``roformer-convert to-hf``: a tiny model really trained by roformer-train,
exported, loaded back with transformers' Auto classes; the HF tokenizer against our pipeline on real
Chinese text (People's Daily 1998, product reviews); logits; atomic, refusing, clearly failing export."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_pipeline.corpus import normalize, read_documents  # noqa: E402
from data_pipeline.tokenizer import Tokenizer  # noqa: E402
from roformer_dist.cli.convert import main as convert_main  # noqa: E402
from roformer_dist.checkpoint.weights import save_weights  # noqa: E402
from roformer_dist.errors import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA  # noqa: E402
from roformer_dist.hf.tokenizer import agreement, load_hf_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "README.md", "roformer_export.json"}


@pytest.fixture(scope="module")
def trained(small_shards, tmp_path_factory):
    """A 4-step, 1-rank run of the debug model on the small People's Daily shards (real roformer-train)."""
    run = tmp_path_factory.mktemp("hf_export") / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
    r = subprocess.run([sys.executable, "-m", "roformer_dist.cli.train", "--config",
                        str(ROOT / "configs" / "experiments" / "debug.yaml"), f"data.shards={small_shards.dir}",
                        f"data.eval_shards={small_shards.eval_dir}", f"run_dir={run}", "dist.world_size=1",
                        "curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 8, steps: 4}]",
                        "deepspeed.zero_stage=0", "trainer.save_every=0", "trainer.eval_every=0",
                        "data.eval_batches=2", "optim.lr=3e-3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def exported(trained):
    out = trained.parent / "hf"
    assert convert_main(["to-hf", "--checkpoint", str(trained / "checkpoints" / "step_00000004"),
                         "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def our_model(trained):
    from roformer_dist.checkpoint.weights import load_checkpoint_weights
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg, sd = load_checkpoint_weights(trained / "checkpoints" / "step_00000004")
    model = RoFormerForMaskedLM(cfg)
    model.load_state_dict(sd)
    return model.eval()


def real_texts(peoples_daily, reviews, n_pd=500, n_reviews=1000) -> tuple[list[str], list[str]]:
    """People's Daily documents (tags stripped) far from the tokenizer's training lines, and raw reviews
    (full-width punctuation, spaces, traditional characters: normalisation matters)."""
    pd = [d.text for d in read_documents(peoples_daily)][6000:6000 + n_pd]
    pos = reviews[0].read_text(encoding="utf-8").splitlines()
    neg = reviews[1].read_text(encoding="utf-8").splitlines()
    return pd, (pos[: n_reviews // 2] + neg[: n_reviews // 2])


# --------------------------------------------------------------------------- the repository


def test_export_is_a_complete_hf_repository(exported, small_shards):
    assert {p.name for p in exported.iterdir()} == EXPORT_FILES
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".hf")], "temporary left behind"
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in exported.iterdir()} == {0o666 & ~mask}  # readable like any file
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.is_fast
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == \
        (0, 1, 2, 3, 4)
    assert tok.model_max_length == 512  # the debug model's positions
    pair = tok("今天天气很好", "明天呢")
    ids, types = pair["input_ids"], pair["token_type_ids"]
    first_sep = ids.index(3)
    assert ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2
    assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    model = transformers.AutoModelForMaskedLM.from_pretrained(exported)
    assert type(model).__name__ == "RoFormerForMaskedLM"
    assert (exported / "tokenizer.model").read_bytes() == Path(small_shards.tokenizer).read_bytes()
    info = json.loads((exported / "roformer_export.json").read_text())
    assert info["step"] == 4 and info["tokens_seen"] > 0
    check = info["tokenizer"]["roundtrip_check"]
    assert check["documents"] == 1000 and check["identical"] >= 995
    card = (exported / "README.md").read_text()
    for needle in ("| layers | 2 |", "steps: 4", "1,600 documents", "| s128 | 128 | 8 | 4 |", "| 128 |",
                   "AutoTokenizer.from_pretrained", "roformer-finetune", "| schedule | 15% |",
                   "15% of tokens, whole-word masking; evaluated at 15%", "linear decay"):
        assert needle in card, needle


def test_hf_tokenizer_gives_our_pipeline_ids_on_real_text(exported, small_shards, peoples_daily, reviews):
    """[CLS] + encode(normalize(text)) + [SEP] on >= 500 documents of each corpus, >= 99.5% identical."""
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    pd, rev = real_texts(peoples_daily, reviews)
    for name, texts in (("people's daily", pd), ("reviews", rev)):
        agr = agreement(tok, texts, small_shards.tokenizer)
        assert agr.num_docs >= 500
        assert agr.rate >= 0.995, (name, agr.summary(), agr.examples)
    # the reviews do exercise normalisation: full-width punctuation and spaces occur and are mapped
    assert sum("，" in t for t in rev) > 100 and sum(" " in t for t in rev) > 10


HOSTILE = ["Ａ１，ＡＢＣ！　全角", "a\tb\n\nc  d ", "零\u200b宽\u200d字符\ufeff", "控制\x00\x07字符\x1f",
           "😀 emoji and 關於 byte fallback", "<0xE4><0xB8> literal byte pieces", "\u3000 leading", "",
           "x\u2028y\u0085z", "e\u0301 combining", "㍿ ﬁ ① compatibility"]


def test_hf_tokenizer_normalisation_and_unreachable_pieces_exact(exported, small_shards):
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    ours = Tokenizer(small_shards.tokenizer)
    for text in HOSTILE:
        assert tok(text)["input_ids"] == [2, *ours.encode(normalize(text)).tolist(), 3], repr(text)
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == normalize(text), repr(text)
    # literal special-token strings: special ids by default (fill-mask), text with split_special_tokens
    text = "今天[MASK]气 [SEP] 很好"
    assert 4 in tok(text)["input_ids"]
    split = transformers.AutoTokenizer.from_pretrained(exported, split_special_tokens=True)
    assert split(text)["input_ids"] == [2, *ours.encode(normalize(text)).tolist(), 3]


def test_fill_mask_pipeline_and_logits_equal_ours(exported, our_model, peoples_daily, reviews):
    fill = transformers.pipeline("fill-mask", model=str(exported))
    preds = fill("中国共产党第十五次全国代表大会[MASK]北京召开", top_k=3)
    assert len(preds) == 3 and all(0 <= p["token"] < our_model.config.vocab_size for p in preds)
    assert all(p["sequence"].startswith("中国共产党") for p in preds)

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(exported).eval()
    pd, rev = real_texts(peoples_daily, reviews, n_pd=16, n_reviews=16)
    batch = tok(pd + rev, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**batch).logits
        ours = our_model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
    keep = batch["attention_mask"].bool()
    assert (theirs - ours)[keep].abs().max().item() <= 1e-4


def test_bpe_tokenizer_too(small_shards, reviews, tmp_path):
    """roformer-data can train BPE SentencePiece models: tokenizer.json is then a BPE with SentencePiece's
    merge order, again equal to our pipeline on real reviews and the hostile strings."""
    from data_pipeline.tokenizer import train_tokenizer
    from roformer_dist.hf.tokenizer import build_fast_tokenizer

    model = train_tokenizer((d.text for d in read_documents(small_shards.source)), tmp_path / "bpe",
                            vocab_size=4000, model_type="bpe", num_threads=1)
    hf = build_fast_tokenizer(model)
    agr = agreement(hf, reviews[0].read_text(encoding="utf-8").splitlines()[:600], model)
    assert agr.num_docs == 600 and agr.rate >= 0.995, agr.examples
    hostile = agreement(hf, HOSTILE, model)
    assert hostile.rate == 1.0, hostile.examples


# --------------------------------------------------------------------------- refusing, atomic, errors


def _tree(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_existing_output_is_refused_without_force_and_replaced_with_it(trained, exported, tmp_path, capsys):
    ckpt = str(trained / "checkpoints" / "step_00000004")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_main(["to-hf", "--checkpoint", ckpt, "--out", str(out)]) == EXIT_CONFIG
    assert "--force" in capsys.readouterr().err and _tree(out) == {"keep.txt": b"mine"}
    assert convert_main(["to-hf", "--checkpoint", ckpt, "--out", str(out), "--force", "--check-docs", "0"]) == 0
    assert {p.name for p in out.iterdir()} == EXPORT_FILES
    assert _tree(out)["model.safetensors"] == _tree(exported)["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary or old copy left


def test_failed_export_leaves_nothing(trained, exported, tmp_path, capsys, peoples_daily, monkeypatch):
    from data_pipeline.tokenizer import train_tokenizer

    # a tokenizer with another vocabulary is refused before anything is written
    other = train_tokenizer((d.text for d in read_documents(peoples_daily, limit=300)), tmp_path / "tok" / "sp",
                            vocab_size=2000, character_coverage=0.98, num_threads=1)
    out = tmp_path / "out" / "hf"
    code = convert_main(["to-hf", "--checkpoint", str(trained / "checkpoints"), "--out", str(out),
                         "--tokenizer", str(other)])
    assert code == EXIT_DATA
    err = capsys.readouterr().err
    assert "sp.model" in err and "pieces" in err
    assert not out.exists()

    # a failure after the weights and the tokenizer are written (in the model card) leaves no trace,
    # and an existing export being replaced with --force is kept as it was
    import roformer_dist.hf.export as export

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(export, "render_model_card", broken)
    before = _tree(exported)
    with pytest.raises(OSError, match="disk full"):
        convert_main(["to-hf", "--checkpoint", str(trained), "--out", str(exported), "--force"])
    assert _tree(exported) == before
    assert sorted(p.name for p in exported.parent.iterdir()) == ["hf", "run"]


def test_export_errors_are_clear(trained, tmp_path, capsys):
    from roformer_dist.config import ModelConfig
    from roformer_dist.nn.model import RoFormerForMaskedLM

    missing = tmp_path / "nope" / "step_00000001"
    assert convert_main(["to-hf", "--checkpoint", str(missing), "--out", str(tmp_path / "o")]) == EXIT_CHECKPOINT
    assert str(missing) in capsys.readouterr().err

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in (trained / "checkpoints" / "step_00000004").iterdir():
        (damaged / f.name).write_bytes(f.read_bytes()[: 100] if f.name.startswith("mp_rank") else f.read_bytes())
    assert convert_main(["to-hf", "--checkpoint", str(damaged), "--out", str(tmp_path / "o")]) == EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert str(damaged) in err and "Traceback" not in err

    base = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=64)
    absolute = ModelConfig(**base, position_embedding="absolute")
    save_weights(tmp_path / "abs.pt", absolute, RoFormerForMaskedLM(absolute).state_dict())
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "abs.pt"), "--out", str(tmp_path / "o"),
                         "--no-tokenizer"]) == EXIT_CONFIG
    assert "model.position_embedding" in capsys.readouterr().err
    plain = ModelConfig(**base)
    sd = RoFormerForMaskedLM(plain).state_dict()
    save_weights(tmp_path / "linear.pt", ModelConfig(**base, attention="linear"), sd)
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "linear.pt"), "--out", str(tmp_path / "o"),
                         "--no-tokenizer"]) == EXIT_CONFIG
    assert "model.attention: 'linear' has no HF RoFormer equivalent" in capsys.readouterr().err

    save_weights(tmp_path / "plain.pt", plain, sd)
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "o")]) == \
        EXIT_DATA
    assert "--tokenizer" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "o"),
                         "--no-tokenizer"]) == 0
    assert not (tmp_path / "o" / "tokenizer.json").exists()
    assert "no tokenizer" in (tmp_path / "o" / "README.md").read_text()


@pytest.mark.parametrize("rope", [dict(rope_theta=500.0), dict(rope_scaling="yarn", rope_scaling_factor=4.0)],
                         ids=["theta", "yarn"])
def test_rope_settings_survive_export_and_from_pretrained(tmp_path, rope):
    """HF keeps a stored table of other rope settings (from_pretrained does not re-create it) and reads
    cos and sin from it as they are: HF's logits equal ours; the settings come back from config.json."""
    from roformer_dist.config import ModelConfig, rope_settings
    from roformer_dist.hf.convert import HF_ROPE_KEY, from_hf_pretrained
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, initializer_range=0.3, **rope)
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(cfg).eval()
    save_weights(tmp_path / "w.pt", cfg, ours.state_dict())
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "w.pt"), "--out", str(tmp_path / "hf"),
                         "--no-tokenizer"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())[HF_ROPE_KEY] == rope_settings(cfg).to_dict()
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(1, 50, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    with torch.no_grad():
        want = ours(ids, mask).logits
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=1e-5)
        default = RoFormerForMaskedLM(dataclasses.replace(cfg, **rope_settings(ModelConfig()).to_dict())).eval()
        default.load_state_dict(ours.state_dict())
        assert (default(ids, mask).logits - want).abs().max() > 1e-2  # the settings matter to these logits
        back = from_hf_pretrained(tmp_path / "hf")
        assert rope_settings(back.config) == rope_settings(cfg)
        torch.testing.assert_close(back.eval()(ids, mask).logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embed_positions.weight is not the rotary table of model.rope_theta=10000"):
        from_hf_pretrained(tmp_path / "hf", **rope_settings(ModelConfig()).to_dict())


def test_jieba_style_tokenizer_is_exported_with_a_warning(trained, small_shards, tmp_path, capsys):
    """A model trained on word-pre-segmented text (a pretokenization delimiter in the SentencePiece model,
    as train_tokenizer(jieba=True) writes; gold People's Daily words stand in for jieba's here)."""
    import sentencepiece as spm

    from data_pipeline.tokenizer import SPECIAL_TOKENS

    words = [d.words for d in read_documents(small_shards.source)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["\t".join(w) for w in words]), model_prefix=str(tmp_path / "wsp"),
        vocab_size=4000, model_type="unigram", byte_fallback=True, hard_vocab_limit=False,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        pad_id=0, pad_piece="[PAD]", unk_id=1, unk_piece="[UNK]", bos_id=-1, eos_id=-1,
        control_symbols=[SPECIAL_TOKENS[k] for k in ("cls", "sep", "mask")], user_defined_symbols=["\u2581"],
        pretokenization_delimiter="\t", minloglevel=2, num_threads=1)
    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    cfg, sd = load_checkpoint_weights(trained / "checkpoints" / "step_00000004")
    vocab = Tokenizer(tmp_path / "wsp.model").vocab_size
    import dataclasses

    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = dataclasses.replace(cfg, vocab_size=vocab)
    save_weights(tmp_path / "w.pt", cfg, RoFormerForMaskedLM(cfg).state_dict())
    out = tmp_path / "hf"
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "w.pt"), "--tokenizer",
                         str(tmp_path / "wsp.model"), "--out", str(out)]) == 0
    assert "jieba" in capsys.readouterr().out
    assert "jieba word pre-segmentation" in (out / "README.md").read_text()
    assert json.loads((out / "roformer_export.json").read_text())["tokenizer"]["jieba"] is True
    assert transformers.AutoTokenizer.from_pretrained(out)("中国")["input_ids"][0] == 2


def test_run_directory_export_is_reproducible(exported, trained, small_shards, tmp_path, capsys):
    """to-hf on the run directory takes its latest checkpoint and writes the same repository; tokenizer.json
    does not depend on the process (hash seed)."""
    assert convert_main(["to-hf", "--checkpoint", str(trained), "--out", str(tmp_path / "hf"),
                         "--check-docs", "200"]) == 0
    assert "tokenizer check: 200/200 documents" in capsys.readouterr().out
    a, b = _tree(tmp_path / "hf"), _tree(exported)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert a[name] == b[name], name
    code = ("import sys; from roformer_dist.hf.tokenizer import build_fast_tokenizer; "
            "sys.stdout.write(build_fast_tokenizer(sys.argv[1]).to_str())")
    outs = {subprocess.run([sys.executable, "-c", code, str(small_shards.tokenizer)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=seed), check=True).stdout
            for seed in ("1", "2")}
    assert outs == {a["tokenizer.json"].decode()}


def test_finetune_from_the_training_checkpoint(trained, tmp_path, reviews):
    """roformer-finetune on the checkpoint directory itself: the encoder is our trained one, and the
    best model reloads with AutoModelForSequenceClassification + AutoTokenizer."""
    from roformer_dist.finetune.run import run

    lines = [(t, 1) for t in reviews[0].read_text(encoding="utf-8").splitlines()[:24]] + \
            [(t, 0) for t in reviews[1].read_text(encoding="utf-8").splitlines()[:24]]
    rows = [json.dumps({"sentence": t, "label": y}, ensure_ascii=False) for t, y in lines]
    (tmp_path / "train.jsonl").write_text("\n".join(rows[::2]) + "\n", encoding="utf-8")
    (tmp_path / "dev.jsonl").write_text("\n".join(rows[1::2]) + "\n", encoding="utf-8")
    res = run(["--model", str(trained / "checkpoints"), "--train", str(tmp_path / "train.jsonl"), "--dev",
               str(tmp_path / "dev.jsonl"), "--out", str(tmp_path / "ft"), "--epochs", "1", "--batch-size", "8",
               "--max-length", "64", "--no-progress", "--lr", "1e-30", "--threads", "1"])
    assert res["backend"] == "transformers" and res["train_examples"] == 24 and res["truncated"] > 0
    best = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ft" / "best")
    from roformer_dist.checkpoint.weights import load_checkpoint_weights

    _, sd = load_checkpoint_weights(trained / "checkpoints" / "step_00000004")
    # lr 1e-30: the encoder is still the pretrained one
    torch.testing.assert_close(best.roformer.embeddings.word_embeddings.weight,
                               sd["embeddings.word_embeddings.weight"], rtol=0, atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ft" / "best")
    assert np.array_equal(tok("中国")["input_ids"], [2, *Tokenizer(tmp_path / "ft" / "best" / "tokenizer.model")
                                                     .encode("中国").tolist(), 3])
