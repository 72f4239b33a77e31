"""A checkpoint's eval loss at any sequence length, beside the unigram baseline (``roformer-eval``'s work).

The eval batches are the trainer's (same eval shards, seed, masks and micro-batch rule,
:mod:`roformer_dist.observe.evaluation`), so at a length the run evaluated during training the loss
equals the trainer's. Every row carries the unigram baseline at the same predicted positions.

Lengths past the longest the checkpoint was trained on are marked: a rotary model computes its
rotations for any length (only the attention patterns were never trained there); an absolute-position
model uses position rows that training never updated (they hold their initialisation, shrunk by
weight decay), and has no rows at all past ``model.max_position_embeddings`` (reported, not run).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from data_pipeline.manifest import read_manifest
from data_pipeline.source import is_url
from roformer_dist.checkpoint.lineage import read_parent_record
from roformer_dist.checkpoint.store import Found, checkpoint_config, read_trainer_state, resolve
from roformer_dist.checkpoint.weights import load_checkpoint_weights, model_from_state_dict
from roformer_dist.config import Config, replace, training_sources
from roformer_dist.errors import CheckpointError, ConfigError, DataError
from roformer_dist.nn.model import RoFormerForMaskedLM
from roformer_dist.observe.evaluation import Evaluator, evaluate_model
from roformer_dist.plan.curriculum import trained_max_len
from roformer_dist.plan.decay_branch import describe_decay

__all__ = ["Row", "Report", "Opened", "length_note", "load_model", "open_checkpoint", "evaluate_checkpoint", "format_report",
           "format_comparison"]


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
    packing: str = "document"
    """The eval rows' data.packing."""
    rows: list[Row] = field(default_factory=list)
    origin: str = ""
    """Where the run came from when it is a decay branch (its parent.json, in words); else empty."""

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "step": self.step, "position_embedding": self.position_embedding,
                "trained_max_len": self.trained_max_len, "max_position_embeddings": self.max_position_embeddings,
                "packing": self.packing, "origin": self.origin, "rows": [{"length": r.length, "loss": r.loss, "unigram_loss": r.unigram_loss, "gap": r.gap,
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


def load_model(found: Found) -> RoFormerForMaskedLM:
    """The checkpoint's weights in a plain :class:`RoFormerForMaskedLM` (fp32, eval mode)."""
    model_cfg, sd = load_checkpoint_weights(found)
    try:
        model = model_from_state_dict(model_cfg, sd)
    except (ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{found.dir}: cannot load the model weights: {e}") from None
    return model.eval()


@dataclass
class Opened:
    """A checkpoint ready to evaluate (:func:`open_checkpoint`)."""
    found: Found
    cfg: Config
    """The run's config with the command line's data changes."""
    trained: int
    """The longest length it was trained at."""
    lengths: list[int]
    """The lengths asked for, or the eval lengths of the run's last stage."""
    model: RoFormerForMaskedLM


def open_checkpoint(path: str | os.PathLike, lengths: Optional[Sequence[int]] = None, *,
                    eval_shards: Optional[str] = None, shards: Optional[str] = None, batches: Optional[int] = None,
                    packing: Optional[str] = None) -> Opened:
    """The checkpoint ``path`` names (:func:`~roformer_dist.checkpoint.store.resolve`), its run config with
    the given data changes (shard sets checked against its tokenizer; URLs only when given here) and its
    model; ``packing``: the eval rows' ``data.packing`` (default: the run's)."""
    found = resolve(path)
    state = read_trainer_state(found.dir, 0)
    cfg = checkpoint_config(found)
    trained = trained_max_len(cfg.curriculum.stages, found.step)
    if not lengths:
        last = cfg.curriculum.stages[-1]
        lengths = list(last.eval_lengths or (last.seq_len,))
    changes = {}
    if shards:
        changes["data.shards"], changes["data.sources"] = shards, ()
    if eval_shards:
        changes["data.eval_shards"] = eval_shards
    if batches:
        changes["data.eval_batches"] = batches
    if packing:
        changes["data.packing"] = packing
    cfg = replace(cfg, **changes) if changes else cfg
    if not cfg.data.eval_shards:
        raise ConfigError(f"{found.dir}: the run had no data.eval_shards; pass --eval-shards")
    sets = [(f"data.sources[{i}]" if cfg.data.sources else "data.shards", "--shards", s.shards, shards)
            for i, s in enumerate(training_sources(cfg.data))]
    sets.append(("data.eval_shards", "--eval-shards", cfg.data.eval_shards, eval_shards))
    for key, flag, where, given in sets:
        if is_url(where) and where != given:
            # a URL or pipe: command is run only when the user gives it, never from a stored config
            raise ConfigError(f"{key} of the run is the URL {where!r}: shard sets at URLs are read only "
                              f"when given on the command line; pass {flag} {shlex.quote(where)} if you trust it")
    for key, flag, where, _ in sets:
        try:
            m = read_manifest(where)
        except ValueError as e:
            raise DataError(f"{key} of the run: {e} (pass {flag} if the shard set moved)") from None
        sha = m["tokenizer"]["sha256"]
        if state.tokenizer_sha256 and sha and sha != state.tokenizer_sha256:
            raise DataError(f"{where}: made with another tokenizer ({sha[:12]}) than the checkpoint "
                            f"({state.tokenizer_sha256[:12]})")
    return Opened(found, cfg, trained, list(lengths), load_model(found))


def evaluate_checkpoint(path: str | os.PathLike, lengths: Optional[Sequence[int]] = None, *, eval_shards: Optional[str] = None,
                        shards: Optional[str] = None, batches: Optional[int] = None,
                        packing: Optional[str] = None, progress: bool = False) -> Report:
    """Evaluate the checkpoint ``path`` names at ``lengths`` (default: the eval lengths of the run's last
    stage); see the module docstring and :func:`open_checkpoint` for the other arguments."""
    c = open_checkpoint(path, lengths, eval_shards=eval_shards, shards=shards, batches=batches, packing=packing)
    cfg, trained, model = c.cfg, c.trained, c.model
    mc = model.config
    report = Report(str(c.found.dir), c.found.step, mc.position_embedding, trained, mc.max_position_embeddings,
                    cfg.data.packing, origin=describe_decay(read_parent_record(c.found.dir.parent.parent)))
    evaluator = Evaluator(cfg)
    for length in c.lengths:
        ok, note = length_note(mc.position_embedding, length, trained, mc.max_position_embeddings)
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
             f"length {report.trained_max_len}, eval rows packed {report.packing}"
             + (f"\n  {report.origin}" if report.origin else ""),
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
