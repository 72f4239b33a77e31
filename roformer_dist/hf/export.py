"""A complete Hugging Face model repository from our weights (``roformer-convert to-hf``).

Layout of the directory it writes::

    config.json               transformers.RoFormerConfig (tokenizer_class: PreTrainedTokenizerFast)
    model.safetensors         RoFormerForMaskedLM weights (tied decoder, sinusoidal table included)
    tokenizer.json            our normaliser + SentencePiece Unigram + [CLS]/[SEP] template (tokenizer.py);
                              for shards of an imported tokenizer, our normaliser + that tokenizer +
                              [CLS]/[SEP] at its ids
    tokenizer_config.json     fast tokenizer class, special tokens, token type ids among the inputs
    special_tokens_map.json
    tokenizer.model           the SentencePiece model the shards were made with (ours)
    vocab.txt                 the imported WordPiece vocabulary the shards were made with (imported)
    README.md                 model card (model_card.py)
    roformer_export.json      provenance: source, step, tokens seen, tokenizer sha256 and agreement check

The repository is built in a staging sibling and swapped into place when complete
(``data_pipeline.atomic.StagedDir``), so a failed export leaves nothing half-written; an existing
non-empty directory is replaced only with ``force`` (the old one is removed after the new one is in place).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from data_pipeline.atomic import StagedDir, atomic_write_text
from data_pipeline.imported import SENTENCEPIECE, ImportedTokenizer, kind_of
from data_pipeline.manifest import read_manifest, tokenizer_path
from data_pipeline.tokenizer import SPECIAL_IDS, sha256_file
from roformer_dist.checkpoint.lineage import read_parent_record
from roformer_dist.checkpoint.store import Found, checkpoint_config, read_trainer_state
from roformer_dist.config import training_sources
from roformer_dist.errors import ConfigError, DataError
from roformer_dist.hf.convert import check_exportable, to_hf_model
from roformer_dist.hf.model_card import render_model_card
from roformer_dist.hf.tokenizer import (build_fast_tokenizer, build_imported_fast_tokenizer, read_sp_model,
                                        roundtrip_agreement, write_imported_tokenizer_files, write_tokenizer_files)
from roformer_dist.runtime.events import read_scalars
from roformer_dist.runtime.rundir import RunDir

log = logging.getLogger(__name__)

__all__ = ["ExportSource", "ExportResult", "source_from_checkpoint", "find_tokenizer", "export_hf_repository",
           "check_out_dir", "share_with_group", "EXPORT_INFO"]

EXPORT_INFO = "roformer_export.json"


@dataclass
class ExportSource:
    """What is known about the weights being exported (for the model card and roformer_export.json)."""

    description: str
    """e.g. ``training checkpoint runs/demo/checkpoints/step_00000250``."""
    run_config: Any = None
    """The full run :class:`~roformer_dist.config.Config` of a training checkpoint, else None."""
    trainer: dict = field(default_factory=dict)
    """Trainer state of a training checkpoint: step, tokens_seen, samples_seen."""
    eval_metrics: dict = field(default_factory=dict)
    """``eval/*`` scalars of the last evaluation at or before the checkpoint's step."""
    eval_step: Optional[int] = None
    shard_dir: Optional[Path] = None
    """The training shard set (when it can be found)."""
    manifest: Optional[dict] = None
    eval_manifest: Optional[dict] = None
    parent: Optional[dict] = None
    """The run's ``parent.json`` (a warm start or fork: what its first weights came from), else None."""


@dataclass
class ExportResult:
    out: Path
    num_parameters: int
    tokenizer: Optional[Path]
    jieba: bool = False
    agreement: Any = None
    """:class:`~roformer_dist.hf.tokenizer.Agreement` of the round trip over training documents, or None."""
    files: list[str] = field(default_factory=list)


def _existing(path: str, run_dir: Path) -> Optional[Path]:
    """A path from a run config: as given (relative to the current directory), else next to the run."""
    if not path:
        return None
    p = Path(path)
    for cand in ([p] if p.is_absolute() else [p, run_dir.parent / p, run_dir / p]):
        if cand.is_dir():
            return cand
    return None


def _eval_scalars(run_dir: Path, step: int) -> tuple[dict, Optional[int]]:
    """``eval/*`` values of the last evaluation at or before ``step`` (from the run's TensorBoard)."""
    tb = RunDir(run_dir).tb
    if not tb.is_dir():
        return {}, None
    try:
        scalars = read_scalars(tb)
    except Exception as e:  # noqa: BLE001 - the card is still useful without them
        log.warning("cannot read %s: %s", tb, e)
        return {}, None
    steps = [s for tag, pts in scalars.items() if tag.startswith("eval/") for s, _ in pts if s <= step]
    if not steps:
        return {}, None
    at = max(steps)
    return {tag: v for tag, pts in scalars.items() if tag.startswith("eval/") for s, v in pts if s == at}, at


def source_from_checkpoint(found: Found) -> ExportSource:
    """What the model card says about a training checkpoint: its run config, counters, last eval, shards."""
    config = checkpoint_config(found)
    trainer = read_trainer_state(found.dir, 0).trainer.state_dict()
    run_dir = found.dir.parent.parent
    src = ExportSource(f"training checkpoint {found.dir}", run_config=config, trainer=trainer)
    src.eval_metrics, src.eval_step = _eval_scalars(run_dir, found.step)
    src.parent = read_parent_record(run_dir)
    sources = training_sources(config.data)
    src.shard_dir = _existing(sources[0].shards, run_dir) if sources else None
    eval_dir = _existing(config.data.eval_shards, run_dir)
    for attr, d in (("manifest", src.shard_dir), ("eval_manifest", eval_dir)):
        if d is not None:
            try:
                setattr(src, attr, read_manifest(d))
            except ValueError as e:
                log.warning("shard set %s: %s", d, e)
    return src


def find_tokenizer(given: Optional[str | os.PathLike], source: ExportSource) -> tuple[Optional[Path], bool]:
    """(tokenizer file, jieba) from ``given`` (a file: our SentencePiece .model or an imported tokenizer.json /
    vocab.txt; or a shard set) or the training shards."""
    if given is not None:
        p = Path(given)
        if p.is_dir():
            try:
                m = read_manifest(p)
            except ValueError as e:
                raise DataError(f"--tokenizer {p}: {e}") from None
            model = tokenizer_path(p, m)
            if model is None or not model.is_file():
                raise DataError(f"--tokenizer {p}: the shard set's tokenizer model {model} is missing")
            return model, bool(m.get("jieba", False))
        if not p.is_file():
            raise DataError(f"--tokenizer {p}: no such file (expected a SentencePiece .model, a tokenizer.json or "
                            "vocab.txt, or a shard set)")
        return p, False
    if source.manifest is not None and source.shard_dir is not None:
        model = tokenizer_path(source.shard_dir, source.manifest)
        if model is not None and model.is_file():
            return model, bool(source.manifest.get("jieba", False))
    return None, False


def share_with_group(d: Path) -> None:
    """transformers writes model.safetensors through a private (0600) temporary file: give the files of a
    saved model directory the permissions any other file of the user gets (a shared cluster's group can
    read them), except that neither the group nor others may write them, whatever the umask."""
    mask = os.umask(0)
    os.umask(mask)
    mask |= 0o022
    for p in d.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)
    os.chmod(d, 0o777 & ~mask)


def check_out_dir(out: Path, force: bool, flag: str = "--force") -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out}: directory exists and is not empty; pass {flag} to replace it")


def _load_tokenizer(tokenizer: Path, cfg):
    """(SentencePiece report or None, imported tokenizer or None) of the file ``tokenizer``, checked against
    the model: its vocabulary size and [PAD] id."""
    kind = kind_of(tokenizer)
    rep = read_sp_model(tokenizer) if kind == SENTENCEPIECE else None
    imported = None if kind == SENTENCEPIECE else ImportedTokenizer(tokenizer, kind)
    size = len(rep.vocab) if rep is not None else imported.vocab_size
    pad = imported.special_ids["pad"] if imported is not None else 0
    if size != cfg.vocab_size:
        raise DataError(f"tokenizer {tokenizer}: {size} pieces, but the model's vocabulary has "
                        f"{cfg.vocab_size} rows (another tokenizer than the one it was trained with?)")
    if pad != cfg.pad_token_id:
        raise DataError(f"tokenizer {tokenizer}: [PAD] has id {pad}, but the model's pad_token_id is "
                        f"{cfg.pad_token_id} (another tokenizer than the one it was trained with?)")
    return rep, imported


def export_hf_repository(model, out: str | os.PathLike, *, source: ExportSource,
                         tokenizer: Optional[Path] = None, jieba: bool = False, force: bool = False,
                         check_docs: int = 1000, say: Callable[[str], None] = print) -> ExportResult:
    """Write the HF repository of our ``model`` (see the module docstring) to ``out``. ``tokenizer``: the file
    the shards were made with (its kind from its name: ``.model`` ours, ``.json`` / ``.txt`` imported)."""
    out = Path(out)
    cfg = model.config
    check_exportable(cfg)
    check_out_dir(out, force)
    rep, imported = _load_tokenizer(Path(tokenizer), cfg) if tokenizer is not None else (None, None)
    # jieba only gave an imported tokenizer's word marks: its encoding, and tokenizer.json's, is without it
    jieba = (jieba or bool(rep and rep.jieba)) and imported is None
    result = ExportResult(out, model.num_parameters(), tokenizer, jieba)
    with StagedDir(out) as stage:
        tmp = stage.path
        hf = to_hf_model(model)
        if tokenizer is not None:
            hf.config.tokenizer_class = "PreTrainedTokenizerFast"
        hf.save_pretrained(str(tmp))
        if tokenizer is not None:
            if rep is not None:
                write_tokenizer_files(tmp, tokenizer, cfg.max_position_embeddings, rep)
                fast, ours = build_fast_tokenizer(rep), tokenizer
            else:
                write_imported_tokenizer_files(tmp, imported, cfg.max_position_embeddings)
                fast, ours = build_imported_fast_tokenizer(imported), imported
            if check_docs > 0 and source.shard_dir is not None and source.manifest is not None:
                result.agreement = roundtrip_agreement(fast, source.shard_dir, ours, max_docs=check_docs)
        info = _export_info(result, source, rep, imported)
        result.files = sorted([p.name for p in tmp.iterdir()] + ["README.md", EXPORT_INFO])
        atomic_write_text(tmp / "README.md", render_model_card(cfg, result, source, info))
        atomic_write_text(tmp / EXPORT_INFO, json.dumps(info, indent=2, ensure_ascii=False) + "\n")
        share_with_group(tmp)
        stage.commit()
    if result.agreement is not None:
        say(f"tokenizer check: {result.agreement.summary()} of the training shards "
            f"({source.shard_dir}) re-encoded by tokenizer.json")
    if jieba:
        say("warning: the tokenizer was trained with jieba word pre-segmentation, which tokenizer.json cannot "
            "express: AutoTokenizer encodes without it (see README.md in the export for exact encoding)")
    return result


def _export_info(result: ExportResult, source: ExportSource, rep, imported) -> dict:
    agr = result.agreement
    info = {"format": "roformer-dist-hf-export", "version": 1, "source": source.description,
            "step": source.trainer.get("step"), "tokens_seen": source.trainer.get("tokens_seen"),
            "eval_step": source.eval_step, "eval": {k: round(v, 6) for k, v in source.eval_metrics.items()},
            "num_parameters": result.num_parameters, "parent": source.parent, "tokenizer": None}
    if result.tokenizer is not None:
        info["tokenizer"] = {
            "sha256": sha256_file(result.tokenizer), "kind": SENTENCEPIECE if imported is None else imported.kind,
            "vocab_size": len(rep.vocab) if imported is None else imported.vocab_size,
            "special_ids": SPECIAL_IDS if imported is None else imported.special_ids, "jieba": result.jieba,
            "split_conflicts": rep.split_conflicts if imported is None else [],
            "roundtrip_check": None if agr is None else {"documents": agr.num_docs, "identical": agr.num_equal,
                                                         "examples": agr.examples}}
    return info
