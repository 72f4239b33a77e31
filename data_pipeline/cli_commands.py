"""``roformer-data tokenizer | shards | inspect`` (:mod:`.cli` parses the flags), ``--tasks N``
(:func:`run_cluster`), and the steps ``prepare`` shares with them: the corpus's texts (:func:`corpus_texts`),
the tokenizer trained on them (:func:`train`), a given ``--tokenizer`` (:func:`given_tokenizer`), a shard set
written (:func:`build`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from .errors import EXIT_DATA, EXIT_OK, TOKENIZER, DataError, UsageError

__all__ = ["cmd_tokenizer", "cmd_shards", "cmd_inspect", "run_cluster", "line_limit", "corpus_texts", "train",
           "given_tokenizer", "build"]

log = logging.getLogger("roformer-data")


def line_limit(args) -> int:
    """``--max-line-bytes``, or the default."""
    from .corpus import MAX_LINE_BYTES

    return args.max_line_bytes or MAX_LINE_BYTES


def corpus_texts(args):
    """(stats, texts): the normalised documents of ``--input`` as the corpus flags say, counted in stats."""
    from .corpus import CorpusStats, read_documents

    stats = CorpusStats()
    return stats, (d.text for d in read_documents(args.input, args.format, args.doc_boundary, args.jsonl_field,
                                                   args.strict, stats, max_line_bytes=line_limit(args)))


def _warn(stats) -> None:
    for w in stats.warnings():
        log.warning("%s", w)


def train(args, out_prefix: Path, texts=None, stats=None, warn: bool = True) -> Path:
    """Train the tokenizer on ``texts`` (default: the documents of ``--input``); ``warn``: log the corpus
    warnings of ``stats`` (off where the shard build reads the whole corpus and warns itself)."""
    from .tokenizer import train_tokenizer

    if texts is None:
        stats, texts = corpus_texts(args)
    report: dict = {}
    model = train_tokenizer(texts, out_prefix, args.vocab_size, model_type=args.model_type,
                            character_coverage=args.character_coverage, byte_fallback=not args.no_byte_fallback,
                            input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
                            jieba=args.jieba, report=report)
    if warn:
        _warn(stats)
    print(f"tokenizer: {report['vocab_size']} pieces ({stats.summary()})")
    return model


def _summary(m: dict, out) -> str:
    el = max(m["_build_seconds"], 1e-9)
    return (f"shards: {out}: {len(m['shards'])} shards, {m['num_docs']} documents, {m['num_tokens']} tokens, "
            f"vocab {m['vocab_size']} ({m['dtype']}); {el:.1f} s, {m['text_bytes'] / el / 1e6:.2f} MB of text/s, "
            f"{m['num_tokens'] / el / 1e3:.0f}k tokens/s")


def given_tokenizer(args) -> Optional[tuple[Path, str]]:
    """(file, kind) of ``--tokenizer`` (None without it), loaded once so that a bad one fails before any work.
    An imported tokenizer that cannot be read or lacks a special token is a UsageError naming the file;
    a damaged SentencePiece model stays a DataError."""
    from .imported import SENTENCEPIECE, find_tokenizer_file, open_tokenizer

    if args.tokenizer is None:
        return None
    path, kind = find_tokenizer_file(args.tokenizer)
    try:
        open_tokenizer(path, kind, args.jieba)
    except DataError as e:
        if kind == SENTENCEPIECE:
            raise
        raise UsageError(str(e), argument=TOKENIZER) from None
    return path, kind


def build(args, tokenizer: Path, kind: str, into: Path, warn_corpus: bool = True, inputs=None, out=None) -> dict:
    """Write the shard set of ``inputs`` (default ``--input``) into the existing directory ``into`` with the
    tokenizer file ``tokenizer`` of ``kind``; ``out``: where it will end up (default ``--out``), for the
    messages."""
    from .corpus import CorpusStats
    from .shards import write_shards

    inputs = args.input if inputs is None else inputs
    out = args.out if out is None else out
    stats = CorpusStats()
    m = write_shards(inputs, tokenizer, into, workers=args.workers or os.cpu_count() or 1,
                     shard_size_mb=args.shard_size_mb,
                     max_docs_per_shard=args.max_docs_per_shard, fmt=args.format, doc_boundary=args.doc_boundary,
                     jsonl_field=args.jsonl_field, strict=args.strict, jieba=args.jieba,
                     progress=not args.no_progress, stats=stats, warn_corpus=warn_corpus,
                     progress_desc=f"shards -> {out}", max_line_bytes=line_limit(args), kind=kind)
    print(_summary(m, out))
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
        model = train(args, tmp / prefix.name)
        os.replace(model.with_suffix(".vocab"), targets[1])
        os.replace(model, targets[0])     # the model last: it is what users load
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {targets[0]}")
    return EXIT_OK


def cmd_shards(args) -> int:
    from .corpus import check_inputs
    from .shards import stage_output

    tokenizer, kind = given_tokenizer(args)
    if args.tasks:
        return run_cluster(args, tokenizer, kind)
    with stage_output(args.out, args.force) as stage:
        check_inputs(args.input)
        build(args, tokenizer, kind, stage.path)
        stage.commit()
    return EXIT_OK

def run_cluster(args, tokenizer: Optional[Path], kind: str) -> int:
    """--tasks N: the tokenizer trained once on a sample (prepare; ``tokenizer`` None) or the given file of
    ``kind`` copied, the tasks, the merge (:mod:`.cluster`)."""
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
    spec = cluster.Spec.from_args(args, kind)
    t0 = time.time()
    with stage_output(args.out, args.force) as stage:   # beside --out: every node must see it
        check_inputs(args.input)
        if tokenizer is None:
            stats, texts = cluster.sample_texts(spec, args.sample_docs)
            train(args, stage.path / "tokenizer", texts, stats)
        else:
            cluster.copy_tokenizer(tokenizer, stage.path, kind)
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

    from .imported import manifest_kind, open_tokenizer
    from .manifest import read_manifest, read_tokenizer
    from .shards import CorruptShardError, load_shard, verify_shard_set
    from .source import default_retry, set_default_retry

    if args.url_timeout_s is not None:
        if not args.url_timeout_s > 0:
            raise UsageError(f"--url-timeout-s: expected a positive number of seconds, got {args.url_timeout_s}")
        set_default_retry(replace(default_retry(), timeout_s=args.url_timeout_s))
    m = read_manifest(args.dir)
    print(f"shard set {args.dir}: format {m['format']}, {len(m['shards'])} shards, {m['num_docs']} documents, "
          f"{m['num_tokens']} tokens, vocab {m['vocab_size']} ({m['dtype']}), word marks: {m['wwm']}")
    print(f"tokenizer: {m['tokenizer']['path']} ({manifest_kind(m)}) sha256 {m['tokenizer']['sha256']}")
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
        tk = open_tokenizer(m["tokenizer"]["path"], manifest_kind(m), data=read_tokenizer(args.dir, m))
        for i in range(min(args.samples, sd.num_docs)):
            ids = sd.tokens[sd.tok_start[i]:sd.tok_start[i] + sd.lengths[i]]
            text = tk.decode(ids)
            print(f"  doc {i} ({len(ids)} tokens): {text[:120]}{'...' if len(text) > 120 else ''}")
    return EXIT_OK
