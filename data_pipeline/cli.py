"""``roformer-data``: tokenizer | shards | prepare | inspect.

    roformer-data prepare --input corpus/ --vocab-size 32000 --out data/shards
    roformer-data prepare --input 'corpus/*.jsonl.gz' --vocab-size 32000 --out data/shards --slurm --tasks 64
    roformer-data inspect --verify data/shards          (or an http(s)://, pipe:, file: URL prefix)

Nothing is written over an existing shard set without ``--force``; a new set is built beside its
final place and moved there only when complete, so a failure leaves nothing behind. Exit status:
0 done, 2 usage (bad flags, an output that exists or cannot be written), 4 data error (unreadable
or empty corpus, a damaged or inconsistent shard set, an unreachable URL), 74 the disk filled up
while writing; see :mod:`.errors`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .errors import EXIT_DATA, EXIT_OK, UsageError, run_command

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
    g.add_argument("--max-line-bytes", type=_positive_int, default=None, metavar="N",
                   help="longest input line (or blank-line separated document) read, in bytes (default 1048576, "
                        "corpus.MAX_LINE_BYTES); longer ones are skipped, unread, and counted with a warning "
                        "(--strict: an error)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tokenizer_args(p: argparse.ArgumentParser, vocab_required: bool) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, required=vocab_required, default=None if vocab_required else 32000,
                   help="vocabulary size (a soft limit: a small corpus may give fewer pieces, with a warning)")
    g.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"), help="SentencePiece model type")
    g.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters the vocabulary covers (rare ones fall back to bytes)")
    g.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to [UNK] instead")
    g.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    g.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="training threads")


def _shard_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards")
    g.add_argument("--workers", type=int, default=None,
                   help="tokenising processes (default: one per CPU; with --tasks: per task, the CPUs of a SLURM "
                        "task, or this machine's CPUs shared by the local tasks)")
    g.add_argument("--shard-size-mb", type=float, default=64.0, help="target MB of token ids per shard")
    g.add_argument("--max-docs-per-shard", type=int, default=None, help="also cap documents per shard")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--force", action="store_true",
                   help="replace an existing shard set at --out (only once the new one is complete)")


def _cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (split the corpus over tasks; each writes its own shards, then one merge)")
    g.add_argument("--tasks", type=int, default=None,
                   help="tasks to split the corpus over (by files, and by line ranges of large plain files)")
    g.add_argument("--cluster", choices=("local", "slurm"), default=None,
                   help="local: the tasks as processes on this machine; slurm: a SLURM job array through submitit "
                        "(default with --tasks: slurm when sbatch exists)")
    g.add_argument("--slurm", dest="cluster", action="store_const", const="slurm", help="the same as --cluster slurm")
    g.add_argument("--profile", help="cluster profile configs/cluster/NAME.yaml (as roformer-submit)")
    g.add_argument("--partition", help="SLURM partition")
    g.add_argument("--account", help="SLURM account")
    g.add_argument("--qos", help="SLURM QoS")
    g.add_argument("--constraint", help="SLURM constraint")
    g.add_argument("--time", type=int, metavar="MINUTES", help="time limit per task")
    g.add_argument("--cpus-per-task", type=int,
                   help="CPUs of a SLURM task, also its tokenising processes (default: the profile's)")
    g.add_argument("--mem", help="memory per task, e.g. 16G")
    g.add_argument("--sample-docs", type=int, default=200_000,
                   help="documents the tokenizer is trained on before the tasks start (taken evenly from the "
                        "start of every input file)")


def _line_limit(args) -> int:
    from .corpus import MAX_LINE_BYTES

    return args.max_line_bytes or MAX_LINE_BYTES


def _texts(args):
    from .corpus import CorpusStats, read_documents

    stats = CorpusStats()
    return stats, (d.text for d in read_documents(args.input, args.format, args.doc_boundary, args.jsonl_field,
                                                   args.strict, stats, max_line_bytes=_line_limit(args)))


def _warn(stats) -> None:
    for w in stats.warnings():
        log.warning("%s", w)


def _train(args, out_prefix: Path, texts=None, stats=None) -> Path:
    from .tokenizer import train_tokenizer

    if texts is None:
        stats, texts = _texts(args)
    report: dict = {}
    model = train_tokenizer(texts, out_prefix, args.vocab_size, model_type=args.model_type,
                            character_coverage=args.character_coverage, byte_fallback=not args.no_byte_fallback,
                            input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
                            jieba=args.jieba, report=report)
    _warn(stats)
    print(f"tokenizer: {report['vocab_size']} pieces ({stats.summary()})")
    return model


def _summary(m: dict, out) -> str:
    el = max(m["_build_seconds"], 1e-9)
    return (f"shards: {out}: {len(m['shards'])} shards, {m['num_docs']} documents, {m['num_tokens']} tokens, "
            f"vocab {m['vocab_size']} ({m['dtype']}); {el:.1f} s, {m['text_bytes'] / el / 1e6:.2f} MB of text/s, "
            f"{m['num_tokens'] / el / 1e3:.0f}k tokens/s")


def _build(args, tokenizer: Path, into: Path, warn_corpus: bool = True) -> dict:
    from .corpus import CorpusStats
    from .shards import write_shards

    stats = CorpusStats()
    m = write_shards(args.input, tokenizer, into, workers=args.workers or os.cpu_count() or 1, shard_size_mb=args.shard_size_mb,
                     max_docs_per_shard=args.max_docs_per_shard, fmt=args.format, doc_boundary=args.doc_boundary,
                     jsonl_field=args.jsonl_field, strict=args.strict, jieba=args.jieba,
                     progress=not args.no_progress, stats=stats, warn_corpus=warn_corpus,
                     progress_desc=f"shards -> {args.out}", max_line_bytes=_line_limit(args))
    print(_summary(m, args.out))
    print(f"corpus: {stats.summary()}")
    return m


def cmd_tokenizer(args) -> int:
    import shutil
    import tempfile

    from .corpus import check_inputs

    out = Path(args.out)
    prefix = out.with_suffix("") if out.suffix == ".model" else out
    targets = [Path(str(prefix) + ".model"), Path(str(prefix) + ".vocab")]
    if targets[0].exists() and not args.force:
        raise UsageError(f"{targets[0]}: exists; pass --force to replace it")
    check_inputs(args.input)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.partial-", dir=prefix.parent))
    except OSError as e:
        raise UsageError(f"{out}: cannot write the tokenizer there ({e.strerror}: {e.filename})") from None
    try:
        model = _train(args, tmp / prefix.name)
        os.replace(model.with_suffix(".vocab"), targets[1])
        os.replace(model, targets[0])     # the model last: it is what users load
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {targets[0]}")
    return EXIT_OK


def cmd_shards(args) -> int:
    from .corpus import check_inputs
    from .shards import stage_output
    from .tokenizer import Tokenizer

    Tokenizer(args.tokenizer, jieba=args.jieba)
    if args.tasks:
        return _cluster(args, Path(args.tokenizer))
    with stage_output(args.out, args.force) as stage:
        check_inputs(args.input)
        _build(args, Path(args.tokenizer), stage.path)
        stage.commit()
    return EXIT_OK


def cmd_prepare(args) -> int:
    from .corpus import check_inputs
    from .shards import stage_output

    if args.tasks:
        return _cluster(args, None)
    with stage_output(args.out, args.force) as stage:   # fails now if --out exists or cannot be written
        check_inputs(args.input)                        # and if an input cannot be read
        model = _train(args, stage.path / "tokenizer")
        _build(args, model, stage.path, warn_corpus=False)
        stage.commit()
    return EXIT_OK


def _cluster(args, tokenizer) -> int:
    """--tasks N: the tokenizer trained once on a sample (prepare), the tasks, the merge (:mod:`.cluster`)."""
    import time

    from . import cluster
    from .corpus import check_inputs
    from .shards import stage_output

    if args.tasks < 1:
        raise UsageError(f"--tasks: expected a positive number, got {args.tasks}")
    if args.run_tasks is None:
        raise UsageError("--tasks: preparing over tasks needs the cluster runner of the launcher; run the "
                         "roformer-data command (launcher.prepare.main), not data_pipeline.cli directly")
    mode = args.cluster or ("slurm" if _has_sbatch() else "local")
    spec = cluster.Spec.from_args(args)
    t0 = time.time()
    with stage_output(args.out, args.force) as stage:   # beside --out: every node must see it
        check_inputs(args.input)
        if tokenizer is None:
            stats, texts = cluster.sample_texts(spec, args.sample_docs)
            _train(args, stage.path / "tokenizer", texts, stats)
        else:
            cluster.copy_tokenizer(tokenizer, stage.path)
        tasks = cluster.plan(spec, args.tasks)
        if len(tasks) < args.tasks:
            log.warning("--tasks %d: the input makes only %d task(s) (compressed files and blank-line separated "
                        "documents are not cut)", args.tasks, len(tasks))
        for t in tasks:
            print(f"task {t.index + 1}/{len(tasks)}: {t.describe()}")
        args.run_tasks(mode, spec, tasks, stage.path, args)
        m = cluster.merge(stage.path, tasks)
        stage.commit()
    for w in m["_stats"].warnings():
        log.warning("%s", w)
    print(cluster.summary(m, time.time() - t0, args.out))
    return EXIT_OK


def _has_sbatch() -> bool:
    import shutil

    return shutil.which("sbatch") is not None


def cmd_inspect(args) -> int:
    import numpy as np

    from dataclasses import replace

    from .manifest import read_manifest, read_tokenizer
    from .shards import CorruptShardError, load_shard, verify_shard_set
    from .source import default_retry, set_default_retry
    from .tokenizer import Tokenizer

    if args.url_timeout_s is not None:
        if not args.url_timeout_s > 0:
            raise UsageError(f"--url-timeout-s: expected a positive number of seconds, got {args.url_timeout_s}")
        set_default_retry(replace(default_retry(), timeout_s=args.url_timeout_s))
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
            return EXIT_DATA
        print(f"verify: OK ({len(m['shards'])} shards re-hashed and parsed, totals match, tokenizer agrees)")
    first = m["shards"][0]
    try:
        sd = load_shard(args.dir, m, 0, verify_hash=False)
    except CorruptShardError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return EXIT_DATA
    lens = sd.lengths
    if len(lens):
        edges = [0, 16, 32, 64, 128, 256, 512, 1024, 1536, 4096, np.inf]
        hist, _ = np.histogram(lens, bins=edges)
        print(f"document length (tokens) in {first['name']}: mean {lens.mean():.1f}, median {np.median(lens):.0f}, "
              f"max {lens.max()}")
        for lo, hi, c in zip(edges[:-1], edges[1:], hist):
            if c:
                print(f"  [{lo:>5}, {hi:>5}) {c:>8} {'#' * int(40 * c / hist.max())}")
    if args.samples and m["tokenizer"]["path"] is not None:
        tk = Tokenizer(m["tokenizer"]["path"], model=read_tokenizer(args.dir, m))
        for i in range(min(args.samples, sd.num_docs)):
            ids = sd.tokens[sd.tok_start[i]:sd.tok_start[i] + sd.lengths[i]]
            text = tk.decode(ids)
            print(f"  doc {i} ({len(ids)} tokens): {text[:120]}{'...' if len(text) > 120 else ''}")
    return EXIT_OK


EPILOG = ("exit status: 0 done, 1 a cluster task failed (killed, out of memory, ...), 2 usage (bad flags; --out holds "
          "a shard set and --force is not given, or cannot be written), 4 data error (unreadable or empty corpus, "
          "damaged or inconsistent shard set, unreachable URL), 74 the disk filled up while writing (nothing "
          "half-written is kept)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="roformer-data", description="Chinese corpus -> SentencePiece tokenizer -> "
                                 "webdataset shards for roformer-dist pretraining.", epilog=EPILOG)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{tokenizer,shards,prepare,inspect}")

    p = sub.add_parser("tokenizer", help="train a SentencePiece tokenizer", epilog=EPILOG,
                       description="Train a SentencePiece model ([PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4) on the "
                                   "normalised corpus.")
    _corpus_args(p)
    _tokenizer_args(p, vocab_required=True)
    p.add_argument("--out", "-o", required=True, help="model path or prefix (writes PREFIX.model and PREFIX.vocab)")
    p.add_argument("--force", action="store_true", help="replace an existing PREFIX.model")
    p.set_defaults(fn=cmd_tokenizer)

    p = sub.add_parser("shards", help="tokenise a corpus into a shard set", epilog=EPILOG,
                       description="Tokenise in parallel into webdataset tar shards + manifest.json, built beside "
                                   "--out and moved there when complete.")
    _corpus_args(p)
    p.add_argument("--tokenizer", "-t", required=True, help="SentencePiece .model (copied into the shard set)")
    p.add_argument("--out", "-o", required=True, help="shard-set directory")
    _shard_args(p)
    _cluster_args(p)
    p.set_defaults(fn=cmd_shards)

    p = sub.add_parser("prepare", help="tokenizer + shards in one go", epilog=EPILOG,
                       description="Train the tokenizer (OUT/tokenizer.model) and write the shard set into OUT "
                                   "(built beside OUT, moved there when complete). With --tasks N the corpus is "
                                   "split over N tasks (local processes or a SLURM job array), the tokenizer is "
                                   "trained once on a sample first, and the tasks' shards are merged into one set.")
    _corpus_args(p)
    _tokenizer_args(p, vocab_required=True)
    p.add_argument("--out", "-o", required=True, help="shard-set directory (the tokenizer goes inside)")
    _shard_args(p)
    _cluster_args(p)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("inspect", help="totals, length histogram, decoded samples; --verify re-hashes everything",
                       epilog=EPILOG,
                       description="Show a shard set (a directory or a URL prefix). With --verify, re-hash and parse "
                                   "every shard and check the tokenizer against the manifest (sha256, vocab_size, "
                                   "special ids); exit 4 naming each missing, truncated or mismatched file or field.")
    p.add_argument("dir", help="shard-set directory or URL prefix (http://, https://, pipe:, file:)")
    p.add_argument("--verify", action="store_true", help="re-hash and parse every shard, check the tokenizer")
    p.add_argument("--samples", type=int, default=3, help="decoded documents to show")
    p.add_argument("--url-timeout-s", type=float, default=None, metavar="S",
                   help="longest one read of a URL may take before it counts as failed (default 600; a stalled "
                        "pipe: command is killed)")
    p.set_defaults(fn=cmd_inspect)
    return ap


def main(argv=None, run_tasks=None) -> int:
    """``roformer-data``. ``run_tasks(mode, spec, tasks, staging, args)`` runs the tasks of ``--tasks N``
    (the launcher passes its submitit runner: :func:`launcher.prepare.main`); without it ``--tasks`` is
    refused, so that this package needs nothing above it."""
    args = build_parser().parse_args(argv)
    args.run_tasks = run_tasks
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(f"roformer-data {args.cmd}", lambda: args.fn(args),
                       interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    sys.exit(main())
