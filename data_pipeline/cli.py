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

This module holds the flags (the ``--format`` choices are :data:`~.formats.FORMATS`') and :func:`main`, which
names an error's input or argument (a role, :mod:`.errors`) by its flag (:data:`FLAGS`); the commands are in
:mod:`.cli_prepare` (``prepare``) and :mod:`.cli_commands` (``tokenizer``, ``shards``, ``inspect``,
``--tasks``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import textwrap

from .cli_commands import cmd_inspect, cmd_shards, cmd_tokenizer
from .cli_prepare import TOKENIZER_FILES, cmd_prepare, sources_yaml, weighted_interleave
from .command_line import CommandParser
from .errors import OUTPUT, TOKENIZER, DataError, UsageError, run_command
from .formats import AUTO, FORMATS, ReadOptions
from .lines import MAX_LINE_BYTES
from .options import ClusterOptions, CorpusOptions, DataOptions, InspectOptions, ShardOptions, TokenizerTraining

__all__ = ["main", "build_parser", "options_of", "FLAGS", "cmd_tokenizer", "cmd_shards", "cmd_prepare", "cmd_inspect",
           "weighted_interleave", "sources_yaml", "TOKENIZER_FILES"]

FLAGS = {TOKENIZER: "--tokenizer", OUTPUT: "--out"}
"""How roformer-data names the inputs and arguments its library's errors say they are about (:mod:`.errors`)."""


def _corpus_args(p: argparse.ArgumentParser, input_required: bool = True) -> None:
    g = p.add_argument_group("corpus")
    g.add_argument("--input", "-i", nargs="+", required=input_required,
                   help=f"files, directories or globs ({' / '.join(FORMATS)}: see --format), optionally .gz or .zst")
    g.add_argument("--format", default=AUTO, choices=(AUTO, *FORMATS),
                   help=f"input format: {AUTO} (recognised file by file), or "
                        + " | ".join(f"{name}: {reader.help}" for name, reader in FORMATS.items()))
    g.add_argument("--doc-boundary", default="line", choices=("line", "blank"),
                   help="txt: one document per line, or documents separated by blank lines")
    g.add_argument("--text-field", "--jsonl-field", dest="text_field", default="text", metavar="NAME",
                   help="where the text is: jsonl, the field holding it; parquet, arrow, the column holding it "
                        "(--jsonl-field: its older name)")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first invalid UTF-8 / JSON line instead of skipping and counting it")
    g.add_argument("--jieba", action="store_true",
                   help="jieba word pre-segmentation (WoBERT style; needs `pip install jieba`)")
    g.add_argument("--max-line-bytes", type=_positive_int, default=None, metavar="N",
                   help="longest input line (or blank-line separated document) read, in bytes (default 1048576, "
                        "lines.MAX_LINE_BYTES); longer ones are skipped, unread, and counted with a warning "
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


def build_parser() -> CommandParser:
    ap = CommandParser(prog="roformer-data", description="Chinese corpus -> SentencePiece tokenizer -> "
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


def _given(cls, args: argparse.Namespace, **derived):
    """``cls`` from the flags of ``args`` named as its fields (a command without a flag: the field's default), with
    ``derived`` values over them (``--cluster`` is a field of ClusterOptions, not DataOptions' ``cluster``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **derived})


def options_of(args: argparse.Namespace, run_tasks=None) -> DataOptions:
    """The command line's options, typed (the one place that reads argparse's namespace)."""
    read = _given(ReadOptions, args, max_line_bytes=getattr(args, "max_line_bytes", None) or MAX_LINE_BYTES)
    corpus = _given(CorpusOptions, args, inputs=tuple(getattr(args, "input", None) or ()),
                    fmt=getattr(args, "format", AUTO), read=read)
    training = _given(TokenizerTraining, args, byte_fallback=not getattr(args, "no_byte_fallback", False))
    shards = _given(ShardOptions, args, progress=not getattr(args, "no_progress", False))
    return _given(DataOptions, args, command=args.cmd, out=str(getattr(args, "out", None) or ""), corpus=corpus,
                  training=training, shards=shards, cluster=_given(ClusterOptions, args),
                  sources=tuple(getattr(args, "source", None) or ()), inspect=_given(InspectOptions, args),
                  run_tasks=run_tasks)


def _in_flag_names(fn, options: DataOptions) -> int:
    """The command ``fn`` on ``options``; an error about one of :data:`FLAGS` names its flag."""
    try:
        return fn(options)
    except DataError as e:
        if e.input not in FLAGS:
            raise
        raise e.naming(FLAGS[e.input]) from None
    except UsageError as e:
        if e.argument not in FLAGS:
            raise
        raise e.naming(FLAGS[e.argument]) from None


def main(argv=None, run_tasks=None) -> int:
    """``roformer-data``. ``run_tasks(mode, spec, tasks, staging, options)`` runs the tasks of ``--tasks N``
    (the launcher passes its submitit runner: :func:`launcher.prepare.main`); without it ``--tasks`` is
    refused, so that this package needs nothing above it."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(f"roformer-data {args.cmd}", lambda: _in_flag_names(args.fn, options_of(args, run_tasks)),
                       interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    sys.exit(main())
