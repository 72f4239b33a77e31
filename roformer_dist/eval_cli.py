"""``roformer-eval``: evaluate training checkpoints at any sequence length, in one process.

    roformer-eval runs/demo --lengths 512,1024,1536
    roformer-eval runs/ablation/rotary runs/ablation/absolute --lengths 128,512,1024,1536 --json report.json

A checkpoint is a run directory (its ``checkpoints/latest``), a ``checkpoints/`` directory or one
``checkpoints/step_XXXXXXXX/`` directory, of any ZeRO stage or parallel layout. The eval batches
are the trainer's (same eval shards, seed, masks and micro-batch rule, :mod:`roformer_dist.evaluation`),
so at a length the run evaluated during training the loss equals the trainer's. Every row carries
the unigram baseline at the same predicted positions.

Lengths past the longest the checkpoint was trained on are marked: a rotary model computes its
rotations for any length (only the attention patterns were never trained there); an absolute-position
model uses position rows that training never updated (they hold their initialisation, shrunk by
weight decay), and has no rows at all past ``model.max_position_embeddings`` (reported, not run).
Exit status: 0, 2 bad arguments, 4 data missing or inconsistent, 5 unusable checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from roformer_dist.errors import EXIT_CHECKPOINT, CheckpointError, ConfigError, DataError, exit_status


@dataclass
class Checkpoint:
    """A resolved training checkpoint."""

    dir: Path
    """The step_XXXXXXXX directory."""
    step: int
    """Optimizer steps done."""
    config: object
    """The run's Config, as saved in the checkpoint."""
    tokenizer_sha256: Optional[str]
    """sha256 of the tokenizer the run trained with."""

    @property
    def trained_max_len(self) -> int:
        """The longest sequence length of the curriculum stages that ran up to this step."""
        done, longest = 0, 0
        for st in self.config.curriculum.stages:
            if done >= self.step:
                break
            longest = max(longest, st.seq_len)
            done += st.steps
        return longest


def resolve_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A run directory, a checkpoints/ directory or a step directory -> the checkpoint it names."""
    from roformer_dist import checkpoint as ckpt
    from roformer_dist.config import from_dict

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or run directory")
    for candidate in (p / "checkpoints", p):
        if (candidate / ckpt.LATEST).is_file() and not ckpt.state_file(p, 0).exists():
            p = candidate / (candidate / ckpt.LATEST).read_text().strip()
            break
    if not ckpt.state_file(p, 0).exists():
        raise CheckpointError(f"{path}: not a roformer-dist checkpoint (expected a run directory with "
                              "checkpoints/latest, a checkpoints/ directory, or a step_XXXXXXXX directory "
                              "holding trainer_state_rank0.pt)")
    if not ckpt.is_complete(p):
        raise CheckpointError(f"{p}: incomplete checkpoint (no {ckpt.COMPLETE} marker): it was being written "
                              "when the run stopped")
    try:
        state = ckpt.load_trainer_state(p, 0)
        cfg = from_dict(state["config"])
        step = int(state["trainer"]["step"])
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{p}: cannot read the trainer state: {e}") from None
    return Checkpoint(p, step, cfg, state.get("tokenizer_sha256"))


def load_model(c: Checkpoint):
    """The checkpoint's weights in a plain :class:`RoFormerForMaskedLM` (fp32, eval mode)."""
    from roformer_dist.checkpoint import load_consolidated_weights
    from roformer_dist.hf import model_from_state_dict

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's consolidation prints per tensor group
            model_cfg, sd = load_consolidated_weights(c.dir)
        model = model_from_state_dict(model_cfg, sd)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{c.dir}: cannot load the model weights: {e}") from None
    return model.eval()


@dataclass
class Row:
    length: int
    loss: Optional[float] = None
    mlm_acc: Optional[float] = None
    unigram_loss: Optional[float] = None
    most_frequent_acc: Optional[float] = None
    predicted: int = 0
    note: str = ""

    @property
    def gap(self) -> Optional[float]:
        """Nats by which the model beats the unigram baseline."""
        return None if self.loss is None else self.unigram_loss - self.loss


@dataclass
class Report:
    checkpoint: str
    step: int
    position_embedding: str
    trained_max_len: int
    max_position_embeddings: int
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "step": self.step, "position_embedding": self.position_embedding,
                "trained_max_len": self.trained_max_len, "max_position_embeddings": self.max_position_embeddings,
                "rows": [{"length": r.length, "loss": r.loss, "unigram_loss": r.unigram_loss, "gap": r.gap,
                          "mlm_acc": r.mlm_acc, "most_frequent_acc": r.most_frequent_acc,
                          "predicted": r.predicted, "note": r.note} for r in self.rows]}


def length_note(position_embedding: str, length: int, trained: int, max_positions: int) -> tuple[bool, str]:
    """(can run, note) for evaluating at ``length`` a model trained up to ``trained``."""
    if length <= trained:
        return True, ""
    if position_embedding == "absolute":
        if length > max_positions:
            return False, (f"not run: absolute positions end at {max_positions} "
                           "(model.max_position_embeddings)")
        return True, f"absolute positions {trained}..{length - 1} untrained"
    return True, f"rotary, beyond the trained length {trained}"


def evaluate_checkpoint(path: str | os.PathLike, lengths: Sequence[int], *, eval_shards: Optional[str] = None,
                        shards: Optional[str] = None, batches: Optional[int] = None,
                        progress: bool = False) -> Report:
    """Evaluate one checkpoint at ``lengths``; see the module docstring."""
    from data_pipeline.shards import read_manifest
    from roformer_dist.config import replace
    from roformer_dist.evaluation import Evaluator, evaluate_model

    c = resolve_checkpoint(path)
    cfg = c.config
    changes = {}
    if shards:
        changes["data.shards"] = shards
    if eval_shards:
        changes["data.eval_shards"] = eval_shards
    if batches:
        changes["data.eval_batches"] = batches
    cfg = replace(cfg, **changes) if changes else cfg
    if not cfg.data.eval_shards:
        raise ConfigError(f"{c.dir}: the run had no data.eval_shards; pass --eval-shards")
    for key in ("shards", "eval_shards"):
        where = getattr(cfg.data, key)
        try:
            m = read_manifest(where)
        except ValueError as e:
            flag = "--shards" if key == "shards" else "--eval-shards"
            raise DataError(f"data.{key} of the run: {e} (pass {flag} if the shard set moved)") from None
        sha = m["tokenizer"]["sha256"]
        if c.tokenizer_sha256 and sha and sha != c.tokenizer_sha256:
            raise DataError(f"{where}: made with another tokenizer ({sha[:12]}) than the checkpoint "
                            f"({c.tokenizer_sha256[:12]})")
    model = load_model(c)
    mc = model.config
    report = Report(str(c.dir), c.step, mc.position_embedding, c.trained_max_len, mc.max_position_embeddings)
    evaluator = Evaluator(cfg)
    for length in lengths:
        ok, note = length_note(mc.position_embedding, length, c.trained_max_len, mc.max_position_embeddings)
        row = Row(length, note=note)
        if ok:
            if progress:
                print(f"  {Path(report.checkpoint).parent.parent.name or report.checkpoint}: length {length} ...",
                      file=sys.stderr, flush=True)
            r = evaluate_model(model, cfg, [length], evaluator)[length]
            row.loss, row.mlm_acc, row.predicted = r["loss"], r["mlm_acc"], r["predicted"]
            row.unigram_loss, row.most_frequent_acc = r["unigram_loss"], r["most_frequent_acc"]
        report.rows.append(row)
    return report


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_report(report: Report) -> str:
    lines = [f"{report.checkpoint}: step {report.step}, {report.position_embedding} positions, trained up to "
             f"length {report.trained_max_len}",
             f"{'length':>7} {'loss':>7} {'unigram':>8} {'gap':>7} {'mlm_acc':>8}  note"]
    for r in report.rows:
        lines.append(f"{r.length:>7} {_fmt(r.loss, '.4f'):>7} {_fmt(r.unigram_loss, '.4f'):>8} "
                     f"{_fmt(r.gap, '.3f'):>7} {_fmt(r.mlm_acc, '.4f'):>8}  {r.note}".rstrip())
    return "\n".join(lines)


def format_comparison(reports: Sequence[Report], names: Sequence[str]) -> str:
    """Loss per length, one column per checkpoint (lengths of the first report)."""
    width = max(9, *(len(n) for n in names))
    lines = [f"{'length':>7} " + " ".join(f"{n:>{width}}" for n in names)]
    for i, row in enumerate(reports[0].rows):
        cells = [_fmt(rep.rows[i].loss, ".4f") for rep in reports]
        lines.append(f"{row.length:>7} " + " ".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


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
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the reports as JSON")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except (CheckpointError, ConfigError, DataError) as e:
        print(f"roformer-eval: error: {e}", file=sys.stderr)
        return exit_status(e) or EXIT_CHECKPOINT


def _main(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches is not None and args.batches < 1:
        raise ConfigError(f"--batches: expected a positive integer, got {args.batches}")
    reports, names = [], []
    for path in args.checkpoints:
        lengths = args.lengths
        if not lengths:
            last = resolve_checkpoint(path).config.curriculum.stages[-1]
            lengths = list(last.eval_lengths or (last.seq_len,))
        rep = evaluate_checkpoint(path, lengths, eval_shards=args.eval_shards, shards=args.shards,
                                  batches=args.batches, progress=True)
        reports.append(rep)
        names.append(_short_name(path))
        print(format_report(rep), flush=True)
        print()
    if len(reports) > 1 and all([r.length for r in rep.rows] == [r.length for r in reports[0].rows]
                                for rep in reports):
        print("eval loss by length:")
        print(format_comparison(reports, names))
    if args.json:
        from data_pipeline.atomic import atomic_write_text

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
