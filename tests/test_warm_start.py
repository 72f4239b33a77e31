"""Warm starts (``init.from``) and forks (``roformer-train --fork``): weights from a Hugging Face repository
written by transformers itself, from our checkpoints of another ZeRO stage or layout, refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from roformer_dist.config import ModelConfig
from roformer_dist.errors import ConfigError
from roformer_dist.launch.warm_start import adapt, read_parent
from roformer_dist.nn.model import RoFormerForMaskedLM
from trainer_runs import make_cfg, records, train

VOCAB = 300
SMALL = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _hf_repo(tmp_path, kind: str, **changes):
    """A randomly initialised transformers model of SMALL's shape, saved by save_pretrained."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **changes)
    torch.manual_seed(0)
    if kind == "roformer":
        hf = transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(embedding_size=32, **common))
    else:
        hf = transformers.BertForMaskedLM(transformers.BertConfig(**common))
    out = tmp_path / kind
    hf.save_pretrained(str(out))
    return hf.eval(), out


@pytest.mark.parametrize("kind", ["roformer", "bert"])
def test_hf_repository_gives_the_same_logits(tmp_path, kind):
    hf, repo = _hf_repo(tmp_path, kind)
    parent, parent_cfg, sd = read_parent(str(repo))
    assert parent.kind == f"hf-{kind}" and len(parent.config_sha256) == 64
    cfg = dataclasses.replace(SMALL, position_embedding="rotary" if kind == "roformer" else "absolute")
    weights, notes = adapt(parent_cfg, sd, cfg)
    ours = RoFormerForMaskedLM(cfg)
    ours.load_state_dict(weights)
    ours.eval()
    ids = torch.randint(5, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mismatches_are_listed_in_one_message(tmp_path):
    _, repo = _hf_repo(tmp_path, "roformer")
    _, parent_cfg, sd = read_parent(str(repo))
    wrong = dataclasses.replace(SMALL, hidden_size=48, intermediate_size=96, num_hidden_layers=3)
    with pytest.raises(ConfigError) as e:
        adapt(parent_cfg, sd, wrong)
    msg = str(e.value)
    for key in ("model.hidden_size: 32 in the parent, 48", "model.num_hidden_layers: 2 in the parent, 3",
                "model.intermediate_size", "more parameters", "parameter embeddings.word_embeddings.weight: "
                "[300, 32] in the parent, [300, 48]"):
        assert key in msg, (key, msg)
    with pytest.raises(ConfigError, match="may grow, not shrink"):
        adapt(parent_cfg, sd, dataclasses.replace(SMALL, vocab_size=200))


@pytest.mark.parametrize("new_rows", ["mean", "init"])
def test_a_grown_vocabulary_keeps_the_old_rows(tmp_path, new_rows):
    _, repo = _hf_repo(tmp_path, "roformer")
    _, parent_cfg, sd = read_parent(str(repo))
    weights, notes = adapt(parent_cfg, sd, dataclasses.replace(SMALL, vocab_size=VOCAB + 20), new_rows)
    emb, old = weights["embeddings.word_embeddings.weight"], sd["embeddings.word_embeddings.weight"]
    assert emb.shape == (VOCAB + 20, 32) and torch.equal(emb[:VOCAB], old)
    if new_rows == "mean":
        torch.testing.assert_close(emb[VOCAB:], old.mean(0).expand(20, 32))
        torch.testing.assert_close(weights["head.bias"][VOCAB:], sd["head.bias"].mean().expand(20))
    else:
        assert 0.005 < emb[VOCAB:].std().item() < 0.05 and torch.all(weights["head.bias"][VOCAB:] == 0)
    assert any("vocabulary grew 300 -> 320" in n for n in notes)


def test_bad_parents_are_one_message(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        read_parent(str(tmp_path / "nothing"))
    other = tmp_path / "gpt"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        read_parent(str(other))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="junk.pt: not a readable torch weights file"):
        read_parent(str(tmp_path / "junk.pt"))
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="init.from: .*not a roformer-dist checkpoint"):
        read_parent(str(empty))


def _adam_steps(ckpt_dir) -> set:
    """The Adam step counts stored in a ZeRO checkpoint's optimizer files (rank 0's)."""
    sd = torch.load(next(ckpt_dir.glob("*optim_states.pt")), map_location="cpu", weights_only=False)
    found = set()

    def walk(x):
        if isinstance(x, dict):
            if "step" in x and "exp_avg" in x:
                found.add(int(x["step"]))
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(sd)
    return found


def _eval_at_zero(run_dir):
    from roformer_dist.runtime.events import read_scalars

    tb = read_scalars(run_dir / "tb")
    return {k: v for k, pts in tb.items() if k.startswith("eval/loss") for s, v in pts if s == 0}


@pytest.mark.slow
def test_fork_across_zero_stages_and_layouts(tmp_path, small_shards):
    """A ZeRO-3 parent forked into ZeRO-3 with its optimizer, into ZeRO-1 on one rank (other training data)
    and into tensor-parallel 2: equal step-0 evaluations (the parent's); the TP fork is then restarted
    (with a new rope base) and resumes itself, not the parent; its checkpoint forked back into ZeRO-3."""
    parent = tmp_path / "parent"
    assert train(make_cfg(small_shards, parent, "deepspeed.zero_stage=3", "trainer.stop_at_step=3")) == [0, 0]
    # the optimizer too, from a checkpoint of the same layout: Adam's moments continue (step 3 -> 4)
    opt = tmp_path / "with_optimizer"
    assert train(make_cfg(small_shards, opt, "deepspeed.zero_stage=3", "trainer.stop_at_step=1", f"init.from={parent}",
                          "init.load_optimizer=true")) == [0, 0]
    assert _adam_steps(parent / "checkpoints" / "step_00000003") == {3}
    assert _adam_steps(opt / "checkpoints" / "step_00000001") == {4}
    one = tmp_path / "zero1"
    cfg = make_cfg(small_shards, one, "deepspeed.zero_stage=1", "trainer.stop_at_step=1", f"init.from={parent}",
                   world_size=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shards=str(small_shards.eval_dir)))
    assert train(cfg) == [0]
    tp = tmp_path / "tp2"
    fork = ("deepspeed.zero_stage=1", "parallel.tensor=2", f"init.from={parent}")
    assert train(make_cfg(small_shards, tp, *fork, "trainer.stop_at_step=1")) == [0, 0]
    zero = _eval_at_zero(one)
    assert zero and zero == pytest.approx(_eval_at_zero(tp), rel=1e-5, abs=1e-6)
    record = json.loads((tp / "parent.json").read_text())
    assert record["kind"] == "checkpoint" and record["step"] == 3 and record["path"].endswith("step_00000003")
    assert len(record["config_sha256"]) == 64 and record["world_size"] == 2

    assert train(make_cfg(small_shards, tp, *fork, "trainer.stop_at_step=2", "model.rope_theta=20000")) == [0, 0]
    assert [r["step"] for r in records(tp)] == [1, 2]
    assert json.loads((tp / "parent.json").read_text()) == record
    log = (tp / "logs" / "rank0.log").read_text()
    assert "resuming from" in log and "model.rope_theta: 10000.0 in the checkpoint, 20000.0 now" in log
    assert "not read: resuming this run's own checkpoint" in log

    # and back: the tensor-parallel checkpoint into ZeRO-3, whose step-0 eval is the TP model's own (which has
    # rope_theta 20000 now: here a stage's own setting, in force from the stage's first step)
    from roformer_dist.observe.length_report import evaluate_checkpoint

    back = tmp_path / "back"
    cfg = make_cfg(small_shards, back, "deepspeed.zero_stage=3", "trainer.stop_at_step=1", f"init.from={tp}")
    first = dataclasses.replace(cfg.curriculum.stages[0], rope_theta=20000.0)
    cfg = dataclasses.replace(cfg, curriculum=dataclasses.replace(cfg.curriculum,
                                                                  stages=(first, *cfg.curriculum.stages[1:])))
    assert train(cfg) == [0, 0]
    assert "stage 's128': rotary rope_theta 20000.0, rope_scaling none" in (back / "logs" / "rank0.log").read_text()
    own = evaluate_checkpoint(str(tp), [128])
    assert _eval_at_zero(back)["eval/loss_128"] == pytest.approx(own.rows[0].loss, rel=1e-5)


def test_roformer_train_fork_refuses_before_any_rank_starts(tmp_path, small_shards, capsys):
    from roformer_dist.cli.train import main

    _, repo = _hf_repo(tmp_path, "roformer")  # hidden 32: the debug model is 64 wide
    base = ["--config", "configs/experiments/debug.yaml", f"data.shards={small_shards.dir}",
            f"data.eval_shards={small_shards.eval_dir}", "dist.world_size=1"]
    assert main([*base, f"run_dir={tmp_path / 'a'}", "--fork", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "init.from:" in err and "missing: no such file or directory" in err and "Traceback" not in err
    assert main([*base, f"run_dir={tmp_path / 'b'}", "--fork", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "the parent does not fit this model" in err and "model.hidden_size: 32 in the parent, 64" in err
    assert "Traceback" not in err and not (tmp_path / "b" / "config.yaml").exists()
    assert main([*base, f"run_dir={tmp_path / 'c'}", f"init.from={repo}", "init.load_optimizer=true"]) == 2
    assert "init.load_optimizer:" in capsys.readouterr().err
    for bad, says in ((["model.rope_scaling=cubic"], "model.rope_scaling: expected one of none, linear, ntk, yarn"),
                      (["model.rope_scaling=linear", "model.rope_scaling_factor=0.5"],
                       "model.rope_scaling_factor: expected a number >= 1")):
        assert main([*base, f"run_dir={tmp_path / 'd'}", *bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
