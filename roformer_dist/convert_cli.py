"""``roformer-convert``: HF transformers RoFormer weights in and out.

    roformer-convert from-hf --hf-dir HF_DIR --out weights.pt
    roformer-convert from-hf --hf-dir HF_DIR --out OUT_DIR        # OUT_DIR/model.pt + OUT_DIR/model.yaml
    roformer-convert to-hf --checkpoint weights.pt --out HF_DIR
    roformer-convert to-hf --checkpoint RUN_DIR/checkpoints/TAG --out HF_DIR [--config RUN_DIR/config.yaml]

Weights file (what ``from-hf`` writes, what ``to-hf`` reads; :func:`save_weights` / :func:`load_weights`):
    torch.save({"format": "roformer-dist-weights", "version": 1,
                "model_config": dataclasses.asdict(ModelConfig),   # plain dict, vocab_size an int
                "state_dict": {our key: fp32 tensor}})              # keys of RoFormerForMaskedLM
``to-hf`` also accepts a bare state dict (our keys, optionally prefixed ``module.``) with ``--config``.
``model.yaml`` beside ``model.pt`` holds the model section, usable as ``model: OUT_DIR/model.yaml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

WEIGHTS_FORMAT = "roformer-dist-weights"
WEIGHTS_VERSION = 1
WEIGHTS_NAME = "model.pt"
CONFIG_NAME = "model.yaml"


class ConvertError(Exception):
    """A user error; the CLI prints it and exits with status 1."""


def save_weights(path: str | os.PathLike, cfg, state_dict: dict) -> None:
    """Write the documented weights file (atomically)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "model_config": dataclasses.asdict(cfg),
               "state_dict": {k: v.detach().float().cpu().contiguous() for k, v in state_dict.items()}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _model_config(data: dict, where: str):
    from roformer_dist.config import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConvertError(f"{where}: unknown model config key {unknown[0]!r}")
    return ModelConfig(**data)


def load_weights(path: str | os.PathLike, cfg=None):
    """A weights file (or a bare state dict file with ``cfg``) -> (ModelConfig, our state dict)."""
    import torch

    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - anything unreadable is a user error naming the file
        raise ConvertError(f"{path}: not a readable torch weights file ({type(e).__name__}: {e})") from None
    if isinstance(obj, dict) and "state_dict" in obj:
        sd = obj["state_dict"]
        if cfg is None:
            if "model_config" not in obj:
                raise ConvertError(f"{path}: has no model_config; pass --config")
            cfg = _model_config(obj["model_config"], str(path))
    elif isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        sd = obj
        if cfg is None:
            raise ConvertError(f"{path}: a bare state dict carries no model config; pass --config")
    else:
        raise ConvertError(f"{path}: expected a roformer-dist weights file ({{'model_config', 'state_dict'}}) "
                           "or a state dict")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return cfg, sd


def _resolve_vocab(cfg, sd: dict):
    if not isinstance(cfg.vocab_size, int):
        key = "embeddings.word_embeddings.weight"
        if key not in sd:
            raise ConvertError(f"model.vocab_size is {cfg.vocab_size!r} and the state dict has no {key}")
        cfg = dataclasses.replace(cfg, vocab_size=int(sd[key].shape[0]))
    return cfg


def _config_from_file(path: Optional[str]):
    if path is None:
        return None
    from roformer_dist.config import load_config

    if not Path(path).is_file():
        raise ConvertError(f"{path}: config file not found")
    try:
        return load_config(path).model
    except ValueError as e:
        raise ConvertError(f"{path}: {e}") from None


def _is_file_target(out: Path) -> bool:
    return out.suffix in (".pt", ".pth", ".bin") or out.is_file()


def cmd_from_hf(args) -> None:
    hf_dir = Path(args.hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: HF model directory not found")
    if not (hf_dir / "config.json").is_file():
        raise ConvertError(f"{hf_dir}: no config.json (not a save_pretrained directory)")
    import yaml

    from roformer_dist.hf import from_hf_pretrained

    try:
        model = from_hf_pretrained(hf_dir)
    except (OSError, KeyError, ValueError) as e:
        raise ConvertError(f"{hf_dir}: cannot load as an HF RoFormerForMaskedLM: {e}") from None
    out = Path(args.out)
    if _is_file_target(out):
        target = out
    else:
        out.mkdir(parents=True, exist_ok=True)
        target = out / WEIGHTS_NAME
        (out / CONFIG_NAME).write_text(yaml.safe_dump(dataclasses.asdict(model.config), sort_keys=False),
                                       encoding="utf-8")
    save_weights(target, model.config, model.state_dict())
    print(f"wrote {target} ({model.num_parameters():,} parameters) from {hf_dir}")


def _load_for_to_hf(args):
    cfg = _config_from_file(args.config)
    ckpt = Path(args.checkpoint)
    if ckpt.is_file():
        return load_weights(ckpt, cfg)
    if ckpt.is_dir():
        if (ckpt / WEIGHTS_NAME).is_file():  # a from-hf output directory
            return load_weights(ckpt / WEIGHTS_NAME, cfg)
        from roformer_dist.checkpoint import load_consolidated_weights

        try:
            ckpt_cfg, sd = load_consolidated_weights(ckpt)
        except (FileNotFoundError, ValueError) as e:
            raise ConvertError(f"{ckpt}: cannot read training checkpoint: {e}") from None
        return (cfg or ckpt_cfg), sd
    raise ConvertError(f"{ckpt}: no such checkpoint file or directory")


def cmd_to_hf(args) -> None:
    from roformer_dist.hf import model_from_state_dict, to_hf_pretrained

    cfg, sd = _load_for_to_hf(args)
    cfg = _resolve_vocab(cfg, sd)
    if cfg.position_embedding != "rotary":
        raise ConvertError(f"{args.checkpoint}: model.position_embedding is {cfg.position_embedding!r}; "
                           "only rotary models have an HF RoFormer equivalent")
    try:
        model = model_from_state_dict(cfg, {k: v.float() for k, v in sd.items()})
    except RuntimeError as e:
        raise ConvertError(f"{args.checkpoint}: state dict does not match the model config: {e}") from None
    to_hf_pretrained(model, args.out)
    print(f"wrote HF RoFormerForMaskedLM to {args.out} ({model.num_parameters():,} parameters) "
          f"from {args.checkpoint}")


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
                       description="Write an HF RoFormerForMaskedLM directory (config.json + "
                                   "model.safetensors) from a weights file, a from-hf output directory, "
                                   "or a training checkpoint directory <run_dir>/checkpoints/<tag>/ "
                                   "(any ZeRO stage; shards are consolidated).")
    t.add_argument("--checkpoint", required=True,
                   help="weights file, from-hf output directory, or <run_dir>/checkpoints/<tag>/")
    t.add_argument("--out", required=True, help="output directory for save_pretrained files")
    t.add_argument("--config", default=None,
                   help="run config (e.g. <run_dir>/config.yaml) whose model section replaces the stored one")
    t.set_defaults(func=cmd_to_hf)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ConvertError as e:
        print(f"roformer-convert {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

