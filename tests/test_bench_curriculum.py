"""bench/curriculum.py's pure parts: the variants' curricula (same tokens per step, same total, the paper's
proportions), the training wall time from metrics.jsonl records, and the interpolations of the report.
The whole bench runs in tests/test_benches.py (``--tiny``)."""

from __future__ import annotations

import pytest
import yaml

from bench_scripts import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("curriculum") as module:
        yield module


@pytest.fixture(scope="module")
def paper(bench):
    return yaml.safe_load(bench.PAPER.read_text(encoding="utf-8"))["stages"]


BASE = {"tokens_per_micro_batch": 4096, "stages": [  # a 128 -> 256 -> 512 curriculum of 740 steps of 4096 tokens
    {"name": "s128", "seq_len": 128, "global_batch_size": 32, "steps": 500, "eval_lengths": [128]},
    {"name": "s256", "seq_len": 256, "global_batch_size": 16, "steps": 120, "eval_lengths": [128, 256]},
    {"name": "s512", "seq_len": 512, "global_batch_size": 8, "steps": 120, "eval_lengths": [128, 256, 512]}]}


def test_apportion_largest_remainder_and_at_least_one_step(bench, paper):
    weights = [st["steps"] for st in paper]
    assert bench.apportion(weights, 740) == [327, 21, 196, 131, 16, 49]
    assert bench.apportion(weights, 1000) == [442, 28, 265, 177, 22, 66]
    assert bench.apportion(weights, 8) == [2, 1, 2, 1, 1, 1]  # zeros take a step from the largest share
    for total in (6, 7, 37, 185, 1000):
        shares = bench.apportion(weights, total)
        assert sum(shares) == total and min(shares) >= 1, (total, shares)
    with pytest.raises(ValueError, match="cannot give each"):
        bench.apportion(weights, 5)


def test_variants_same_tokens_per_step_same_total_eval_at_the_final_length(bench, paper):
    cs = bench.variant_curricula(BASE, paper)
    assert bench.describe(cs["a"]) == "128 x 500, 256 x 120, 512 x 120"
    assert bench.describe(cs["b"]) == "512 x 740"
    assert bench.describe(cs["c"]) == "512 x 348, 256 x 196, 128 x 131, 512 x 65"  # 327 + 21, ..., 16 + 49
    assert [st["name"] for st in cs["c"]["stages"]] == ["stage1+stage2_512", "stage3_256", "stage4_128",
                                                        "stage5+stage6_512"]
    for c in cs.values():
        assert bench.tokens_per_step(c["stages"]) == 4096
        assert sum(st["steps"] for st in c["stages"]) == 740
        assert all(st["eval_lengths"] == [512] for st in c["stages"])
        assert c["tokens_per_micro_batch"] == 4096
    assert BASE["stages"][0]["eval_lengths"] == [128]  # the base is not changed
    long = bench.variant_curricula(BASE, paper, long=1024)["c"]["stages"]
    assert [(st["seq_len"], st["global_batch_size"], st["steps"]) for st in long] == \
        [(512, 8, 327), (1024, 4, 21), (256, 16, 196), (128, 32, 131), (1024, 4, 16), (512, 8, 49)]


def test_scale_rounds_each_stage_and_keeps_the_totals_equal(bench, paper):
    cs = bench.variant_curricula(BASE, paper, scale=0.05)
    assert bench.describe(cs["a"]) == "128 x 25, 256 x 6, 512 x 6"
    assert {sum(st["steps"] for st in c["stages"]) for c in cs.values()} == {37}


def test_the_demo_config_makes_three_valid_variants(bench, paper, tmp_path):
    """The demo's curriculum qualifies as a base (one tokens-per-step), and each variant loads as a config that
    masks at one rate in every stage (the demo's own per-stage rates dropped)."""
    from roformer_dist.config import CONFIGS_DIR, load_config, to_dict

    demo = CONFIGS_DIR / "experiments" / "demo.yaml"
    cs = bench.variant_curricula(to_dict(load_config(demo).curriculum), paper)
    for name, c in cs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(c))
        cfg = load_config(demo, [f"curriculum={path}"])
        assert {st.eval_lengths for st in cfg.curriculum.stages} == {(cs["a"]["stages"][-1]["seq_len"],)}
        assert {st.mlm_probability for st in cfg.curriculum.stages} == {None}
    assert len({sum(st["steps"] for st in c["stages"]) for c in cs.values()}) == 1


def test_unequal_tokens_per_step_are_refused(bench, paper):
    base = {"tokens_per_micro_batch": 2048, "stages": [
        {"name": "s128", "seq_len": 128, "global_batch_size": 8, "steps": 6},
        {"name": "s256", "seq_len": 256, "global_batch_size": 8, "steps": 6}]}
    with pytest.raises(ValueError, match="different tokens per step"):
        bench.variant_curricula(base, paper)
    with pytest.raises(ValueError, match="not a whole number of 1536-token"):
        bench.variant_curricula(BASE, paper, long=1536)


def records(step_times, gaps=()):
    """metrics.jsonl-like records: step i ends step_times[i - 1] s after the previous one ended, plus a gap
    (an eval, a save) before it when i is in gaps."""
    out, now = [], 1000.0
    for i, dt in enumerate(step_times, start=1):
        now += dt + dict(gaps).get(i, 0.0)
        out.append({"step": i, "time": now, "step_time_s": dt, "tokens_seen": 100 * i})
    return out


def test_train_seconds_sum_the_steps_and_leave_out_evals_and_saves(bench):
    recs = records([1.0, 2.0, 1.5, 0.5], gaps=[(3, 10.0)])  # an eval after step 2
    assert bench.train_seconds(recs) == {1: 1.0, 2: 3.0, 3: 4.5, 4: 5.0}
    assert bench.span_seconds(recs) == pytest.approx(15.0)  # the 10 s eval is in the span only
    pts = bench.curve(recs, [(2, 7.0), (4, 6.0), (9, 5.0)], per_step=4096)  # step 9: no record, left out
    assert pts == [{"step": 2, "tokens": 8192, "tokens_seen": 200, "train_s": 3.0, "loss": 7.0},
                   {"step": 4, "tokens": 16384, "tokens_seen": 400, "train_s": 5.0, "loss": 6.0}]


def pts(*pairs):
    return [{"train_s": t, "loss": loss} for t, loss in pairs]


def test_time_to_reach_interpolates_between_eval_points(bench):
    curve = pts((10, 8.0), (20, 6.0), (30, 5.0), (40, 5.5))
    assert bench.time_to_reach(curve, 7.0) == pytest.approx(15.0)
    assert bench.time_to_reach(curve, 5.0) == pytest.approx(30.0)
    assert bench.time_to_reach(curve, 5.5) == pytest.approx(25.0)  # the first crossing, not the last point
    assert bench.time_to_reach(curve, 9.0) == 10  # already there at the first eval
    assert bench.time_to_reach(curve, 4.9) is None  # never


def test_loss_at_interpolates_inside_the_points_only(bench):
    curve = pts((10, 8.0), (20, 6.0), (30, 5.0))
    assert bench.loss_at(curve, 15) == pytest.approx(7.0)
    assert bench.loss_at(curve, 30) == pytest.approx(5.0)
    assert bench.loss_at(curve, 10) == pytest.approx(8.0)
    assert bench.loss_at(curve, 5) is None and bench.loss_at(curve, 31) is None


def test_compare_against_the_fixed_length_run(bench):
    curves = {"a": pts((10, 7.0), (20, 5.5), (30, 5.0)), "b": pts((20, 7.0), (40, 6.0), (60, 5.5)),
              "c": pts((15, 7.5), (45, 6.5), (70, 6.0))}
    f = bench.compare(curves)
    assert f["target_loss"] == 5.5 and f["baseline_time_s"] == 60 and f["equal_wall_s"] == 30
    a, b, c = (f["variants"][n] for n in "abc")
    assert (a["time_to_target_s"], a["share_of_baseline"]) == (20, pytest.approx(1 / 3))
    assert (b["time_to_target_s"], b["share_of_baseline"]) == (60, 1.0)
    assert c["time_to_target_s"] is None and c["share_of_baseline"] is None
    assert a["loss_at_equal_wall"] == 5.0 and b["loss_at_equal_wall"] == pytest.approx(6.5)
    assert c["loss_at_equal_wall"] == pytest.approx(7.0)  # half way from 7.5 at 15 s to 6.5 at 45 s
    lines = bench.verdicts(f, {"a": "128 -> 512", "b": "512 only", "c": "paper"})
    assert "0.33x (b)'s 60.0 s: within the 0.7x goal" in lines[0]
    assert "never reaches" in lines[1] and "not within" in lines[1]
    without_b = bench.compare({"a": curves["a"], "c": curves["c"]})
    assert without_b["target_loss"] is None and without_b["variants"]["a"]["time_to_target_s"] is None
    assert "was not run" in bench.verdicts(without_b, {"a": "", "c": ""})[0]
