"""Every bench script runs end to end in its tiny mode (``--tiny``) and prints its result.

One test per ``bench/*.py`` (``bench/_*.py``, the harness and the parts of benches, aside), found by a glob: a new
bench is tested without an edit here, and so needs a ``--tiny`` mode (see bench/_common.py: ``tiny_defaults``)
that ends with a JSON line ``{"bench": "<its file name>", ...}``. ``RESULTS`` names what each known
bench prints instead or besides (its table header, its JSON line): output that a bench which parsed
its flags and did nothing would not print. Each runs as ``python bench/NAME.py --tiny`` from the
repository root, this checkout first on PYTHONPATH; none may write into the checkout's runs/ or data/
(the tiny modes work in temporary directories).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))

RESULTS = {  # bench -> (the "bench" of its JSON lines, text its output must hold)
    "ablation": ("ablation", "eval loss by length:"),
    "chaos": ("chaos", "violations: 0"),
    "checkpoint_stall": ("checkpoint_stall", "less with checkpoint.async"),
    "curriculum": ("curriculum", "the 0.7x goal"),
    "context_extension": ("context_extension", "(d) fork, yarn x3"),
    "ds_zero3_fp32_master": ("ds_zero3_fp32_master", "duplicated"),
    "dry_run_memory": ("dry_run_memory", '"ok": true'),  # the estimate within 15 % of the measured peaks
    "e2e": ("e2e", "roformer-train / bare step"),
    "finetune_ner": ("finetune_ner", "labelled examples  dictionary F1"),
    "finetune_reviews": ("finetune_reviews", "labelled examples"),
    "gpu_check": ("gpu_backend_equality", '"ok": true'),
    "hf_tokenizer": ("hf_tokenizer", "identical %"),
    "hf_trainer_mlm": (None, '"step_end": ['),  # the JSON it writes for bench/e2e.py: no "bench" key
    "linear_attention": ("linear_attention", "eval MLM acc"),
    "loader": ("loader", "tar read, webdataset"),
    "packing": ("packing", "trained x eval packing"),
    "parity": ("parity", "ours no worse than HF's by more than the run-to-run spread"),
    "parallel_memory": ("parallel_memory", "params MiB/rank"),
    "recipe": ("recipe", "the 100 % branch equals (c) of seed"),
    "profile_e2e": ("profile_e2e", "Where a step goes"),
    "rope_decay": ("rope_decay", "relative upper bound B(r)"),
    "rotary": ("rotary", "fwd+bwd ms"),
    "shards": ("shards", "MB/s/worker cpu"),
    "startup": ("startup", "first step, debug config, 2 ranks"),
    "step": ("step", "losses agree"),
    "zero_memory": ("zero_memory", "total B/p"),
}
SLOW = {"ablation", "chaos", "checkpoint_stall", "context_extension", "curriculum", "parity", "e2e", "linear_attention", "packing", "profile_e2e",
        "recipe"}
"""About 30 s or more on 2 quiet cores, tiny as they are (several training processes each; twice that on a
busy machine)."""
NEEDS = {"e2e": "accelerate", "hf_trainer_mlm": "accelerate", "profile_e2e": "accelerate", "parity": "accelerate"}
"""Packages beyond the core ones (the HF Trainer needs accelerate)."""
TIMEOUT = 540
"""Seconds a bench's tiny run may take (the slowest take ~80 s on 2 quiet cores; make test runs them at a lower
CPU priority beside the other lanes, which may hold both cores for minutes), under pytest's 600 s per test."""
COVERED = {"hf_trainer_mlm": "e2e"}
"""Benches whose whole code path another bench's tiny run takes (hf_trainer_mlm is the HF side of bench/e2e.py,
which runs it, crashes one of its runs and checks its figures): their own tiny run is left out."""

CHECKOUT_OUTPUT = re.compile(r"(?<![\w./-])(?:runs|data)/|" + re.escape(str(ROOT / "runs")) + "|"
                             + re.escape(str(ROOT / "data")))
"""A path into the checkout's runs/ or data/ (relative or absolute), printed where a bench names its output."""


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:  # a Python dict printed by a library (HF's log lines), not JSON
                pass
    return out


TINY_FLAGS = {"e2e": ("--crash", "hf_ds")}
"""More flags of a bench's tiny run: e2e's makes the first attempt of an HF run crash for real (the retry is
checked by ``check_e2e``, in the same run)."""


def run_tiny(name: str, *flags: str) -> subprocess.CompletedProcess:
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, f"bench/{name}.py", "--tiny", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


WALL_CLOCK = {"chaos"}
"""Benches whose tiny runs check what wall time decides (the fault campaign: hang timeouts, straggler ratios):
``make test`` runs them at normal CPU priority (tests/tools/lanes.py)."""


def _marks(name: str) -> list:
    return ([pytest.mark.slow] if name in SLOW else []) + ([pytest.mark.wall_clock] if name in WALL_CLOCK else [])


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in BENCHES])
def test_bench_runs_in_tiny_mode(name):
    if name in COVERED:
        pytest.skip(f"bench/{name}.py runs inside test_bench_runs_in_tiny_mode[{COVERED[name]}]")
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"bench/{name}.py needs {NEEDS[name]!r}, which is not installed: pip install -e '.[dev]'")
    r = run_tiny(name, *TINY_FLAGS.get(name, ()))
    tail = f"\n--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
    assert r.returncode == 0, f"bench/{name}.py --tiny exited with status {r.returncode}{tail}"
    bench, marker = RESULTS.get(name, (name, None))
    lines = json_lines(r.stdout)
    if bench is not None:
        assert any(x.get("bench") == bench for x in lines), f'no JSON line {{"bench": "{bench}", ...}}{tail}'
    else:
        assert lines, f"no JSON line{tail}"
    if marker is not None:
        assert marker in r.stdout, f"{marker!r} not in the output{tail}"
    found = CHECKOUT_OUTPUT.search(r.stdout)
    assert found is None, f"the tiny run names a path in the checkout ({found.group(0)!r}){tail}"
    if name in CHECKS:
        CHECKS[name](lines, tail, r.stdout)


def test_every_bench_has_its_expected_result():
    """RESULTS and SLOW name benches that exist (a renamed bench would otherwise lose its checks)."""
    assert set(RESULTS) | set(CHECKS) | SLOW | set(NEEDS) | set(COVERED) <= set(BENCHES)
    assert set(COVERED.values()) <= set(BENCHES) - set(COVERED)


def check_packing(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/packing.py: both modes timed on the same batches, the document mode's attention work below
    the full rows' where a row packs several documents (blocks), and finite losses for every (trained,
    eval) packing pair, on the same eval batches (equal unigram baselines)."""
    import math

    parts = {x["part"]: x for x in lines if x.get("bench") == "packing"}
    assert set(parts) == {"step", "quality"}, tail
    rows = parts["step"]["rows"]
    assert all(row["document_ms"] > 0 and row["cross_document_ms"] > 0 for row in rows), rows
    packed = [row for row in rows if row["form"] == "blocks" and row["docs_per_row"] > 1]
    assert packed, f"no length where the document mode ran blocks: {rows}"
    for row in packed:
        assert row["attention_gflop_ideal"] <= row["attention_gflop_document"] < row["attention_gflop_cross"], row
    cells = parts["quality"]["cells"]
    assert {(c["train"], c["eval"]) for c in cells} == {(t, e) for t in ("document", "cross_document")
                                                         for e in ("document", "cross_document")}, cells
    assert all(math.isfinite(c["loss"]) and math.isfinite(c["unigram_loss"]) for c in cells), cells
    for c in cells:
        same = [d for d in cells if d["eval"] == c["eval"] and d["length"] == c["length"]]
        assert {d["unigram_loss"] for d in same} == {c["unigram_loss"]}, same


CHECKS = {"packing": check_packing}
"""bench -> a check of its JSON lines beyond RESULTS' (what its figures must satisfy)."""


def check_startup(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/startup.py --tiny: one launch of 2 ranks, its start-up from the launcher's start to rank 0's first
    step: positive, and shorter than the whole launch's wall time would allow (well under a minute)."""
    (line,) = [x for x in lines if x.get("bench") == "startup"]
    assert line["launches"] == 1 and line["ranks"] == 2 and 0.5 < line["seconds"] < 60, (line, tail)


CHECKS["startup"] = check_startup


def check_profile_e2e(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/profile_e2e.py: HF's side has a step broken down (ours too once the trainer writes its trace)."""
    (line,) = [x for x in lines if x.get("bench") == "profile_e2e"]
    for side in [k for k in ("ours", "hf", "hf_ds") if k in line]:
        s = line[side]
        assert s["step_ms"] > 0 and s["linear GEMMs (addmm / mm / linear)"] > 0, (side, s, tail)
    assert "hf_ds" in line or "hf" in line, tail


CHECKS["profile_e2e"] = check_profile_e2e


def check_recipe(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/recipe.py --tiny: (a) and (c) with two seeds each (different losses: the seed matters), each seed's
    difference from (a) of the same seed, three decay branches of one stable run (12 steps: branched at 4, 6 and
    10) beside separate runs of the 40 % and 70 % budgets, and the 100 % branch ending exactly where (c) of the
    first seed ends."""
    import math

    (line,) = [x for x in lines if x.get("bench") == "recipe"]
    losses, branches = line["losses"], line["branches"]
    assert set(losses) == {"a", "c"} and all(len(v) == 2 and v[0] != v[1] for v in losses.values()), tail
    assert line["minus_a"] == {n: [x - a for x, a in zip(v, losses["a"])] for n, v in losses.items()}, tail
    assert [(b["branch_step"], b["decay_steps"]) for b in branches] == [(4, 1), (6, 2), (10, 2)], tail
    assert all(math.isfinite(b["loss"]) for b in branches) and branches[-1]["loss"] == losses["c"][0], tail
    assert [b.get("separate") is not None for b in branches] == [True, True, False], tail


CHECKS["recipe"] = check_recipe


def check_curriculum(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/curriculum.py --tiny: the three variants (8 steps of 256 tokens each) evaluated at the same steps
    (every 2: the same tokens), training time growing along each curve, finite losses, (b) reaching its own
    final loss in its own time, and the loss at equal wall time taken at the first variant to finish."""
    import math

    (line,) = [x for x in lines if x.get("bench") == "curriculum"]
    assert line["variants"] == ["a", "b", "c"] and line["tokens"] == 8 * 256, tail
    for name, pts in line["eval_points"].items():
        steps, seconds, losses = zip(*pts)
        assert {2, 4, 6, 8} <= set(steps) and steps[-1] == 8, (name, pts)
        assert all(b >= a for a, b in zip(seconds, seconds[1:])) and seconds[-1] > seconds[0], (name, pts)
        assert all(math.isfinite(x) for x in losses), (name, pts)
    assert line["share_of_b"]["b"] == 1.0 and line["baseline"] > 0, tail
    assert line["equal_wall_s"] == min(line["train_s"].values()), tail
    assert line["reached"] == (line["ratio"] > 0), tail
    assert "eval loss at 128 tokens" in stdout and "the 0.7x goal" in stdout, tail


CHECKS["curriculum"] = check_curriculum


def check_parity(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/parity.py: four runs (two seeds per side, the seeds different), finite training and eval losses,
    every model evaluated on the same masked tokens (our model natively and in its HF form agreeing), and a
    verdict for both measures."""
    import math

    (line,) = [x for x in lines if x.get("bench") == "parity"]
    runs = line["runs"]
    assert sorted((r["side"], r["seed"]) for r in runs) == [("hf", 0), ("hf", 1), ("ours", 0), ("ours", 1)], tail
    assert len(set(line["seeds"])) == len(line["seeds"]) == 2, tail
    for r in runs:
        assert math.isfinite(r["train_loss_last"]) and math.isfinite(r["eval_loss"]), (r, tail)
        assert 0 < r["eval_loss"] < 20 and r["wall_s"] > 0, (r, tail)
    masked = {r["eval_masked_tokens"] for r in runs}
    assert masked == {line["eval_masked_tokens"]} and line["eval_masked_tokens"] > 0, tail
    assert len({r["eval_loss"] for r in runs}) > 1, f"four runs, one eval loss: the seeds changed nothing{tail}"
    assert line["native_check"]["ok"], tail
    assert isinstance(line["verdict"], bool) and isinstance(line["train"]["verdict"], bool), tail
    assert abs(line["ratio"] - line["baseline"] / line["ours"]) < 2e-3, tail
    assert "ours no worse than HF's by more than the run-to-run spread:" in stdout, tail


CHECKS["parity"] = check_parity


def test_step_times_packed_documents_against_no_mask_in_tiny_mode():
    """bench/step.py --documents N: the same model and ids with rows packed with documents of ~N tokens (planned
    on the host as the loader plans them) against no mask, a JSON line of both times and their ratio; the kernel
    through --document-attention (the config loader names a bad value; flex, which has no backward on CPU, is
    refused with the model's message); HF, which has no document masks, refused."""
    r = run_tiny("step", "--ours-only", "--documents", "8", "--document-attention", "blocks", "--no-memory")
    tail = f"\n--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
    assert r.returncode == 0, tail
    lines = json_lines(r.stdout)
    (doc,) = [x for x in lines if x.get("bench") == "step_documents"]
    (ours,) = [x for x in lines if x.get("bench") == "step_ours"]
    assert doc["baseline"] == ours["ours"] and doc["ratio"] == pytest.approx(doc["baseline"] / doc["ours"], rel=1e-3, abs=1e-3)  # (3 decimals)
    assert 2 < doc["docs_per_row"] < 32 and doc["form"] in ("blocks", "dense") and doc["document_attention"] == "blocks"
    assert doc["tokens_per_s"] > 0 and doc["tokens_per_s_no_mask"] == ours["tokens_per_s"], tail
    for flags, message in [(("--document-attention", "bogus"), "model.document_attention: expected one of"),
                           (("--document-attention", "flex"), "model.document_attention: flex"),
                           ((), "--documents: HF has no document masks")]:
        r = run_tiny("step", *(["--ours-only"] if flags else []), "--documents", "8", "--no-memory", *flags)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_e2e_watch_retries_a_real_abort_once_and_raises_at_the_second(tmp_path, monkeypatch):
    """bench/e2e.py's runner: an attempt that aborts (SIGABRT) is cleaned up, noted and run again; a second
    failure raises RunFailed naming the signal and the end of its stderr (the bench then reports it)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    marker = tmp_path / "failed_once"
    flaky = [sys.executable, "-c", f"import os, pathlib, sys; p = pathlib.Path({str(marker)!r}); "
             "sys.exit(0) if p.exists() else (p.touch(), print('dying now', file=sys.stderr), os.abort())"]
    cleaned = []
    res = e2e._watch(flaky, tmp_path / "log.txt", dict(os.environ), lambda: cleaned.append(True))
    assert cleaned == [True] and res["retried"] == "killed by SIGABRT: dying now", res
    assert (tmp_path / "log.txt.err.attempt1").read_text().strip() == "dying now"
    with pytest.raises(e2e.RunFailed, match="status 3: bad input .the same at its first attempt"):
        e2e._watch([sys.executable, "-c", "import sys; print('bad input', file=sys.stderr); sys.exit(3)"],
                   tmp_path / "log2.txt",
                   dict(os.environ), lambda: cleaned.append(True))
    assert cleaned == [True, True]
    with pytest.raises(e2e.RunFailed, match="still running after 1 s"):
        e2e._watch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log3.txt", dict(os.environ),
                   lambda: None, timeout=1.0)


def test_recipe_ner_lines_take_the_f1_of_each_model_and_skip_the_example_counts(monkeypatch):
    """bench/recipe.py --ner prints one line per recipe from roformer_dist.demo.results.ner_downstream's result,
    whose models sit beside the example counts (an int there once ended a 2-hour bench at its last line)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import recipe

    model = {"f1": 0.61428, "precision": 0.6225, "recall": 0.6062, "seconds": 84.1}
    ner = {"a": {"pretrained": dict(model, f1=0.555), "random_init": dict(model, f1=0.4629), "train_examples": 1000,
                 "dev_examples": 1000},
           "d": {"pretrained": model, "dictionary": dict(model, f1=0.5735), "train_examples": 1000}}
    assert recipe.ner_lines(ner) == ["NER (a), entity F1: pretrained 0.5550, random_init 0.4629",
                                     "NER (d), entity F1: pretrained 0.6143, dictionary 0.5735"]


def test_e2e_compile_adds_the_compiled_configurations_with_their_switches(tmp_path, monkeypatch):
    """--compile: ours with trainer.compile=true, HF with TrainingArguments(torch_compile=True), each compared
    with its own kind."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    a = e2e.parse_args(["--compile", "--seq", "128"])
    assert a.configs == ["ours", "hf", "hf_ds", "ours_compile", "hf_compile"]
    assert e2e.ours_config(a, 128, 2, tmp_path, tmp_path / "r", compile=True)["trainer"]["compile"] is True
    assert "compile" not in e2e.ours_config(a, 128, 2, tmp_path, tmp_path / "r")["trainer"]
    assert "--torch-compile" in e2e.hf_command(a, 128, tmp_path, tmp_path, tmp_path, deepspeed=False, compile=True)
    assert "--torch-compile" not in e2e.hf_command(a, 128, tmp_path, tmp_path, tmp_path, deepspeed=False)
    assert {c: e2e.OURS_OF[c] for c in ("hf", "hf_compile")} == {"hf": "ours", "hf_compile": "ours_compile"}


def test_e2e_on_a_gpu_runs_both_sides_in_bf16_synchronized_and_reports_their_losses(tmp_path, monkeypatch):
    """--device cuda --precision bf16: ours with deepspeed.precision bf16 and its losses read every step, HF with
    bf16, the device and its per-step losses; the CPU job stays as it was; each side's loss over its last
    LOSS_STEPS steps in the summary; part 2 (CPU bare steps) refused on CUDA."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    cpu = e2e.parse_args(["--seq", "512"])
    conf = e2e.ours_config(cpu, 512, 2, tmp_path, tmp_path / "r")
    assert conf["deepspeed"] == "zero2" and conf["trainer"]["log_every"] == 10 and "num_workers" not in conf["data"]
    assert not {"--device", "--bf16", "--record-loss"} & set(e2e.hf_command(cpu, 512, tmp_path, tmp_path, tmp_path,
                                                                          deepspeed=False))
    gpu = e2e.parse_args(["--part", "e2e", "--device", "cuda", "--precision", "bf16", "--ranks", "1", "--seq", "512",
                          "--num-workers", "4", "--shards", str(tmp_path / "set")])
    conf = e2e.ours_config(gpu, 512, 1, e2e.shard_set(gpu), tmp_path / "r")
    assert conf["deepspeed"] == {"preset": "zero2", "precision": "bf16"} and conf["trainer"]["log_every"] == 1
    assert conf["data"]["num_workers"] == 4 and conf["data"]["shards"] == str(tmp_path / "set")
    cmd = e2e.hf_command(gpu, 512, tmp_path, tmp_path, tmp_path, deepspeed=False)
    assert cmd[cmd.index("--device") + 1] == "cuda" and {"--bf16", "--record-loss"} <= set(cmd)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "cuda"])  # --part all: the bare steps of part 2 are CPU only
    runs = [{"launch": 0.0, "step_end": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], "loss": [9, 9, 5, 4, 3, 2, 1],
             "ranks": []}, {"launch": 0.0, "step_end": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], "ranks": []}]
    a = e2e.parse_args(["--tiny", "--steps", "7"])
    assert e2e.summarize(a, runs[:1], 64)["loss"] == pytest.approx(3.0)  # steps 3-7 of 7
    assert e2e.summarize(a, runs[1:], 64)["loss"] is None  # HF on CPU records no per-step loss


def check_e2e(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/e2e.py --tiny --crash hf: an HF rank aborts (os.abort, SIGABRT) in the first attempt of its
    first run; the run goes again, the bench ends normally, and its row and JSON line say "retried" with the
    end of the failed attempt's stderr."""
    (line,) = [x for x in lines if x.get("bench") == "e2e"]
    assert [(n["config"], n["what"]) for n in line["retried"]] == [("hf_ds", "retried after")], tail
    assert "SIGABRT" in line["retried"][0]["why"] and line["failed"] == [], tail
    assert line["per_seq"]["64"]["hf_ds"]["tokens_per_s"] > 0, tail
    assert re.search(r"HF Trainer \+ DeepSpeed ZeRO-2 .* retried \[1\]", stdout), tail
    assert "[1] seq 64, HF Trainer + DeepSpeed ZeRO-2, round 1: retried after: " in stdout, tail


CHECKS["e2e"] = check_e2e


def test_e2e_a_run_that_fails_twice_is_reported_and_the_bench_goes_on(tmp_path, monkeypatch, capsys):
    """Part 1 with a configuration whose run failed twice (run_one's {"failed": ...}) and one that was
    retried: the table has both rows, marked, with footnotes; no ratio without ours; the others' figures stay."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    a = e2e.parse_args(["--tiny", "--part", "e2e", "--configs", "ours", "hf", "hf_ds"])
    fake = {"ours": {"failed": "killed by SIGABRT: rank 1 (the same at its first attempt)"},
            "hf": {"launch": 0.0, "step_end": [1.0, 2.0, 3.0, 4.0], "ranks": [], "retried": "status 1: boom"},
            "hf_ds": {"launch": 0.0, "step_end": [1.0, 1.5, 2.0, 2.5], "ranks": [], "retried": None}}
    monkeypatch.setattr(e2e, "run_one", lambda a, c, *args: fake[c])
    monkeypatch.setattr(e2e, "vocab_size", lambda shards: 3000)
    monkeypatch.setattr(e2e, "hf_model_dir", lambda a, work, vocab: work)
    out = e2e.part_e2e(a, tmp_path, tmp_path, tmp_path)
    text = capsys.readouterr().out
    res = out["per_seq"][64]
    assert res["ratio"] is None and res["faster_hf"] == "hf_ds" and "failed" in res["results"]["ours"]
    assert res["results"]["hf_ds"]["tokens_per_s"] == pytest.approx(4 * 64 / 0.5)
    assert [(n["config"], n["what"]) for n in out["notes"]] == [("ours", "failed"), ("hf", "retried after")]
    assert re.search(r"roformer-train +- .* failed \[1\]", text), text
    assert re.search(r"HF Trainer \(DDP, gloo\) .* retried \[2\]", text), text
    assert "[1] seq 64, roformer-train, round 1: failed: killed by SIGABRT" in text, text


def test_profile_summary_self_times_categories_and_backward_by_sequence_number(tmp_path, monkeypatch):
    """bench/profile_e2e.py's summary on a hand-made trace: self times (children subtracted), the innermost
    naming event wins, a backward function takes its forward op's category (sequence numbers), a GEMM with
    the vocabulary in its shapes is the vocabulary projection, step markers' own time is outside any op."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import profile_e2e as P

    def ev(name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        {**ev("optimizer_step_1", 0, 1000), "cat": "user_annotation"},
        ev("aten::linear", 10, 300, **{"Sequence number": 1, "Fwd thread id": 0, "Input Dims": [[8, 32], [50, 32]]}),
        ev("aten::addmm", 20, 280, **{"Input Dims": [[50], [8, 32], [32, 50]]}),
        {**ev("rotary: apply", 400, 100), "cat": "user_annotation"},
        ev("aten::mul", 410, 60, **{"Sequence number": 2, "Fwd thread id": 0}),
        ev("autograd::engine::evaluate_function: MulBackward0", 600, 100, **{"Sequence number": 2}),
        ev("aten::mul", 610, 80),
        ev("autograd::engine::evaluate_function: NativeLayerNormBackward0", 700, 50, **{"Sequence number": 3}),
        ev("aten::copy_", 800, 40),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    s = P.summarize_trace(trace, steps=2, vocab=50)
    assert s["step_ms"] == pytest.approx(0.5)  # 1000 us over 2 steps
    assert s[P.VOCAB] == pytest.approx((20 + 280) / 2e3)  # linear's own 20 us and addmm's 280
    assert s["rotary"] == pytest.approx((40 + 60 + 20 + 80) / 2e3)  # forward label and mul; backward by seq 2
    assert s["layer norm"] == pytest.approx(50 / 2e3) and s[P.OTHER] == pytest.approx(40 / 2e3)
    assert sum(v for k, v in s.items() if k != "step_ms") == pytest.approx(s["step_ms"])


def test_profile_summary_of_a_real_trace_finds_every_part_of_an_hf_step(tmp_path, monkeypatch):
    """The summary of a torch.profiler trace of two steps of a tiny HF RoFormer (HF's rotary labelled as
    bench/hf_trainer_mlm.py labels it, a DataLoader, AdamW): every category of a step is found, little is left
    over."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import profile_e2e as P
    import torch
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    import hf_trainer_mlm

    hf_trainer_mlm.label_hf_rotary()
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=700, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=128)).train()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(5, 700, (16, 32))
    loader = torch.utils.data.DataLoader(ids, batch_size=8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for step, batch in enumerate(loader):
            with torch.profiler.record_function(f"optimizer_step_{step + 1}"):
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    s = P.summarize_trace(tmp_path / "trace.json", steps=2, vocab=700)
    for cat in ("data loading / collate", "optimizer step", "rotary", "loss", "attention (sdpa / matmul + softmax)",
                "layer norm", "dropout", "GELU", "embedding", P.GEMM, P.VOCAB):
        assert s.get(cat, 0) > 0, (cat, s)
    assert s[P.OTHER] < 0.25 * s["step_ms"], s
    assert sum(v for k, v in s.items() if k != "step_ms") == pytest.approx(s["step_ms"])


def check_chaos(lines: list[dict], tail: str, stdout: str) -> None:
    """bench/chaos.py --tiny: 8 faults or more were delivered, one of each kind among them (a signal, a stopped
    rank, a slowed rank named by the straggler warning, a fault point, a second fault during a recovery, a
    flipped bit, a damaged checkpoint, a stale lock, a kill during the JIT build, a full disk where a tmpfs
    could be mounted), every launch
    relaunched to the end, and the oracle found nothing; the work a fault cost is bounded by the save interval (2 steps, one more
    while an asynchronous save is in flight, 2 more when a damaged newest checkpoint makes the run fall back to
    the one before)."""
    (line,) = [x for x in lines if x.get("bench") == "chaos"]
    kinds = {k.partition(":")[0] for k in line["by_kind"]}
    every = {"time", "point", "recovery", "flip", "damage", "stale-lock", "jit-build"}
    every |= {"disk-full"} if line["disk_faults"] else set()
    assert line["faults"] >= 8 and every <= kinds, (sorted(every - kinds), line)
    assert any(k.endswith("stop-rank") for k in line["by_kind"]), line
    assert any(k.endswith("slow-rank") for k in line["by_kind"]), line
    slow = line["slow_rank"]  # (one layout, no pipeline: every slowed rank delivered was named)
    assert slow["slowed"] >= 1 and slow["named"] == slow["slowed"] and slow["pipeline"] == 0, line
    assert line["violations"] == 0 and line["relaunches"] >= line["faults"] // 2, line
    assert line["steps_redone_max"] <= 5, line


CHECKS["chaos"] = check_chaos


@pytest.mark.slow
@pytest.mark.wall_clock
def test_chaos_spike_variant_in_tiny_mode():
    """bench/chaos.py --tiny --spike rollback --faults 1 (about 50 s): the uninterrupted run and an episode with a
    fault, both with trainer.spike=rollback and two loss spikes injected, rolled back at each (reference() exits 1
    otherwise) and end with the same losses and weights (the oracle)."""
    r = run_tiny("chaos", "--spike", "rollback", "--faults", "1")
    tail = f"\n--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
    assert r.returncode == 0, f"bench/chaos.py --tiny --spike rollback exited with status {r.returncode}{tail}"
    (line,) = [x for x in json_lines(r.stdout) if x.get("bench") == "chaos"]
    assert line["spike"] == "rollback" and line["faults"] >= 1 and line["violations"] == 0, line
    assert "violations: 0" in r.stdout, tail
