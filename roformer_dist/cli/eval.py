"""``roformer-eval``: evaluate training checkpoints at any sequence length, in one process.

    roformer-eval runs/demo --lengths 512,1024,1536
    roformer-eval runs/ablation/rotary runs/ablation/absolute --lengths 128,512,1024,1536 --json report.json

A checkpoint is a run directory or a ``checkpoints/`` directory (then its newest complete checkpoint
not marked BAD, the one training would resume from) or one ``checkpoints/step_XXXXXXXX/`` directory,
of any ZeRO stage or parallel layout. The eval batches
are the trainer's (same eval shards, seed, masks and micro-batch rule, :mod:`roformer_dist.observe.evaluation`),
so at a length the run evaluated during training the loss equals the trainer's. Every row carries
the unigram baseline at the same predicted positions.

Lengths past the longest the checkpoint was trained on are marked (rotary: beyond the trained
length; absolute: untrained position rows, or none past model.max_position_embeddings). The work is
:mod:`roformer_dist.observe.length_report`.

Rotary settings sweep (context extension without training; rotary models read any length, past
model.max_position_embeddings too):
    roformer-eval runs/demo --lengths 512,2048,4096 --rope-theta 10000,80000
    roformer-eval runs/demo --lengths 512,2048,4096 --rope-scaling none,linear:8,ntk:8,yarn
prints one table per checkpoint: a row per setting (the checkpoint's own first), a column per length,
and the unigram baseline's row. --rope-theta V,...: rotary bases (> 1). --rope-scaling MODE[:FACTOR],...:
MODE none | linear | ntk | yarn (see model.rope_scaling); FACTOR >= 1, default the longest length
over the original length L; L (yarn's rope_original_max_position) is the checkpoint's
model.rope_original_max_position if set, else the longest length it was trained at. Given both, every
base with every scaling; given one, the other is the checkpoint's.
Exit status: 0, 2 bad arguments, 4 data missing or inconsistent, 5 unusable checkpoint, 74 --json
cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from data_pipeline.command_line import CommandParser
from roformer_dist.config import ModelConfig, Packing, RopeSettings, choices, parse_lengths, rope_settings, \
    validate_rope
from roformer_dist.errors import ConfigError, run_command
from roformer_dist.runtime.rundir import RunDir

PACKINGS = choices(Packing)

Scaling = tuple[str, Optional[float]]
"""A ``--rope-scaling`` item: (mode, factor or None for the default)."""


def _check_rope(text: str, **rope) -> None:
    """ArgumentTypeError with config.validate_rope's message unless ``rope`` (over the defaults) is valid."""
    try:
        validate_rope(RopeSettings(**rope), ModelConfig(), "model")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _items(text: str) -> list[str]:
    items = [x for x in text.replace(" ", "").split(",") if x]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def parse_thetas(text: str) -> list[float]:
    """``"10000,80000"`` -> [10000.0, 80000.0] (rotary bases, each > 1)."""
    thetas = []
    for item in _items(text):
        try:
            theta = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected a number (a rotary base > 1)") from None
        _check_rope(item, rope_theta=theta)
        thetas.append(theta)
    return thetas


def parse_scalings(text: str) -> list[Scaling]:
    """``"none,linear:4,yarn"`` -> [("none", None), ("linear", 4.0), ("yarn", None)]."""
    out = []
    for item in _items(text):
        mode, _, factor_text = item.partition(":")
        factor = None
        if factor_text:
            try:
                factor = float(factor_text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: expected MODE[:FACTOR], FACTOR a number >= 1") from None
        default = 1.0 if mode == "none" else 2.0  # any valid factor, to check the mode alone
        _check_rope(item, rope_scaling=mode, rope_scaling_factor=default if factor is None else factor)
        out.append((mode, factor))
    return out


def build_parser() -> CommandParser:
    p = CommandParser(prog="roformer-eval", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--rope-theta", type=parse_thetas, default=None, metavar="V1,V2,...",
                   help="sweep the rotary base (rotary checkpoints): one table row per value")
    p.add_argument("--rope-scaling", type=parse_scalings, default=None, metavar="MODE[:FACTOR],...",
                   help="sweep the context extension: none | linear | ntk | yarn, FACTOR >= 1 (default: the "
                        "longest length over the original length); see the rotary settings sweep below")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the reports as JSON")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("roformer-eval", lambda: _main(args))


def _main(args) -> int:
    import torch  # heavy: not needed for a usage error

    from data_pipeline.atomic import atomic_write_text
    from roformer_dist.observe.length_report import evaluate_checkpoint, format_comparison, format_report

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches is not None and args.batches < 1:
        raise ConfigError(f"--batches: expected a positive integer, got {args.batches}")
    if args.rope_theta or args.rope_scaling:
        sweeps = [_sweep(path, args) for path in args.checkpoints]
        if args.json:
            atomic_write_text(Path(args.json), json.dumps(sweeps, indent=2) + "\n")
        return 0
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


def rope_rows(model_cfg: ModelConfig, thetas: Optional[list[float]], scalings: Optional[list[Scaling]],
              original: int, longest: int) -> list[RopeSettings]:
    """The sweep's settings: the model's own first, then every base of
    ``thetas`` with every item of ``scalings`` (either None: the model's); ``original``: the length L the
    scalings extend (see the module docstring), ``longest``: the longest eval length."""
    own = rope_settings(model_cfg)
    rows = [own]
    for theta in thetas or [own.rope_theta]:
        for mode, factor in scalings or [(None, None)]:
            if mode is None:
                rope = own.replace(rope_theta=theta)
            elif mode == "none":
                rope = RopeSettings(rope_theta=theta)
            else:
                rope = RopeSettings(theta, mode, factor if factor is not None else max(1.0, longest / original),
                                    original)
            validate_rope(rope, model_cfg, "model")
            if rope not in rows:
                rows.append(rope)
    return rows


def rope_label(rope: RopeSettings, max_positions: int) -> str:
    """``theta 10000, yarn x4 (L 512)``: a sweep row's settings in a few words."""
    text = f"theta {rope.rope_theta:g}"
    if rope.rope_scaling != "none":
        text += f", {rope.rope_scaling} x{rope.rope_scaling_factor:g}"
        if rope.rope_scaling == "yarn":
            original = rope.rope_original_max_position or max_positions / rope.rope_scaling_factor
            text += f" (L {original:g})"
    return text


def _sweep(path: str, args) -> dict:
    """Evaluate one checkpoint under every swept setting, print its table; returns it for --json."""
    from roformer_dist.observe.evaluation import evaluate_rope_settings
    from roformer_dist.observe.length_report import open_checkpoint

    c = open_checkpoint(path, args.lengths, eval_shards=args.eval_shards, shards=args.shards,
                        batches=args.batches, packing=args.packing)
    mc = c.model.config
    if mc.position_embedding != "rotary":
        raise ConfigError(f"--rope-theta / --rope-scaling: {c.found.dir} has model.position_embedding "
                          f"{mc.position_embedding!r}: only rotary models have rope settings to sweep")
    original = mc.rope_original_max_position or c.trained or mc.max_position_embeddings
    rows = rope_rows(mc, args.rope_theta, args.rope_scaling, original, max(c.lengths))
    print(f"  {_short_name(path)}: {len(rows)} rope settings x lengths {','.join(map(str, c.lengths))} ...",
          file=sys.stderr, flush=True)
    results = evaluate_rope_settings(c.model, c.cfg, c.lengths, rows)
    labels = [rope_label(r, mc.max_position_embeddings) + (" (checkpoint)" if i == 0 else "")
              for i, r in enumerate(rows)]
    unigram = [results[0][n]["unigram_loss"] for n in c.lengths]
    width = max(len(label) for label in labels + ["unigram baseline"])
    lines = [f"{c.found.dir}: step {c.found.step}, rotary positions, trained up to length {c.trained} "
             f"(model.max_position_embeddings {mc.max_position_embeddings}), eval rows packed {c.cfg.data.packing}",
             "eval loss by rope setting and length:",
             f"{'':<{width}} " + " ".join(f"{n:>8}" for n in c.lengths)]
    for label, result in zip(labels, results):
        lines.append(f"{label:<{width}} " + " ".join(f"{result[n]['loss']:>8.4f}" for n in c.lengths))
    lines.append(f"{'unigram baseline':<{width}} " + " ".join(f"{u:>8.4f}" for u in unigram))
    print("\n".join(lines) + "\n", flush=True)
    return {"checkpoint": str(c.found.dir), "step": c.found.step, "trained_max_len": c.trained,
            "max_position_embeddings": mc.max_position_embeddings, "packing": c.cfg.data.packing,
            "lengths": c.lengths, "unigram_loss": unigram,
            "rows": [{"rope": rope.to_dict(), "label": label, "loss": [result[n]["loss"] for n in c.lengths],
                      "mlm_acc": [result[n]["mlm_acc"] for n in c.lengths]}
                     for rope, label, result in zip(rows, labels, results)]}


def _short_name(path: str) -> str:
    p = Path(path).resolve()
    if p.name.startswith("step_"):
        p = p.parent.parent
    elif p == RunDir(p.parent).checkpoints:
        p = p.parent
    return p.name


if __name__ == "__main__":
    sys.exit(main())
