"""``roformer-convert``: HF transformers RoFormer weights in and out.

    roformer-convert from-hf --hf-dir HF_DIR --out weights.pt
    roformer-convert from-hf --hf-dir HF_DIR --out OUT_DIR        # OUT_DIR/model.pt + OUT_DIR/model.yaml
    roformer-convert to-hf --checkpoint RUN_DIR/checkpoints/TAG --out HF_DIR     # tokenizer from the run's shards
    roformer-convert to-hf --checkpoint weights.pt --tokenizer SHARDS_OR_MODEL --out HF_DIR [--force]
    roformer-convert verify RUN_DIR [--mark-bad]      # every checkpoint's files against COMPLETE (sizes, hashes)

``to-hf`` writes a complete HF repository (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, tokenizer.model, README.md model card; see
roformer_dist/hf/export.py) into a temporary sibling of HF_DIR and renames it into place when complete.
It refuses a non-empty HF_DIR without --force. The tokenizer comes from --tokenizer (a SentencePiece
.model, an imported tokenizer.json or vocab.txt, or a shard set) or from the training checkpoint's shard
set: shards made with an imported tokenizer export that tokenizer, with its special ids (and its
vocab.txt instead of tokenizer.model); --no-tokenizer writes the model only.

The weights file (what ``from-hf`` writes and ``to-hf`` reads) is defined in
:mod:`roformer_dist.checkpoint.weights`; ``to-hf`` also accepts a bare state dict (our keys,
optionally prefixed ``module.``) with ``--config``. ``model.yaml`` beside ``model.pt`` holds the model
section, usable as ``model: OUT_DIR/model.yaml``.

``verify`` checks every complete checkpoint of a run (or one checkpoint directory) as a resume would
(each file present, its size and content hash as saved, its structure loadable), newest first, reports
each and which one a resume would take; it changes nothing unless ``--mark-bad`` (then a damaged one is
marked BAD, as a resume would mark it).

Exit status: 0 done (``verify``: every checkpoint checked out), 2 bad flag or a model HF cannot express
(ConfigError), 4 tokenizer missing or damaged (DataError), 5 checkpoint or weights missing or damaged
(CheckpointError), 74 the output cannot be written (disk full, read-only; nothing half-written is left).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional

from data_pipeline.command_line import CommandParser
from roformer_dist.config import load_config
from roformer_dist.errors import CheckpointError, ConfigError, DataError, run_command


def _config_from_file(path: Optional[str]):
    if path is None:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"--config {path}: config file not found")
    try:
        return load_config(path).model
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def _is_file_target(out: Path) -> bool:
    return out.suffix in (".pt", ".pth", ".bin") or out.is_file()


def cmd_from_hf(args) -> None:
    hf_dir = Path(args.hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: HF model directory not found")
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir}: no config.json (not a save_pretrained directory)")
    import yaml

    from data_pipeline.atomic import atomic_write_text
    from roformer_dist.checkpoint.weights import CONFIG_NAME, WEIGHTS_NAME, save_weights
    from roformer_dist.hf.convert import from_hf_pretrained

    try:
        model = from_hf_pretrained(hf_dir)
    except (OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"{hf_dir}: cannot load as an HF RoFormerForMaskedLM: {e}") from None
    out = Path(args.out)
    if _is_file_target(out):
        target = out
    else:
        out.mkdir(parents=True, exist_ok=True)
        target = out / WEIGHTS_NAME
        atomic_write_text(out / CONFIG_NAME, yaml.safe_dump(dataclasses.asdict(model.config), sort_keys=False))
    save_weights(target, model.config, model.state_dict())
    print(f"wrote {target} ({model.num_parameters():,} parameters) from {hf_dir}")


def _load_for_to_hf(args):
    """(ModelConfig, state dict, ExportSource) from a weights file, a from-hf directory or a checkpoint."""
    from roformer_dist.checkpoint.store import resolve
    from roformer_dist.checkpoint.weights import WEIGHTS_NAME, load_checkpoint_weights, load_weights, with_vocab_size
    from roformer_dist.hf.export import ExportSource, source_from_checkpoint

    cfg = _config_from_file(args.config)
    path = Path(args.checkpoint)
    weights = path / WEIGHTS_NAME if path.is_dir() and (path / WEIGHTS_NAME).is_file() else path
    if weights.is_file():  # a weights file, or a from-hf output directory
        return (*load_weights(weights, cfg), ExportSource(f"weights file {weights}"))
    found = resolve(path)
    model_cfg, sd = load_checkpoint_weights(found)
    cfg = with_vocab_size(cfg, sd, args.config) if cfg is not None else model_cfg
    return cfg, sd, source_from_checkpoint(found)


def cmd_to_hf(args) -> None:
    from roformer_dist.checkpoint.weights import model_from_state_dict
    from roformer_dist.hf.convert import check_exportable
    from roformer_dist.hf.export import check_out_dir, export_hf_repository, find_tokenizer

    if args.tokenizer is not None and args.no_tokenizer:
        raise ConfigError("--tokenizer and --no-tokenizer exclude each other")
    if args.check_docs < 0:
        raise ConfigError(f"--check-docs: expected a number >= 0, got {args.check_docs}")
    check_out_dir(Path(args.out), args.force)  # before the (slow) consolidation of a big checkpoint
    cfg, sd, source = _load_for_to_hf(args)
    check_exportable(cfg)
    tokenizer, jieba = (None, False) if args.no_tokenizer else find_tokenizer(args.tokenizer, source)
    if tokenizer is None and not args.no_tokenizer:
        where = (f"the run's shard set {source.run_config.data.shards or source.run_config.data.sources[0].shards!r} "
                 "was not found"
                 if source.run_config is not None else "a weights file names no tokenizer")
        raise DataError(f"{args.checkpoint}: no tokenizer to export ({where}); pass --tokenizer "
                        "<shard set, tokenizer.model, tokenizer.json or vocab.txt>, or --no-tokenizer for the "
                        "model alone")
    try:
        model = model_from_state_dict(cfg, {k: v.float() for k, v in sd.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{args.checkpoint}: state dict does not match the model config: {e}") from None
    res = export_hf_repository(model, args.out, source=source, tokenizer=tokenizer, jieba=jieba,
                               force=args.force, check_docs=args.check_docs)
    print(f"wrote HF repository {res.out} ({res.num_parameters:,} parameters) from {args.checkpoint}: "
          + " ".join(res.files))


def cmd_verify(args) -> None:
    import time

    from roformer_dist.checkpoint import store

    path = Path(args.run)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint directory")
    root, tags, single = store.named_checkpoints(path)
    tags = tags[::-1]  # newest first
    if not tags:
        raise CheckpointError(f"{path}: no checkpoints (expected {store.CHECKPOINT_FORMS})")
    damaged, usable = [], None
    for tag in tags:
        d = root / tag
        if not store.is_complete(d):
            print(f"{tag}  incomplete (no {store.COMPLETE} marker): resume ignores it")
            continue
        if store.is_bad(d):
            print(f"{tag}  marked {store.BAD} earlier: resume skips it")
            continue
        found = store.read_found(root, tag)
        if found is None:
            damaged.append(f"{tag}: unreadable {store.COMPLETE} marker")
            print(f"{tag}  DAMAGED: unreadable {store.COMPLETE} marker")
            continue
        t0 = time.monotonic()
        problems = store.check_share(found, 0, 1)
        size = sum(found.files.values())
        checked = "sizes, hashes and structure" if found.hashes else "sizes and structure (saved without hashes)"
        if problems:
            damaged.append(f"{tag}: " + "; ".join(problems))
            print(f"{tag}  DAMAGED: " + "; ".join(problems), flush=True)
            if args.mark_bad:
                store.mark_bad(d, problems)
                print(f"{tag}  marked {store.BAD}")
        else:
            usable = usable or tag
            print(f"{tag}  ok: {len(found.files)} files, {size / 1e6:.1f} MB, {checked} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    if not single:
        print(f"a resume would take: {usable or 'none (a fresh start, or an error when all are damaged)'}")
    if damaged:
        raise CheckpointError(f"{path}: {len(damaged)} damaged checkpoint(s)"
                              + ("" if args.mark_bad else " (--mark-bad marks them BAD, as a resume would)"))


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="roformer-convert",
        description="Convert RoFormer weights between roformer-dist and HF transformers "
                    "(RoFormerForMaskedLM, save_pretrained directories).",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{from-hf,to-hf,verify}")
    f = sub.add_parser("from-hf", help="HF save_pretrained directory -> roformer-dist weights file",
                       description="Read an HF RoFormerForMaskedLM directory (config.json + safetensors or "
                                   "bin) and write a roformer-dist weights file.")
    f.add_argument("--hf-dir", required=True, help="directory written by transformers' save_pretrained")
    f.add_argument("--out", required=True,
                   help="weights file (*.pt/*.pth/*.bin) or a directory (gets model.pt and model.yaml)")
    f.set_defaults(func=cmd_from_hf)
    t = sub.add_parser("to-hf", help="roformer-dist weights or training checkpoint -> HF directory",
                       description="Write a complete HF repository (RoFormerForMaskedLM weights, fast "
                                   "tokenizer, model card) from a training checkpoint "
                                   "<run_dir>/checkpoints/<tag>/ (any ZeRO stage or model-parallel layout; "
                                   "shards are consolidated), a weights file or a from-hf output directory.")
    t.add_argument("--checkpoint", required=True,
                   help="<run_dir>/checkpoints/<tag>/ (or checkpoints/, or the run directory: its newest complete "
                        "checkpoint not marked BAD), "
                        "a weights file, or a from-hf output directory")
    t.add_argument("--out", required=True,
                   help="output directory (the HF repository); refused when not empty, unless --force")
    t.add_argument("--config", default=None,
                   help="run config (e.g. <run_dir>/config.yaml) whose model section replaces the stored one")
    t.add_argument("--tokenizer", default=None,
                   help="the tokenizer the shards were made with: a SentencePiece .model, an imported "
                        "tokenizer.json or vocab.txt, or a shard set (default: the training checkpoint's shard set)")
    t.add_argument("--no-tokenizer", action="store_true", help="write the model without tokenizer files")
    t.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    t.add_argument("--check-docs", type=int, default=1000, metavar="N",
                   help="re-encode N training documents with tokenizer.json and report how many give the "
                        "training ids (0: skip; default 1000)")
    t.set_defaults(func=cmd_to_hf)
    v = sub.add_parser("verify", help="check every checkpoint of a run against its COMPLETE marker",
                       description="Check every complete checkpoint of a run directory (or one checkpoint "
                                   "directory) as a resume would: files present, sizes and content hashes as "
                                   "saved, structure loadable. Changes nothing unless --mark-bad.")
    v.add_argument("run", help="a run directory, its checkpoints/ directory, or a checkpoints/step_XXXXXXXX/ directory")
    v.add_argument("--mark-bad", action="store_true", help="mark damaged checkpoints BAD, as a resume would")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        args.func(args)
        return 0

    return run_command(f"roformer-convert {args.command}", body)


if __name__ == "__main__":
    sys.exit(main())

