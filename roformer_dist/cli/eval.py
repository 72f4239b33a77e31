"""``roformer-eval``: evaluate training checkpoints at any sequence length, in one process.

    roformer-eval runs/demo --lengths 512,1024,1536
    roformer-eval runs/ablation/rotary runs/ablation/absolute --lengths 128,512,1024,1536 --json report.json

A checkpoint is a run directory or a ``checkpoints/`` directory (then its newest complete checkpoint
not marked BAD, the one training would resume from) or one ``checkpoints/step_XXXXXXXX/`` directory,
of any ZeRO stage or parallel layout. The eval batches
are the trainer's (same eval shards, seed, masks and micro-batch rule, :mod:`roformer_dist.train.evaluation`),
so at a length the run evaluated during training the loss equals the trainer's. Every row carries
the unigram baseline at the same predicted positions.

Lengths past the longest the checkpoint was trained on are marked (rotary: beyond the trained
length; absolute: untrained position rows, or none past model.max_position_embeddings). The work is
:mod:`roformer_dist.train.length_report`.
Exit status: 0, 2 bad arguments, 4 data missing or inconsistent, 5 unusable checkpoint, 74 --json
cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from roformer_dist.config import Packing, choices
from roformer_dist.errors import ConfigError, run_command

PACKINGS = choices(Packing)


def parse_lengths(text: str) -> list[int]:
    """``"512,1024,1536"`` -> [512, 1024, 1536]; argparse reports a ValueError's message."""
    try:
        lengths = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    bad = [n for n in lengths if n < 8 or n % 8]
    if not lengths or bad:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not a positive multiple of 8")
    return lengths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roformer-eval", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="run directory, checkpoints/ directory or checkpoints/step_XXXXXXXX directory")
    p.add_argument("--lengths", type=parse_lengths, default=None, metavar="L1,L2,...",
                   help="comma-separated sequence lengths (multiples of 8); default: the last stage's eval lengths")
    p.add_argument("--eval-shards", default=None, help="eval shard set (default: the run's data.eval_shards)")
    p.add_argument("--shards", default=None,
                   help="training shard set for the unigram baseline (default: the run's data.shards)")
    p.add_argument("--batches", type=int, default=None, help="eval batches per length (default: data.eval_batches)")
    p.add_argument("--packing", choices=PACKINGS, default=None,
                   help="document: each packed document attended alone (as if it were the only input); "
                        "cross_document: each row as one input. Default: the run's data.packing")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the reports as JSON")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("roformer-eval", lambda: _main(args))


def _main(args) -> int:
    import torch  # heavy: not needed for a usage error

    from data_pipeline.atomic import atomic_write_text
    from roformer_dist.train.length_report import evaluate_checkpoint, format_comparison, format_report

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches is not None and args.batches < 1:
        raise ConfigError(f"--batches: expected a positive integer, got {args.batches}")
    reports, names = [], []
    for path in args.checkpoints:
        rep = evaluate_checkpoint(path, args.lengths, eval_shards=args.eval_shards, shards=args.shards,
                                  batches=args.batches, packing=args.packing, progress=True)
        reports.append(rep)
        names.append(_short_name(path))
        print(format_report(rep), flush=True)
        print()
    if len(reports) > 1 and all([r.length for r in rep.rows] == [r.length for r in reports[0].rows]
                                for rep in reports):
        print("eval loss by length:")
        print(format_comparison(reports, names))
    if args.json:
        atomic_write_text(Path(args.json), json.dumps([r.to_dict() for r in reports], indent=2) + "\n")
    return 0


def _short_name(path: str) -> str:
    p = Path(path).resolve()
    if p.name.startswith("step_"):
        p = p.parent.parent
    elif p.name == "checkpoints":
        p = p.parent
    return p.name


if __name__ == "__main__":
    sys.exit(main())
