"""``roformer-data tokenizer | shards | inspect`` (:mod:`.cli` turns the flags into :class:`~.options.DataOptions`),
``--tasks N``
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
from .options import DataOptions

__all__ = ["cmd_tokenizer", "cmd_shards", "cmd_inspect", "run_cluster", "corpus_texts", "train", "given_tokenizer",
           "build"]

log = logging.getLogger("roformer-data")


def corpus_texts(o: DataOptions, inputs=None):
    """(stats, texts): the normalised documents of ``inputs`` (default ``--input``) as the corpus options say,
    counted in stats."""
    from .corpus import CorpusStats, read_documents

    stats, c = CorpusStats(), o.corpus
    return stats, (d.text for d in read_documents(c.inputs if inputs is None else inputs, c.fmt, c.read, stats))


def _warn(stats) -> None:
    for w in stats.warnings():
        log.warning("%s", w)


def train(o: DataOptions, out_prefix: Path, texts=None, stats=None, warn: bool = True) -> Path:
    """Train the tokenizer on ``texts`` (default: the documents of ``--input``); ``warn``: log the corpus
    warnings of ``stats`` (off where the shard build reads the whole corpus and warns itself)."""
    from .tokenizer import train_tokenizer

    if texts is None:
        stats, texts = corpus_texts(o)
    report: dict = {}
    tr = o.training
    model = train_tokenizer(texts, out_prefix, tr.vocab_size, model_type=tr.model_type,
                            character_coverage=tr.character_coverage, byte_fallback=tr.byte_fallback,
                            input_sentence_size=tr.input_sentence_size, num_threads=tr.num_threads,
                            jieba=o.corpus.jieba, report=report)
    if warn:
        _warn(stats)
    print(f"tokenizer: {report['vocab_size']} pieces ({stats.summary()})")
    return model


def _summary(m: dict, out) -> str:
    el = max(m["_build_seconds"], 1e-9)
    return (f"shards: {out}: {len(m['shards'])} shards, {m['num_docs']} documents, {m['num_tokens']} tokens, "
            f"vocab {m['vocab_size']} ({m['dtype']}); {el:.1f} s, {m['text_bytes'] / el / 1e6:.2f} MB of text/s, "
            f"{m['num_tokens'] / el / 1e3:.0f}k tokens/s")


def given_tokenizer(o: DataOptions) -> Optional[tuple[Path, str]]:
    """(file, kind) of ``--tokenizer`` (None without it), loaded once so that a bad one fails before any work.
    An imported tokenizer that cannot be read or lacks a special token is a UsageError naming the file;
    a damaged SentencePiece model stays a DataError."""
    from .imported import SENTENCEPIECE, find_tokenizer_file, open_tokenizer

    if o.tokenizer is None:
        return None
    path, kind = find_tokenizer_file(o.tokenizer)
    try:
        open_tokenizer(path, kind, o.corpus.jieba)
    except DataError as e:
        if kind == SENTENCEPIECE:
            raise
        raise UsageError(str(e), argument=TOKENIZER) from None
    return path, kind


def build(o: DataOptions, tokenizer: Path, kind: str, into: Path, warn_corpus: bool = True, inputs=None,
          out=None) -> dict:
    """Write the shard set of ``inputs`` (default ``--input``) into the existing directory ``into`` with the
    tokenizer file ``tokenizer`` of ``kind``; ``out``: where it will end up (default ``--out``), for the
    messages."""
    from .corpus import CorpusStats
    from .shards import write_shards

    inputs = o.corpus.inputs if inputs is None else inputs
    out = o.out if out is None else out
    stats, s = CorpusStats(), o.shards
    m = write_shards(inputs, tokenizer, into, workers=s.workers or os.cpu_count() or 1, shard_size_mb=s.shard_size_mb,
                     max_docs_per_shard=s.max_docs_per_shard, fmt=o.corpus.fmt, read=o.corpus.read,
                     jieba=o.corpus.jieba, progress=s.progress, stats=stats, warn_corpus=warn_corpus,
                     progress_desc=f"shards -> {out}", kind=kind)
    print(_summary(m, out))
    print(f"corpus: {stats.summary()}")
    return m


def cmd_tokenizer(o: DataOptions) -> int:
    import shutil
    import tempfile

    from .corpus import check_inputs

    out = Path(o.out)
    prefix = out.with_suffix("") if out.suffix == ".model" else out
    targets = [Path(str(prefix) + ".model"), Path(str(prefix) + ".vocab")]
    if targets[0].exists() and not o.force:
        raise UsageError(f"{targets[0]}: exists; pass --force to replace it")
    check_inputs(o.corpus.inputs)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.partial-", dir=prefix.parent))
    except OSError as e:
        raise UsageError(f"{out}: cannot write the tokenizer there ({e.strerror}: {e.filename})") from None
    try:
        model = train(o, tmp / prefix.name)
        os.replace(model.with_suffix(".vocab"), targets[1])
        os.replace(model, targets[0])     # the model last: it is what users load
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {targets[0]}")
    return EXIT_OK


def cmd_shards(o: DataOptions) -> int:
    from .corpus import check_inputs
    from .shards import stage_output

    tokenizer, kind = given_tokenizer(o)
    if o.cluster.tasks:
        return run_cluster(o, tokenizer, kind)
    with stage_output(o.out, o.force) as stage:
        check_inputs(o.corpus.inputs)
        build(o, tokenizer, kind, stage.path)
        stage.commit()
    return EXIT_OK

def run_cluster(o: DataOptions, tokenizer: Optional[Path], kind: str) -> int:
    """--tasks N: the tokenizer trained once on a sample (prepare; ``tokenizer`` None) or the given file of
    ``kind`` copied, the tasks, the merge (:mod:`.cluster`)."""
    import time

    from . import cluster
    from .corpus import check_inputs
    from .shards import stage_output

    c = o.cluster
    if c.tasks < 1:
        raise UsageError(f"--tasks: expected a positive number, got {c.tasks}")
    if o.run_tasks is None:
        raise UsageError("--tasks: preparing over tasks needs the cluster runner of the launcher; run the "
                         "roformer-data command (launcher.prepare.main), not data_pipeline.cli directly")
    mode = c.cluster or ("slurm" if _has_sbatch() else "local")
    spec = cluster.Spec.from_options(o, kind)
    t0 = time.time()
    with stage_output(o.out, o.force) as stage:   # beside --out: every node must see it
        check_inputs(o.corpus.inputs)
        if tokenizer is None:
            stats, texts = cluster.sample_texts(spec, c.sample_docs)
            train(o, stage.path / "tokenizer", texts, stats)
        else:
            cluster.copy_tokenizer(tokenizer, stage.path, kind)
        tasks = cluster.plan(spec, c.tasks)
        if len(tasks) < c.tasks:
            log.warning("--tasks %d: the input makes only %d task(s) (compressed files and blank-line separated "
                        "documents are not cut)", c.tasks, len(tasks))
        for t in tasks:
            print(f"task {t.index + 1}/{len(tasks)}: {t.describe()}")
        o.run_tasks(mode, spec, tasks, stage.path, o)
        m = cluster.merge(stage.path, tasks)
        stage.commit()
    for w in m["_stats"].warnings():
        log.warning("%s", w)
    print(cluster.summary(m, time.time() - t0, o.out))
    return EXIT_OK


def _has_sbatch() -> bool:
    import shutil

    return shutil.which("sbatch") is not None


def cmd_inspect(o: DataOptions) -> int:
    import numpy as np

    from dataclasses import replace

    from .imported import manifest_kind, open_tokenizer
    from .manifest import read_manifest, read_tokenizer
    from .shards import CorruptShardError, load_shard, verify_shard_set
    from .source import default_retry, set_default_retry

    i = o.inspect
    if i.url_timeout_s is not None:
        if not i.url_timeout_s > 0:
            raise UsageError(f"--url-timeout-s: expected a positive number of seconds, got {i.url_timeout_s}")
        set_default_retry(replace(default_retry(), timeout_s=i.url_timeout_s))
    m = read_manifest(i.dir)
    print(f"shard set {i.dir}: format {m['format']}, {len(m['shards'])} shards, {m['num_docs']} documents, "
          f"{m['num_tokens']} tokens, vocab {m['vocab_size']} ({m['dtype']}), word marks: {m['wwm']}")
    print(f"tokenizer: {m['tokenizer']['path']} ({manifest_kind(m)}) sha256 {m['tokenizer']['sha256']}")
    print(f"special ids: {m['special_ids']}")
    if i.verify:
        problems = verify_shard_set(i.dir)
        for p in problems:
            print(f"ERROR: {p}", file=sys.stderr)
        if problems:
            print(f"verify: {len(problems)} problem(s)", file=sys.stderr)
            return EXIT_DATA
        print(f"verify: OK ({len(m['shards'])} shards re-hashed and parsed, totals match, tokenizer agrees)")
    first = m["shards"][0]
    try:
        sd = load_shard(i.dir, m, 0, verify_hash=False)
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
    if i.samples and m["tokenizer"]["path"] is not None:
        tk = open_tokenizer(m["tokenizer"]["path"], manifest_kind(m), data=read_tokenizer(i.dir, m))
        for i in range(min(i.samples, sd.num_docs)):
            ids = sd.tokens[sd.tok_start[i]:sd.tok_start[i] + sd.lengths[i]]
            text = tk.decode(ids)
            print(f"  doc {i} ({len(ids)} tokens): {text[:120]}{'...' if len(text) > 120 else ''}")
    return EXIT_OK
