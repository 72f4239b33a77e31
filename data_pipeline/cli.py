"""``roformer-data``: tokenizer | shards | prepare | inspect.

    roformer-data prepare --input corpus/ --vocab-size 32000 --out data/shards
    roformer-data inspect --verify data/shards
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

log = logging.getLogger("roformer-data")


def _corpus_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("corpus")
    g.add_argument("--input", "-i", nargs="+", required=True,
                   help="files, directories or globs: .txt / .jsonl / People's Daily tagged text, optionally .gz")
    g.add_argument("--format", default="auto", choices=("auto", "txt", "jsonl", "pd"),
                   help="input format (auto: .jsonl by extension, People's Daily by its word/tag lines, else txt)")
    g.add_argument("--doc-boundary", default="line", choices=("line", "blank"),
                   help="txt: one document per line, or documents separated by blank lines")
    g.add_argument("--jsonl-field", default="text", help="jsonl: the field holding the text")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first invalid UTF-8 / JSON line instead of skipping and counting it")
    g.add_argument("--jieba", action="store_true",
                   help="jieba word pre-segmentation (WoBERT style; needs `pip install jieba`)")


def _tokenizer_args(p: argparse.ArgumentParser, vocab_required: bool) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, required=vocab_required, default=None if vocab_required else 32000,
                   help="vocabulary size (a soft limit: a small corpus may give fewer pieces)")
    g.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"), help="SentencePiece model type")
    g.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters the vocabulary covers (rare ones fall back to bytes)")
    g.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to [UNK] instead")
    g.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    g.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="training threads")


def _shard_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)), help="tokenising processes")
    g.add_argument("--shard-size-mb", type=float, default=64.0, help="target MB of token ids per shard")
    g.add_argument("--max-docs-per-shard", type=int, default=None, help="also cap documents per shard")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _texts(args):
    from .corpus import CorpusStats, read_documents

    stats = CorpusStats()
    return stats, (d.text for d in read_documents(args.input, args.format, args.doc_boundary, args.jsonl_field,
                                                   args.strict, stats))


def _train(args, out_prefix: Path) -> Path:
    from .tokenizer import train_tokenizer

    stats, texts = _texts(args)
    model = train_tokenizer(texts, out_prefix, args.vocab_size, model_type=args.model_type,
                            character_coverage=args.character_coverage, byte_fallback=not args.no_byte_fallback,
                            input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
                            jieba=args.jieba)
    print(f"tokenizer: {model} ({stats.summary()})")
    return model


def _build(args, tokenizer: Path) -> dict:
    from .corpus import CorpusStats
    from .shards import build_shards

    stats = CorpusStats()
    m = build_shards(args.input, tokenizer, args.out, workers=args.workers, shard_size_mb=args.shard_size_mb,
                     max_docs_per_shard=args.max_docs_per_shard, fmt=args.format, doc_boundary=args.doc_boundary,
                     jsonl_field=args.jsonl_field, strict=args.strict, jieba=args.jieba,
                     progress=not args.no_progress, stats=stats)
    el = m["_build_seconds"]
    print(f"shards: {args.out}: {len(m['shards'])} shards, {m['num_docs']} documents, {m['num_tokens']} tokens, "
          f"vocab {m['vocab_size']} ({m['dtype']}); {el:.1f} s, {m['text_bytes'] / el / 1e6:.2f} MB of text/s, "
          f"{m['num_tokens'] / el / 1e3:.0f}k tokens/s")
    print(f"corpus: {stats.summary()}")
    return m


def cmd_tokenizer(args) -> int:
    out = Path(args.out)
    _train(args, out.with_suffix("") if out.suffix == ".model" else out)
    return 0


def cmd_shards(args) -> int:
    _build(args, Path(args.tokenizer))
    return 0


def cmd_prepare(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = _train(args, out / "tokenizer")
    _build(args, model)
    return 0


def cmd_inspect(args) -> int:
    from .shards import read_manifest, read_shard, tokenizer_path, verify_shard_set
    from .tokenizer import Tokenizer

    m = read_manifest(args.dir)
    print(f"shard set {args.dir}: format {m['format']}, {len(m['shards'])} shards, {m['num_docs']} documents, "
          f"{m['num_tokens']} tokens, vocab {m['vocab_size']} ({m['dtype']}), word marks: {m['wwm']}")
    print(f"tokenizer: {m['tokenizer']['path']} sha256 {m['tokenizer']['sha256']}")
    print(f"special ids: {m['special_ids']}")
    if args.verify:
        problems = verify_shard_set(args.dir)
        for p in problems:
            print(f"ERROR: {p}", file=sys.stderr)
        if problems:
            print(f"verify: {len(problems)} problem(s)", file=sys.stderr)
            return 1
        print(f"verify: OK ({len(m['shards'])} shards re-hashed and parsed, totals match)")
    first = m["shards"][0]
    try:
        sd = read_shard(Path(args.dir) / first["name"], m["dtype"], first, verify_hash=False)
    except ValueError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    lens = sd.lengths
    if len(lens):
        edges = [0, 16, 32, 64, 128, 256, 512, 1024, 1536, 4096, np.inf]
        hist, _ = np.histogram(lens, bins=edges)
        print(f"document length (tokens) in {first['name']}: mean {lens.mean():.1f}, median {np.median(lens):.0f}, "
              f"max {lens.max()}")
        for lo, hi, c in zip(edges[:-1], edges[1:], hist):
            if c:
                print(f"  [{lo:>5}, {hi:>5}) {c:>8} {'#' * int(40 * c / hist.max())}")
    tok = tokenizer_path(args.dir, m)
    if tok is not None and tok.is_file() and args.samples:
        tk = Tokenizer(tok)
        for i in range(min(args.samples, sd.num_docs)):
            ids = sd.tokens[sd.tok_start[i]:sd.tok_start[i] + sd.lengths[i]]
            text = tk.decode(ids)
            print(f"  doc {i} ({len(ids)} tokens): {text[:120]}{'...' if len(text) > 120 else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="roformer-data", description="Chinese corpus -> SentencePiece tokenizer -> "
                                 "webdataset shards for roformer-dist pretraining.")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{tokenizer,shards,prepare,inspect}")

    p = sub.add_parser("tokenizer", help="train a SentencePiece tokenizer",
                       description="Train a SentencePiece model ([PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4) on the "
                                   "normalised corpus.")
    _corpus_args(p)
    _tokenizer_args(p, vocab_required=True)
    p.add_argument("--out", "-o", required=True, help="model path or prefix (writes PREFIX.model and PREFIX.vocab)")
    p.set_defaults(fn=cmd_tokenizer)

    p = sub.add_parser("shards", help="tokenise a corpus into a shard set",
                       description="Tokenise in parallel into webdataset tar shards + manifest.json (written last).")
    _corpus_args(p)
    p.add_argument("--tokenizer", "-t", required=True, help="SentencePiece .model (copied into the shard set)")
    p.add_argument("--out", "-o", required=True, help="shard-set directory")
    _shard_args(p)
    p.set_defaults(fn=cmd_shards)

    p = sub.add_parser("prepare", help="tokenizer + shards in one go",
                       description="Train the tokenizer (OUT/tokenizer.model) and write the shard set into OUT.")
    _corpus_args(p)
    _tokenizer_args(p, vocab_required=True)
    p.add_argument("--out", "-o", required=True, help="shard-set directory (the tokenizer goes inside)")
    _shard_args(p)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("inspect", help="totals, length histogram, decoded samples; --verify re-hashes everything",
                       description="Show a shard set. With --verify, re-hash and parse every shard and the "
                                   "tokenizer; exit 1 naming each missing, truncated or mismatched file.")
    p.add_argument("dir", help="shard-set directory")
    p.add_argument("--verify", action="store_true", help="re-hash and parse every shard")
    p.add_argument("--samples", type=int, default=3, help="decoded documents to show")
    p.set_defaults(fn=cmd_inspect)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"roformer-data {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
