"""Parity with HF transformers' RoFormerForMaskedLM (an implementation we did not write) and conversion."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from roformer_dist.hf import convert as H  # noqa: E402
from roformer_dist.config import ModelConfig  # noqa: E402
from roformer_dist.checkpoint.weights import load_weights, save_weights  # noqa: E402
from roformer_dist.cli.convert import main as convert_main  # noqa: E402
from roformer_dist.errors import EXIT_CHECKPOINT, EXIT_CONFIG  # noqa: E402
from roformer_dist.nn.model import RoFormerForMaskedLM  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 97

CONFIGS = {
    "plain": dict(),
    "embedding_size": dict(embedding_size=24),
    "rotary_value": dict(rotary_value=True),
    "emb_rv_gelu_new": dict(embedding_size=48, rotary_value=True, hidden_act="gelu_new"),
}


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=40, max_position_embeddings=64, type_vocab_size=3,
                rotary_backend="reference")
    base.update(kw)
    return ModelConfig(**base)


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Move every parameter away from its init (LayerNorms too), so that a wrong mapping shows.
    HF's fixed sinusoidal table is a (frozen) parameter too: it stays as it is."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, S = 3, 21
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    types = torch.randint(0, 3, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 15:] = 0
    mask[2, 6:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, types, mask


def max_diff_unpadded(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_ours_parity(name, tmp_path):
    cfg = tiny(**CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.RoFormerForMaskedLM(H.hf_config_from(cfg))
    perturb(hf, seed=1)
    hf.eval().save_pretrained(tmp_path)
    ours = H.from_hf_pretrained(tmp_path).eval()
    assert ours.config == dataclasses.replace(cfg, rotary_backend="auto")
    ids, types, mask = batch()
    with torch.no_grad():
        a = ours(ids, mask, types).logits
        b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert max_diff_unpadded(a, b, mask) <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ours_to_hf_parity_and_exact_round_trip(name, tmp_path):
    cfg = tiny(**CONFIGS[name])
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(cfg)
    perturb(ours, seed=2)
    ours.eval()
    H.to_hf_pretrained(ours, tmp_path)
    hf = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path).eval()
    ids, types, mask = batch(1)
    with torch.no_grad():
        a = ours(ids, mask, types).logits
        b = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert max_diff_unpadded(a, b, mask) <= 1e-5
    back = H.from_hf_pretrained(tmp_path)
    sd0, sd1 = ours.state_dict(), back.state_dict()
    assert sd0.keys() == sd1.keys()
    for key in sd0:
        assert torch.equal(sd0[key], sd1[key]), key


def test_loss_with_labels_matches_full_logits_cross_entropy():
    cfg = tiny(embedding_size=24)
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(cfg)
    perturb(ours, seed=3)
    ours.eval()
    hf = H.to_hf_model(ours)
    ids, types, mask = batch(2)
    g = torch.Generator().manual_seed(5)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & mask.bool(), ids, -100)
    with torch.no_grad():
        out = ours(ids, mask, types, labels=labels)
        hf_out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    full = F.cross_entropy(hf_out.logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, hf_out.loss, atol=1e-5, rtol=1e-5)
    sel = labels != -100
    assert out.num_predicted.item() == int(sel.sum())
    acc = (hf_out.logits[sel].argmax(-1) == labels[sel]).float().mean()
    torch.testing.assert_close(out.accuracy, acc)
    torch.testing.assert_close(out.masked_logits, hf_out.logits[sel], atol=1e-5, rtol=1e-5)


def test_gradients_match_hf():
    cfg = tiny(rotary_value=True)
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(cfg)
    perturb(ours, seed=4)
    ours.eval()
    hf = H.to_hf_model(ours)
    ids, types, mask = batch(3)
    labels = torch.where(mask.bool(), ids, -100)
    ours(ids, mask, types, labels=labels).loss.backward()
    hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss.backward()
    grads = {k: p.grad for k, p in ours.named_parameters()}
    hf_grads = H.state_dict_from_hf({k: p.grad for k, p in hf.named_parameters()}
                                    | {"cls.predictions.bias": hf.cls.predictions.bias.grad}, cfg)
    for key, g in grads.items():
        torch.testing.assert_close(g, hf_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def test_config_mapping_round_trip():
    cfg = tiny(embedding_size=24, rotary_value=True, hidden_act="relu", layer_norm_eps=1e-7)
    back = H.model_config_from_hf(H.hf_config_from(cfg))
    assert back == dataclasses.replace(cfg, rotary_backend="auto")
    assert H.model_config_from_hf(H.hf_config_from(tiny(embedding_size=32))).embedding_size is None


def test_absolute_positions_have_no_hf_equivalent():
    cfg = tiny(position_embedding="absolute")
    model = RoFormerForMaskedLM(cfg)
    with pytest.raises(ValueError, match="position_embedding"):
        H.state_dict_to_hf(model.state_dict(), cfg)


def test_absolute_positions_equal_hf_bert():
    """The ablation's baseline (``position_embedding=absolute``) is BERT: same logits as transformers'
    BertForMaskedLM with our weights, padding mask included."""
    cfg = tiny(position_embedding="absolute", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = ours.state_dict()
    mapped = H.state_dict_to_hf(sd, dataclasses.replace(cfg, position_embedding="rotary"))
    bert_sd = {k.replace("roformer.", "bert.", 1): v for k, v in mapped.items() if "embed_positions" not in k}
    bert_sd["bert.embeddings.position_embeddings.weight"] = sd["embeddings.position_embeddings.weight"]
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64, type_vocab_size=3, hidden_act=cfg.hidden_act, layer_norm_eps=cfg.layer_norm_eps,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=cfg.pad_token_id)).eval()
    missing, unexpected = bert.load_state_dict(bert_sd, strict=False)
    assert not unexpected and all("position_ids" in k or "token_type_ids" in k for k in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0
    types = (torch.arange(30) >= 15).long().expand(2, -1)
    with torch.no_grad():
        a = ours(ids, mask, types).logits
        b = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(a[0], b[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(a[1, :21], b[1, :21], atol=2e-5, rtol=2e-5)


def test_state_dict_mapping_names_missing_key():
    cfg = tiny()
    sd = RoFormerForMaskedLM(cfg).state_dict()
    del sd["layers.1.ffn_in.weight"]
    with pytest.raises(KeyError, match="layers.1.ffn_in.weight"):
        H.state_dict_to_hf(sd, cfg)


# --------------------------------------------------------------------------- roformer-convert CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "roformer_dist.cli.convert", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_convert_cli_from_hf_and_to_hf(tmp_path):
    cfg = tiny(embedding_size=24)
    torch.manual_seed(0)
    hf = transformers.RoFormerForMaskedLM(H.hf_config_from(cfg))
    perturb(hf, seed=6)
    hf.eval().save_pretrained(tmp_path / "hf_in")

    weights = tmp_path / "ours.pt"
    r = run_cli("from-hf", "--hf-dir", str(tmp_path / "hf_in"), "--out", str(weights))
    assert r.returncode == 0, r.stderr
    cfg_loaded, sd = load_weights(weights)
    assert cfg_loaded.embedding_size == 24 and cfg_loaded.vocab_size == VOCAB
    assert "embeddings.project.weight" in sd

    r = run_cli("to-hf", "--checkpoint", str(weights), "--out", str(tmp_path / "hf_out"), "--no-tokenizer")
    assert r.returncode == 0, r.stderr
    hf2 = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path / "hf_out").eval()
    for (k1, v1), (k2, v2) in zip(hf.state_dict().items(), hf2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1

    # a directory target gets model.pt + model.yaml, and to-hf accepts that directory (in-process)
    assert convert_main(["from-hf", "--hf-dir", str(tmp_path / "hf_in"), "--out", str(tmp_path / "outdir")]) == 0
    assert (tmp_path / "outdir" / "model.pt").is_file() and (tmp_path / "outdir" / "model.yaml").is_file()
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "outdir"), "--out", str(tmp_path / "hf_out2"),
                         "--no-tokenizer"]) == 0
    assert (tmp_path / "hf_out2" / "config.json").is_file()


def test_convert_cli_bare_state_dict_needs_config(tmp_path, capsys):
    cfg = tiny()
    model = RoFormerForMaskedLM(cfg)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "bare.pt"), "--out", str(tmp_path / "o")]) == \
        EXIT_CONFIG
    err = capsys.readouterr().err
    assert "bare.pt" in err and "--config" in err


def test_convert_cli_errors_name_the_file(tmp_path, capsys):
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "o")]) == \
        EXIT_CHECKPOINT
    assert "missing.pt" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    assert convert_main(["to-hf", "--checkpoint", str(tmp_path / "junk.pt"), "--out", str(tmp_path / "o")]) == \
        EXIT_CHECKPOINT
    assert "junk.pt" in capsys.readouterr().err
    assert convert_main(["from-hf", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "x.pt")]) == \
        EXIT_CHECKPOINT
    assert "nope" in capsys.readouterr().err
    for sub in ("from-hf", "to-hf"):
        with pytest.raises(SystemExit) as e:
            convert_main([sub, "--help"])
        assert e.value.code == 0 and "--out" in capsys.readouterr().out


def test_weights_file_round_trip(tmp_path):
    cfg = tiny()
    model = RoFormerForMaskedLM(cfg)
    save_weights(tmp_path / "w.pt", cfg, model.state_dict())
    cfg2, sd = load_weights(tmp_path / "w.pt")
    assert cfg2 == cfg
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
