"""trainer.compile: the compiled model trains like the eager one, and a second run reuses the cache.

One stage (seq 128, rows across documents: the layers as one compiled graph, where the rotary kernel runs
compiled and ``auto`` times its candidates compiled), 3 steps, eval at two lengths (eager); 1 rank, 1 layer.
The first compiled run pays the cold compile (most of this file's time). Packed documents' split path is
compiled per layout in tests/test_compile_kernels.py.
"""

from __future__ import annotations

import json
import re

import pytest

from trainer_runs import make_cfg, records, trace, train
from roformer_dist.config import load_config, validate
from roformer_dist.errors import ConfigError

STAGE = ("curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 4, steps: 3, "
         "eval_lengths: [64, 128]}]")
OVERRIDES = (STAGE, "trainer.eval_every=3", "data.eval_batches=1", "model.num_hidden_layers=1",
             "data.packing=cross_document")
REL_TOL = 1e-4
"""Compiled vs eager loss, relative, per step: inductor fuses and reorders fp32 arithmetic (and the
reference rotary runs as real arithmetic instead of complex), so only rounding differs."""

COLD_HANG_TIMEOUT_S = 6
"""The cold run's hang watchdog: below what compiling the stage takes in its first step (14 s in the suite, 21 s
on a loaded machine), which the watchdog allows ``dist.first_step_timeout_s`` (default 1200 s); above what an
eval takes there on a loaded machine (3 s under the coverage runs, where 3 s ended the run as a hang)."""

_MESSAGE = re.compile(r"compiled the model for stage s128 \(seq 128, micro-batch (\d+)\) in ([\d.]+) s "
                      r"\(cache: (.+), (\d+) hits, (\d+) misses\)")


def _compile_log(run_dir):
    text = (run_dir / "logs" / "rank0.log").read_text()
    found = _MESSAGE.findall(text)
    assert len(found) == 1, f"expected one compile message for the stage:\n{text[-3000:]}"
    mbs, seconds, cache, hits, misses = found[0]
    return {"seconds": float(seconds), "cache": cache, "hits": int(hits), "misses": int(misses)}


def _eval_figures(run_dir) -> dict[str, float]:
    line = re.search(r"step 3 eval: (.*)", (run_dir / "logs" / "rank0.log").read_text()).group(1)
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split())}


@pytest.fixture(scope="module")
def runs(small_shards, tmp_path_factory):
    """eager, compiled (cold cache), compiled again (same cache dir, another run dir)."""
    base = tmp_path_factory.mktemp("compile")
    cache = base / "cache"
    out = {}
    for name, extra in (("eager", ()), ("cold", ("trainer.compile=true", f"trainer.compile_cache_dir={cache}",
                                                 f"dist.hang_timeout_s={COLD_HANG_TIMEOUT_S}")),
                        ("warm", ("trainer.compile=true", f"trainer.compile_cache_dir={cache}"))):
        cfg = make_cfg(small_shards, base / name, *OVERRIDES, *extra, world_size=1)
        assert train(cfg) == [0], name
        out[name] = base / name
    out["cache"] = cache
    return out


def test_compiled_losses_equal_eager(runs):
    eager, compiled = trace(runs["eager"]), trace(runs["cold"])
    assert len(eager) == len(compiled) == 3
    for step, (a, b) in enumerate(zip(eager, compiled), 1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: eager {a} vs compiled {b}"
    # eval (eager, lengths 64 and 128, not the compiled shapes) gives the same figures (the log's 4 decimals)
    ev, ec = _eval_figures(runs["eager"]), _eval_figures(runs["cold"])
    assert {"eval/loss_64", "eval/loss_128"} <= ev.keys() and ev.keys() == ec.keys()
    for k in ev:
        assert abs(ev[k] - ec[k]) <= 2e-4, (k, ev[k], ec[k])
    log = _compile_log(runs["cold"])
    assert log["cache"] == str(runs["cache"]) and log["misses"] > 0


def test_the_hang_watchdog_lets_a_stage_compile_in_its_first_step(runs):
    """The cold run compiled its stage in its first step, for longer than its dist.hang_timeout_s, and went on:
    a stage's switch and first step are allowed dist.first_step_timeout_s."""
    assert _compile_log(runs["cold"])["seconds"] > COLD_HANG_TIMEOUT_S
    assert trace(runs["cold"]) and not (runs["cold"] / "hang" / "report.txt").exists()


def test_second_run_loads_the_compiled_graphs_from_the_cache(runs):
    """The requeued job's case: every graph of the stage comes from the cache, none is compiled again;
    the losses are those of the first compiled run."""
    assert any(runs["cache"].rglob("*")), "the cache dir holds nothing after the first run"
    cold, warm = _compile_log(runs["cold"]), _compile_log(runs["warm"])
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"], (cold, warm)
    for a, b in zip(trace(runs["warm"]), trace(runs["cold"]), strict=True):
        assert abs(a - b) <= REL_TOL * abs(a)


def test_auto_rotary_backend_is_measured_compiled_and_kept(runs):
    """model.rotary_backend: auto with trainer.compile on CPU: reference and compiled are timed compiled
    (forward and backward at the stage's shape), the faster taken; the table is in the stage's first step
    record and in run_dir/rotary_backend.json (what a resumed run reads instead of measuring again)."""
    recs = records(runs["cold"])
    measured = recs[0]["rotary_backend"]
    timings = {t["backend"]: t for t in measured["timings"]}
    assert set(timings) == {"reference", "compiled"} and all(t["median_ms"] > 0 for t in timings.values())
    fastest = min(timings, key=lambda b: timings[b]["median_ms"])
    assert measured["backend"] == fastest and measured["key"]["compiled"] is True
    assert measured["key"]["shape"][1:] == [128, 4, 16]  # (micro-batch, S, heads, head_dim) of the stage
    saved = json.loads((runs["cold"] / "rotary_backend.json").read_text())
    assert [c["backend"] for c in saved["choices"]] == [fastest]
    assert all("rotary_backend" not in r for r in recs[1:])
    # an eager CPU run has one candidate (reference): nothing is measured or written
    assert all("rotary_backend" not in r for r in records(runs["eager"]))
    assert not (runs["eager"] / "rotary_backend.json").exists()


def test_layouts_compile_does_not_cover_are_refused_by_name():
    for over, message in ((["parallel.tensor=2", "dist.world_size=2"], "trainer.compile: tensor parallelism"),
                          (["deepspeed.zero_stage=3"], "trainer.compile: ZeRO-3"),
                          (["parallel.pipeline=2", "dist.world_size=2", "deepspeed.zero_stage=1"],
                           "trainer.compile: pipeline stages")):
        with pytest.raises(ConfigError, match=message):
            validate(load_config(overrides=["trainer.compile=true", *over]))
    validate(load_config(overrides=["trainer.compile=true"]))


def test_compiled_dropout_draws_the_eager_mask(tmp_path):
    """After configure_inductor, a compiled function with dropout gives the eager result under the same seed
    (the masks come from torch's generator, not inductor's own random-number code)."""
    import torch

    from roformer_dist.parallel.compiled import configure_inductor

    configure_inductor(tmp_path / "cache")
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)

    def f(x):
        h = torch.nn.functional.dropout(lin(x), 0.5, training=True)
        return torch.nn.functional.dropout(torch.relu(h), 0.5, training=True)

    torch.manual_seed(1)
    want = f(x)
    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True)
    torch.manual_seed(1)
    got = g(x)
    assert ((want == 0) == (got == 0)).all()           # the same units dropped
    torch.testing.assert_close(got, want)


def test_compile_mode_reaches_the_layers_graph_only(monkeypatch, tmp_path):
    """trainer.compile_mode: the layers' graph (static shapes) takes it, the head (N rows changing every
    batch) and the split path's pieces keep the default; an unknown mode is refused by name."""
    import torch

    from roformer_dist.nn.model import RoFormerForMaskedLM, set_rotary_kernel
    from roformer_dist.parallel import compiled

    modes = {}

    def spy(fn, **kw):
        modes[getattr(fn, "__name__", "?")] = kw.get("mode", "default")
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    cfg = load_config(overrides=["model=debug", "model.vocab_size=100", "trainer.compile_mode=reduce-overhead"])
    model = RoFormerForMaskedLM(cfg.model)
    set_rotary_kernel(model, "reference")
    compiled.StageCompiler(model, tmp_path, cfg.trainer.compile_mode).compile_stage("s128", 128, 4)
    assert modes == {"stack": "reduce-overhead", "predict": "default", "_embed": "default",
                     "_layer_project": "default", "_layer_finish": "default"}
    with pytest.raises(ConfigError, match="trainer.compile_mode"):
        load_config(overrides=["trainer.compile_mode=fastest"])
