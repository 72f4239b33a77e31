"""Every bench script runs end to end in its tiny mode (``--tiny``) and prints its result.

One test per ``bench/*.py`` (``bench/_common.py``, the helpers, aside), found by a glob: a new bench is
tested without an edit here, and so needs a ``--tiny`` mode (see bench/_common.py: ``tiny_defaults``)
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
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.name != "_common.py")

RESULTS = {  # bench -> (the "bench" of its JSON lines, text its output must hold)
    "ablation": ("ablation", "eval loss by length:"),
    "context_extension": ("context_extension", "(d) fork, yarn x3"),
    "ds_zero3_fp32_master": ("ds_zero3_fp32_master", "duplicated"),
    "e2e": ("e2e", "roformer-train / bare step"),
    "finetune_reviews": ("finetune_reviews", "labelled examples"),
    "gpu_check": ("gpu_backend_equality", '"ok": true'),
    "hf_tokenizer": ("hf_tokenizer", "identical %"),
    "hf_trainer_mlm": (None, '"step_end": ['),  # the JSON it writes for bench/e2e.py: no "bench" key
    "linear_attention": ("linear_attention", "eval MLM acc"),
    "loader": ("loader", "tar read, webdataset"),
    "packing": ("packing", "trained x eval packing"),
    "parallel_memory": ("parallel_memory", "params MiB/rank"),
    "rope_decay": ("rope_decay", "relative upper bound B(r)"),
    "rotary": ("rotary", "fwd+bwd ms"),
    "shards": ("shards", "MB/s/worker cpu"),
    "step": ("step", "losses agree"),
    "zero_memory": ("zero_memory", "total B/p"),
}
SLOW = {"ablation", "context_extension", "e2e", "linear_attention", "packing"}
"""About 30 s or more on 2 quiet cores, tiny as they are (several training processes each; twice that on a
busy machine)."""
NEEDS = {"e2e": "accelerate", "hf_trainer_mlm": "accelerate"}
"""Packages beyond the core ones (the HF Trainer needs accelerate)."""
TIMEOUT = 420

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


def run_tiny(name: str) -> subprocess.CompletedProcess:
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, f"bench/{name}.py", "--tiny"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in BENCHES])
def test_bench_runs_in_tiny_mode(name):
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"bench/{name}.py needs {NEEDS[name]!r}, which is not installed: pip install -e '.[dev]'")
    r = run_tiny(name)
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
        CHECKS[name](lines, tail)


def test_every_bench_has_its_expected_result():
    """RESULTS and SLOW name benches that exist (a renamed bench would otherwise lose its checks)."""
    assert set(RESULTS) | set(CHECKS) | SLOW | set(NEEDS) <= set(BENCHES)


def check_packing(lines: list[dict], tail: str) -> None:
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


def test_e2e_runs_a_failed_baseline_once_more_and_stops_at_a_second_failure(tmp_path, monkeypatch):
    """bench/e2e.py's runner: a run that fails is cleaned up and run again; a second failure ends the bench."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    marker = tmp_path / "failed_once"
    flaky = [sys.executable, "-c", f"import pathlib, sys; p = pathlib.Path({str(marker)!r}); "
             "sys.exit(0) if p.exists() else (p.touch(), sys.exit(6))"]
    cleaned = []
    e2e._watch(flaky, tmp_path / "log.txt", dict(os.environ), retry=lambda: cleaned.append(True))
    assert cleaned == [True] and marker.exists()
    with pytest.raises(SystemExit, match="exited with status 3"):
        e2e._watch([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "log2.txt", dict(os.environ),
                   retry=lambda: cleaned.append(True))
    assert cleaned == [True, True]
