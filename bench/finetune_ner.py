"""Where pretraining pays for named entities: People's Daily NER (PER/LOC/ORG from the corpus's own
``nr``/``ns``/``nt`` tags) against the number of labelled sentences. At each training size, the pretrained
export fine-tuned with ``roformer-finetune --task token``, the same architecture from random initialisation
(same budget) and the dictionary baseline (longest match of the training entities), all scored as entity F1
on one held-out set.

    python bench/finetune_ner.py [--model runs/demo/hf --corpus data/demo/corpus --sizes 300,1000,3000]
    python bench/finetune_ner.py --data DIR     # DIR/train.jsonl (at least the largest size) and DIR/dev.jsonl
    python bench/finetune_ner.py --tiny         # sizes 20 and 60, 1 epoch, 2 seeds, on inputs of its own (below)

Without --data the sentences come from the demo's People's Daily split, as ``make demo`` draws them
(``roformer_dist.demo.tasks.ner_split``): training sentences from the lines the demo pretrains on, the held-out
sentences (--dev, 1000) from the lines it never pretrains on; the demo's own NER task is the first 1000
training sentences of the same list and the same held-out set. A training size takes the first N sentences.
F1 is the last epoch's (the held-out set selects nothing), the median over --seeds (fine-tuning seeds);
the dictionary has nothing random and runs once per size. One process, --threads torch threads. Writes
OUT/finetune_ner.png and ends with one JSON line: {"bench": "finetune_ner", "ours": pretrained median F1 at
the largest size, "baseline": from scratch at that size, "ratio", "curve": {size: {method: [F1 per seed]}}}.

--tiny builds its inputs in a temporary directory without the demo: sentences of the few hundred People's
Daily lines of _common.tiny_shards (train) and of its held-out lines (dev), and, as the "pretrained" model,
the random-initialisation export of bench/finetune_reviews.py's --tiny (``_label_curves.tiny_export``): its
scores mean nothing, the code path is the bench's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)
from _label_curves import common_flags, curve_flags, label_curve, report, settings, tiny_export  # noqa: E402

from roformer_dist.demo.tasks import ner_split, write_ner_jsonl  # noqa: E402

METHODS = {"dictionary": ["--baseline", "dict"], "pretrained": [], "from scratch": ["--from-scratch"]}


def build_data(corpus: Path, num_train: int, num_dev: int, out: Path) -> Path:
    """train.jsonl / dev.jsonl in ``out`` from the demo's corpus split (pd_train.txt, pd_eval.txt)."""
    for name in ("pd_train.txt", "pd_eval.txt"):
        if not (corpus / name).is_file():
            raise SystemExit(f"{corpus / name}: not found (run `make demo` first, or pass --data or --corpus)")
    train, dev = ner_split(corpus / "pd_train.txt", corpus / "pd_eval.txt", num_train, num_dev)
    out.mkdir(parents=True, exist_ok=True)
    write_ner_jsonl(out / "train.jsonl", train)
    write_ner_jsonl(out / "dev.jsonl", dev)
    return out


def main(argv=None) -> int:
    p = C.parser(__doc__)
    curve_flags(p, out="runs/finetune_ner", epochs=8, lr=5e-4)
    p.add_argument("--corpus", default="data/demo/corpus", help="the demo's corpus split (pd_train.txt, pd_eval.txt)")
    p.add_argument("--data", default=None, help="a directory with train.jsonl and dev.jsonl instead of --corpus")
    p.add_argument("--dev", type=int, default=1000, help="held-out sentences (with --corpus)")
    C.tiny_defaults(p, argv, model=None, sizes="20,60", out=lambda: str(C.tiny_dir() / "runs"), epochs=1,
                    batch_size=16, max_length=64, seeds="0,1", dev=40)
    args = p.parse_args(argv)
    sizes, seeds = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.seeds.split(",")]
    out = Path(args.out)
    if args.tiny:  # the tiny shards' own corpus files: pd_train.txt and pd_eval.txt
        C.tiny_shards(C.tiny_dir() / "shards")
        args.corpus = str(C.tiny_dir() / "shards")
        args.model = args.model or str(tiny_export(C.tiny_dir() / "hf"))
    data = Path(args.data) if args.data else build_data(Path(args.corpus), max(sizes), args.dev, out / "data")
    for name in ("train.jsonl", "dev.jsonl"):
        if not (data / name).is_file():
            raise SystemExit(f"{data / name}: not found")
    common = ["--task", "token", *common_flags(args, data)]
    methods = {name: (extra if name == "dictionary" else ["--model", args.model, *extra])
               for name, extra in METHODS.items()}
    curve, seconds = label_curve(methods, sizes, seeds, data / "train.jsonl", out, common, "last_dev_f1",
                                 deterministic={"dictionary"})
    print(settings(args, data))
    report("finetune_ner", curve, seconds, "F1", "held-out entity F1", out / "finetune_ner.png",
           "People's Daily NER: held-out entity F1 against labelled sentences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
