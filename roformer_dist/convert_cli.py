"""``roformer-convert``: HF transformers RoFormer weights in and out.

    roformer-convert from-hf --hf-dir HF_DIR --out weights.pt
    roformer-convert from-hf --hf-dir HF_DIR --out OUT_DIR        # OUT_DIR/model.pt + OUT_DIR/model.yaml
    roformer-convert to-hf --checkpoint RUN_DIR/checkpoints/TAG --out HF_DIR     # tokenizer from the run's shards
    roformer-convert to-hf --checkpoint weights.pt --tokenizer SHARDS_OR_MODEL --out HF_DIR [--force]

``to-hf`` writes a complete HF repository (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, tokenizer.model, README.md model card; see
roformer_dist/hf_export.py) into a temporary sibling of HF_DIR and renames it into place when complete.
It refuses a non-empty HF_DIR without --force. The tokenizer comes from --tokenizer (a SentencePiece
.model or a shard set) or from the training checkpoint's shard set; --no-tokenizer writes the model only.

Weights file (what ``from-hf`` writes, what ``to-hf`` reads; :func:`save_weights` / :func:`load_weights`):
    torch.save({"format": "roformer-dist-weights", "version": 1,
                "model_config": dataclasses.asdict(ModelConfig),   # plain dict, vocab_size an int
                "state_dict": {our key: fp32 tensor}})              # keys of RoFormerForMaskedLM
``to-hf`` also accepts a bare state dict (our keys, optionally prefixed ``module.``) with ``--config``.
``model.yaml`` beside ``model.pt`` holds the model section, usable as ``model: OUT_DIR/model.yaml``.

Exit status: 0 done, 2 bad flag or a model HF cannot express (ConfigError), 4 tokenizer missing or
damaged (DataError), 5 checkpoint or weights missing or damaged (CheckpointError).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

from roformer_dist.errors import CheckpointError, ConfigError, DataError, exit_status

WEIGHTS_FORMAT = "roformer-dist-weights"
WEIGHTS_VERSION = 1
WEIGHTS_NAME = "model.pt"
CONFIG_NAME = "model.yaml"


def save_weights(path: str | os.PathLike, cfg, state_dict: dict) -> None:
    """Write the documented weights file (atomically)."""
    import torch

    from data_pipeline.atomic import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "model_config": dataclasses.asdict(cfg),
               "state_dict": {k: v.detach().float().cpu().contiguous() for k, v in state_dict.items()}}
    atomic_write(path, lambda f: torch.save(payload, f))


def _model_config(data: dict, where: str):
    from roformer_dist.config import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise CheckpointError(f"{where}: unknown model config key {unknown[0]!r}")
    return ModelConfig(**data)


def load_weights(path: str | os.PathLike, cfg=None):
    """A weights file (or a bare state dict file with ``cfg``) -> (ModelConfig, our state dict)."""
    import torch

    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - anything unreadable is a user error naming the file
        raise CheckpointError(f"{path}: not a readable torch weights file ({type(e).__name__}: {e})") from None
    if isinstance(obj, dict) and "state_dict" in obj:
        sd = obj["state_dict"]
        if cfg is None:
            if "model_config" not in obj:
                raise ConfigError(f"{path}: has no model_config; pass --config")
            cfg = _model_config(obj["model_config"], str(path))
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        sd = obj
        if cfg is None:
            raise ConfigError(f"{path}: a bare state dict carries no model config; pass --config")
    else:
        raise CheckpointError(f"{path}: expected a roformer-dist weights file ({{'model_config', 'state_dict'}}) "
                              "or a state dict")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return cfg, sd


def _resolve_vocab(cfg, sd: dict):
    if not isinstance(cfg.vocab_size, int):
        key = "embeddings.word_embeddings.weight"
        if key not in sd:
            raise CheckpointError(f"model.vocab_size is {cfg.vocab_size!r} and the state dict has no {key}")
        cfg = dataclasses.replace(cfg, vocab_size=int(sd[key].shape[0]))
    return cfg


def _config_from_file(path: Optional[str]):
    if path is None:
        return None
    from roformer_dist.config import load_config

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

    from roformer_dist.hf import from_hf_pretrained

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
        from data_pipeline.atomic import atomic_write_text

        atomic_write_text(out / CONFIG_NAME, yaml.safe_dump(dataclasses.asdict(model.config), sort_keys=False))
    save_weights(target, model.config, model.state_dict())
    print(f"wrote {target} ({model.num_parameters():,} parameters) from {hf_dir}")


def _load_for_to_hf(args):
    """(ModelConfig, state dict, ExportSource) from a weights file, a from-hf directory or a checkpoint."""
    from roformer_dist.hf_export import ExportSource, load_training_checkpoint, source_from_checkpoint

    cfg = _config_from_file(args.config)
    ckpt = Path(args.checkpoint)
    if ckpt.is_file():
        return (*load_weights(ckpt, cfg), ExportSource(f"weights file {ckpt}"))
    if ckpt.is_dir() and (ckpt / WEIGHTS_NAME).is_file():  # a from-hf output directory
        return (*load_weights(ckpt / WEIGHTS_NAME, cfg), ExportSource(f"weights file {ckpt / WEIGHTS_NAME}"))
    if not ckpt.exists():
        raise CheckpointError(f"{ckpt}: no such checkpoint file or directory")
    tc = load_training_checkpoint(ckpt)
    return (cfg or tc.model_config), tc.state_dict, source_from_checkpoint(tc)


def cmd_to_hf(args) -> None:
    from roformer_dist.hf import check_exportable, model_from_state_dict
    from roformer_dist.hf_export import check_out_dir, export_hf_repository, find_tokenizer

    if args.tokenizer is not None and args.no_tokenizer:
        raise ConfigError("--tokenizer and --no-tokenizer exclude each other")
    if args.check_docs < 0:
        raise ConfigError(f"--check-docs: expected a number >= 0, got {args.check_docs}")
    check_out_dir(Path(args.out), args.force)  # before the (slow) consolidation of a big checkpoint
    cfg, sd, source = _load_for_to_hf(args)
    cfg = _resolve_vocab(cfg, sd)
    check_exportable(cfg)
    tokenizer, jieba = (None, False) if args.no_tokenizer else find_tokenizer(args.tokenizer, source)
    if tokenizer is None and not args.no_tokenizer:
        where = (f"the run's shard set {source.run_config.data.shards!r} was not found"
                 if source.run_config is not None else "a weights file names no tokenizer")
        raise DataError(f"{args.checkpoint}: no tokenizer to export ({where}); pass --tokenizer "
                        "<shard set or tokenizer.model>, or --no-tokenizer for the model alone")
    try:
        model = model_from_state_dict(cfg, {k: v.float() for k, v in sd.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{args.checkpoint}: state dict does not match the model config: {e}") from None
    res = export_hf_repository(model, args.out, source=source, tokenizer=tokenizer, jieba=jieba,
                               force=args.force, check_docs=args.check_docs)
    print(f"wrote HF repository {res.out} ({res.num_parameters:,} parameters) from {args.checkpoint}: "
          + " ".join(res.files))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="roformer-convert",
        description="Convert RoFormer weights between roformer-dist and HF transformers "
                    "(RoFormerForMaskedLM, save_pretrained directories).",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{from-hf,to-hf}")
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
                   help="<run_dir>/checkpoints/<tag>/ (or checkpoints/, or the run directory: its latest), "
                        "a weights file, or a from-hf output directory")
    t.add_argument("--out", required=True,
                   help="output directory (the HF repository); refused when not empty, unless --force")
    t.add_argument("--config", default=None,
                   help="run config (e.g. <run_dir>/config.yaml) whose model section replaces the stored one")
    t.add_argument("--tokenizer", default=None,
                   help="SentencePiece .model or shard set (default: the training checkpoint's shard set)")
    t.add_argument("--no-tokenizer", action="store_true", help="write the model without tokenizer files")
    t.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    t.add_argument("--check-docs", type=int, default=1000, metavar="N",
                   help="re-encode N training documents with tokenizer.json and report how many give the "
                        "training ids (0: skip; default 1000)")
    t.set_defaults(func=cmd_to_hf)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"roformer-convert {args.command}: error: {e}", file=sys.stderr)
        return exit_status(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())

