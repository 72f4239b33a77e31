"""``roformer-data``: tokenizer | shards | prepare | inspect.

    roformer-data prepare --input corpus/ --vocab-size 32000 --out data/shards
    roformer-data prepare --input corpus/ --tokenizer chinese_roformer_base/vocab.txt --out data/shards
    roformer-data prepare --input 'corpus/*.jsonl.gz' --vocab-size 32000 --out data/shards --slurm --tasks 64
    roformer-data prepare --source news=corpus/pd_train.txt --source reviews='corpus/reviews/*.txt' \
        --vocab-size 8000 --out data/mix [--tokenizer-weights news=0.7,reviews=0.3]
    roformer-data inspect --verify data/shards          (or an http(s)://, pipe:, file: URL prefix)

``--tokenizer PATH`` (``prepare``, ``shards``) uses an existing tokenizer instead of training one: one
of our SentencePiece models, or an imported HF ``tokenizer.json`` / WordPiece ``vocab.txt`` (or an HF
repository directory holding one) with its own special ids (:mod:`.imported`); a file that is not one
of those, or lacks one of [PAD] [UNK] [CLS] [SEP] [MASK], is a usage error naming it.

``prepare --source NAME=INPUT ...`` builds a corpus mixture: one tokenizer (``OUT/tokenizer.model``)
trained on a sample of all sources (:func:`weighted_interleave`), and one complete shard set per
source (``OUT/NAME/``), all recording that tokenizer; the ``data.sources`` block for the trainer is
printed at the end.

Nothing is written over an existing shard set without ``--force``; a new set is built beside its
final place and moved there only when complete, so a failure leaves nothing behind. Exit status:
0 done, 2 usage (bad flags, an output that exists or cannot be written), 4 data error (unreadable
or empty corpus, a damaged or inconsistent shard set, an unreachable URL), 74 the disk filled up
while writing; see :mod:`.errors`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

from .errors import EXIT_DATA, EXIT_OK, DataError, UsageError, run_command
from .mixture import SOURCE_NAME

log = logging.getLogger("roformer-data")



def _corpus_args(p: argparse.ArgumentParser, input_required: bool = True) -> None:
    g = p.add_argument_group("corpus")
    g.add_argument("--input", "-i", nargs="+", required=input_required,
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
    g.add_argument("--vocab-size", type=int, required=vocab_required, default=None,
                   help="vocabulary size (a soft limit: a small corpus may give fewer pieces, with a warning)"
                        + ("" if vocab_required else "; required unless --tokenizer gives an existing tokenizer"))
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


def _train(args, out_prefix: Path, texts=None, stats=None, warn: bool = True) -> Path:
    """Train the tokenizer on ``texts`` (default: the documents of ``--input``); ``warn``: log the corpus
    warnings of ``stats`` (off where the shard build reads the whole corpus and warns itself)."""
    from .tokenizer import train_tokenizer

    if texts is None:
        stats, texts = _texts(args)
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


def _given_tokenizer(args) -> Optional[tuple[Path, str]]:
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
        raise UsageError(f"--tokenizer: {e}") from None
    return path, kind


def _build(args, tokenizer: Path, kind: str, into: Path, warn_corpus: bool = True, inputs=None, out=None) -> dict:
    """Write the shard set of ``inputs`` (default ``--input``) into the existing directory ``into`` with the
    tokenizer file ``tokenizer`` of ``kind``; ``out``: where it will end up (default ``--out``), for the
    messages."""
    from .corpus import CorpusStats
    from .shards import write_shards

    inputs = args.input if inputs is None else inputs
    out = args.out if out is None else out
    stats = CorpusStats()
    m = write_shards(inputs, tokenizer, into, workers=args.workers or os.cpu_count() or 1, shard_size_mb=args.shard_size_mb,
                     max_docs_per_shard=args.max_docs_per_shard, fmt=args.format, doc_boundary=args.doc_boundary,
                     jsonl_field=args.jsonl_field, strict=args.strict, jieba=args.jieba,
                     progress=not args.no_progress, stats=stats, warn_corpus=warn_corpus,
                     progress_desc=f"shards -> {out}", max_line_bytes=_line_limit(args), kind=kind)
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

    tokenizer, kind = _given_tokenizer(args)
    if args.tasks:
        return _cluster(args, tokenizer, kind)
    with stage_output(args.out, args.force) as stage:
        check_inputs(args.input)
        _build(args, tokenizer, kind, stage.path)
        stage.commit()
    return EXIT_OK


def cmd_prepare(args) -> int:
    from .corpus import check_inputs
    from .imported import SENTENCEPIECE
    from .shards import stage_output

    given = _given_tokenizer(args)
    if given is None and args.vocab_size is None:
        raise UsageError("prepare: --vocab-size is required to train the tokenizer (or give an existing one "
                         "with --tokenizer)")
    if given is not None and args.vocab_size is not None:
        raise UsageError(f"--vocab-size {args.vocab_size} with --tokenizer {args.tokenizer}: the vocabulary is "
                         "the given tokenizer's; leave --vocab-size out")
    sources = _sources(args)
    if sources is not None:
        return _prepare_mixture(args, sources, given)
    if args.tokenizer_weights is not None:
        raise UsageError(f"--tokenizer-weights {args.tokenizer_weights}: weights are for a mixture; give the "
                         "corpora as --source NAME=INPUT")
    tokenizer, kind = given or (None, SENTENCEPIECE)
    if args.tasks:
        return _cluster(args, tokenizer, kind)
    with stage_output(args.out, args.force) as stage:   # fails now if --out exists or cannot be written
        check_inputs(args.input)                        # and if an input cannot be read
        if tokenizer is None:
            _build(args, _train(args, stage.path / "tokenizer"), kind, stage.path, warn_corpus=False)
        else:
            _build(args, tokenizer, kind, stage.path)
        stage.commit()
    return EXIT_OK


# --------------------------------------------------------------------------- prepare --source (a mixture)


def _sources(args) -> Optional[dict[str, list[str]]]:
    """The ``--source NAME=INPUT`` flags as {name: [inputs]} in the order first given (a name given again
    adds inputs); None with ``--input``. UsageError: both or neither given, a malformed value or bad name,
    a cluster option."""
    if args.source and args.input:
        raise UsageError("--input and --source: give one or the other (--input: one shard set; --source "
                         "NAME=INPUT, repeated: a mixture of several sets sharing one tokenizer)")
    if not args.source:
        if not args.input:
            raise UsageError("prepare: give the corpus as --input FILES (one shard set) or as --source NAME=INPUT, "
                             "repeated (a mixture)")
        return None
    sources: dict[str, list[str]] = {}
    for value in args.source:
        name, sep, inputs = value.partition("=")
        if not sep or not inputs:
            raise UsageError(f"--source {value}: expected NAME=INPUT (a file, directory or glob)")
        if not SOURCE_NAME.fullmatch(name):
            raise UsageError(f"--source {value}: the name {name!r} may hold only letters, digits, '_' and '-' "
                             "(it becomes a directory name and a metric tag)")
        sources.setdefault(name, []).append(inputs)
    if args.tasks is not None or args.cluster is not None:
        raise UsageError("--source with --tasks/--cluster/--slurm: a mixture is not prepared over tasks; run "
                         "`roformer-data tokenizer` once (on a sample of all sources), then `roformer-data shards "
                         "--tokenizer MODEL` per source (each may use --tasks)")
    return sources


def _tokenizer_weights(text: Optional[str], names: Iterable[str]) -> Optional[dict[str, float]]:
    """``--tokenizer-weights NAME=W,...`` as {name: weight}, one positive number for every source; None
    when not given. UsageError naming the bad item."""
    if text is None:
        return None
    names = list(names)
    weights: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise UsageError(f"--tokenizer-weights: expected NAME=WEIGHT, got {item!r}")
        if name not in names:
            raise UsageError(f"--tokenizer-weights: {name!r} is not a --source (the sources: {', '.join(names)})")
        if name in weights:
            raise UsageError(f"--tokenizer-weights: {name!r} is given twice")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise UsageError(f"--tokenizer-weights: {item!r}: the weight must be a positive number, got {value!r}")
        weights[name] = weight
    missing = [n for n in names if n not in weights]
    if missing:
        raise UsageError(f"--tokenizer-weights {text}: no weight for {', '.join(missing)}; give one for every "
                         "--source (or leave the flag out: shares by size)")
    return weights


def weighted_interleave(sources: Mapping[str, Iterable[str]], weights: Optional[Mapping[str, float]] = None,
                        counts: Optional[dict] = None) -> Iterator[str]:
    """The texts of several sources as one stream whose share of *characters* from each source follows
    ``weights`` (the tokenizer's training text of a mixture).

    ``weights`` None: the sources one after another, whole (each source's share is its size, as
    concatenating them would give). Otherwise smooth weighted round-robin by characters: the next text
    comes from the source furthest below its share (the smallest characters-taken / weight; the first
    given on a tie), and the stream ends as soon as a source runs out, so that every source's share of
    the characters holds to within one text; sources not read to their end contribute their first
    texts. Deterministic, no random numbers. ``counts`` (a dict) receives ``name -> [texts,
    characters]`` taken. DataError when a weighted source has no text at all. The sources' iterators
    are closed at the end.
    """
    counts = {} if counts is None else counts
    its = {name: iter(texts) for name, texts in sources.items()}
    for name in its:
        counts[name] = [0, 0]
    try:
        if weights is None:
            for name, it in its.items():
                for text in it:
                    counts[name][0] += 1
                    counts[name][1] += len(text)
                    yield text
            return
        while True:
            name = min(its, key=lambda n: counts[n][1] / weights[n])
            text = next(its[name], None)
            if text is None:
                if counts[name][0] == 0:
                    raise DataError(f"source {name!r}: no text (every document was empty or invalid)")
                return
            counts[name][0] += 1
            counts[name][1] += len(text)
            yield text
    finally:
        for it in its.values():
            close = getattr(it, "close", None)
            if close is not None:
                close()


def _mixture_texts(args, sources: Mapping[str, list[str]], weights, counts: dict):
    """(stats, texts): the tokenizer's training text of a mixture (:func:`weighted_interleave`)."""
    from .corpus import CorpusStats, read_documents

    stats = CorpusStats()
    streams = {name: (d.text for d in read_documents(inputs, args.format, args.doc_boundary, args.jsonl_field,
                                                     args.strict, stats, max_line_bytes=_line_limit(args)))
               for name, inputs in sources.items()}
    return stats, weighted_interleave(streams, weights, counts)


def _sample_line(counts: Mapping[str, list], weights) -> str:
    """One line on what the tokenizer was trained on, per source."""
    total = max(sum(c for _, c in counts.values()), 1)
    parts = [f"{name} {docs} documents, {chars:,} characters ({100 * chars / total:.1f}%)"
             for name, (docs, chars) in counts.items()]
    how = ("by size" if weights is None else
           "weights " + ", ".join(f"{n}={w:g}" for n, w in weights.items()))
    return f"tokenizer sample ({how}): {'; '.join(parts)}"


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.vocab", "tokenizer.json", "vocab.txt")
"""What a mixture holds besides its shard sets: a trained SentencePiece model (and its .vocab), or the given
tokenizer under its kind's name (:data:`.imported.KINDS`)."""


def _is_mixture(out: Path) -> bool:
    """Whether ``out`` holds a mixture as ``prepare --source`` writes it: the tokenizer files and shard-set
    directories, nothing else."""
    from .imported import KINDS
    from .shards import MANIFEST

    if not any((out / name).is_file() for name in KINDS.values()):
        return False
    entries = [e for e in out.iterdir() if e.name not in TOKENIZER_FILES]
    return bool(entries) and all(e.is_dir() and (e / MANIFEST).is_file() for e in entries)


def _yaml_scalar(text: str) -> str:
    """``text`` as a YAML flow scalar: plain where it reads back as that string, else double-quoted."""
    import json

    plain = re.fullmatch(r"[A-Za-z_./][A-Za-z0-9_./-]*", text) and text.lower() not in (
        "true", "false", "yes", "no", "on", "off", "null", "y", "n", "~")
    return text if plain else json.dumps(text, ensure_ascii=False)


def sources_yaml(out, names: Iterable[str]) -> str:
    """The ``data.sources`` block for the trainer's config naming the sets ``out/NAME``."""
    lines = ["data:", "  sources:"]
    lines += [f"    - {{name: {_yaml_scalar(n)}, shards: {_yaml_scalar(str(Path(out) / n))}}}" for n in names]
    return "\n".join(lines)


def _prepare_mixture(args, sources: dict[str, list[str]], given: Optional[tuple[Path, str]]) -> int:
    """``prepare --source``: one tokenizer trained on a sample of all sources (or ``given``: the file and kind
    of ``--tokenizer``, copied), then one shard set per source, all staged together and moved into ``--out``
    when every set is complete."""
    from .cluster import copy_tokenizer
    from .corpus import check_inputs
    from .imported import SENTENCEPIECE
    from .shards import stage_output

    if given is not None and args.tokenizer_weights is not None:
        raise UsageError(f"--tokenizer-weights {args.tokenizer_weights} with --tokenizer {args.tokenizer}: the "
                         "weights shape the sample a tokenizer is trained on, and the given one is not trained")
    weights = _tokenizer_weights(args.tokenizer_weights, sources)
    counts: dict = {}
    # fails now if --out holds anything but a shard set or a mixture, or cannot be written
    with stage_output(args.out, args.force, replaceable=(_is_mixture, "a mixture")) as stage:
        for inputs in sources.values():
            check_inputs(inputs)                            # and if an input cannot be read
        if given is None:
            stats, texts = _mixture_texts(args, sources, weights, counts)
            model, kind = _train(args, stage.path / "tokenizer", texts, stats, warn=weights is None), SENTENCEPIECE
            print(_sample_line(counts, weights))
        else:
            model, kind = copy_tokenizer(given[0], stage.path, given[1]), given[1]
        for name, inputs in sources.items():
            (stage.path / name).mkdir()
            _build(args, model, kind, stage.path / name, warn_corpus=weights is not None or given is not None,
                   inputs=inputs, out=Path(args.out) / name)
        stage.commit()
    print(f"mixture: {args.out}: {len(sources)} shard sets ({', '.join(sources)}) sharing {args.out}/{model.name}")
    print("for the trainer's config below; the training mixture is yours to weigh: add `weight: W` to each "
          "source for its share of the training tokens (--tokenizer-weights shaped only the tokenizer's sample)")
    print(sources_yaml(args.out, sources))
    return EXIT_OK


def _cluster(args, tokenizer: Optional[Path], kind: str) -> int:
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
            _train(args, stage.path / "tokenizer", texts, stats)
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


EPILOG = ("exit status: 0 done, 1 a cluster task failed (killed, out of memory, ...), 2 usage (bad flags; --out holds "
          "a shard set and --force is not given, or cannot be written), 4 data error (unreadable or empty corpus, "
          "damaged or inconsistent shard set, unreachable URL), 74 the disk filled up while writing (nothing "
          "half-written is kept)")


PREPARE_EPILOG = """\
a mixture (several shard sets sharing one tokenizer):
  roformer-data prepare --source news=corpus/pd_train.txt \\
      --source reviews='corpus/reviews/*.txt' --vocab-size 8000 --out data/mix \\
      [--tokenizer-weights news=0.7,reviews=0.3]
writes data/mix/tokenizer.model (+ .vocab) and one complete shard set per
source, data/mix/news and data/mix/reviews (each with its copy of the
tokenizer: every manifest records the same sha256), all built beside data/mix
and moved there together; then prints the trainer's data.sources block. Over
a cluster: `roformer-data tokenizer` once, then `roformer-data shards
--tokenizer MODEL` per source.

""" + textwrap.fill(EPILOG, 79, break_on_hyphens=False)


TOKENIZER_HELP = ("an existing tokenizer, copied into the shard set: a SentencePiece .model of roformer-data, an HF "
                  "tokenizer.json, a WordPiece vocab.txt (Chinese BERT conventions: lowercase, CJK characters "
                  "split, accents stripped), or a directory holding one (an HF repository); an imported one keeps "
                  "its special ids (those of [PAD] [UNK] [CLS] [SEP] [MASK]), recorded in the manifest")


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
    p.add_argument("--tokenizer", "-t", required=True, help=TOKENIZER_HELP)
    p.add_argument("--out", "-o", required=True, help="shard-set directory")
    _shard_args(p)
    _cluster_args(p)
    p.set_defaults(fn=cmd_shards)

    p = sub.add_parser("prepare", help="tokenizer + shards in one go (--source: a mixture of shard sets)",
                       epilog=PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=textwrap.fill(
                                   "Train the tokenizer (OUT/tokenizer.model), or take an existing one with "
                                   "--tokenizer, and write the shard set into OUT "
                                   "(built beside OUT, moved there when complete). With --tasks N the corpus is "
                                   "split over N tasks (local processes or a SLURM job array), the tokenizer is "
                                   "trained once on a sample first, and the tasks' shards are merged into one set. "
                                   "With --source NAME=INPUT (repeated) instead of --input: a mixture, one "
                                   "tokenizer OUT/tokenizer.model trained on a sample of all sources and one shard "
                                   "set OUT/NAME per source.", 79, break_on_hyphens=False))
    _corpus_args(p, input_required=False)
    g = p.add_argument_group("mixture (instead of --input)")
    g.add_argument("--source", action="append", default=None, metavar="NAME=INPUT",
                   help="a source of the mixture: NAME ([A-Za-z0-9_-]+, its directory OUT/NAME and metric tag) and "
                        "a file, directory or glob as --input takes; repeat for more sources, or with the same "
                        "NAME for more inputs of that source")
    g.add_argument("--tokenizer-weights", default=None, metavar="NAME=W,...",
                   help="each source's share of the characters the tokenizer is trained on (positive numbers, "
                        "normalised; one for every source). The sources' documents are interleaved by smooth "
                        "weighted round-robin on characters until the first source runs out (the others give their "
                        "first documents). Default: every source whole, i.e. shares by size. The training "
                        "mixture's weights are set in the trainer's config, not here")
    _tokenizer_args(p, vocab_required=False)
    p.add_argument("--tokenizer", "-t", default=None,
                   help=TOKENIZER_HELP + "; instead of training one (the training options above are then unused)")
    p.add_argument("--out", "-o", required=True,
                   help="shard-set directory (the tokenizer goes inside); with --source: the mixture's directory")
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
