"""The model roformer-finetune trains: a sequence or token classifier on top of a pretrained (or fresh)
encoder.

``--model`` may be
- an HF export directory (``config.json``; ``roformer-convert to-hf`` output or any HF encoder with a
  fast tokenizer): ``AutoModelForSequenceClassification`` (the token task:
  ``AutoModelForTokenClassification``) + its tokenizer;
- a training checkpoint (``step_XXXXXXXX/``, ``checkpoints/`` or a run directory) or a roformer-dist
  weights file: the weights go into ``transformers.RoFormerForSequenceClassification`` (or
  ``RoFormerForTokenClassification``) in memory, with the tokenizer of the run's shard set (or ``--tokenizer``).
A model HF's RoFormer cannot express (``attention`` other than softmax, absolute positions), and any
sequence model with ``pooling="mean"``, is trained as our own encoder with the same head
(``NativeClassifier``) and saved as ``classifier.pt`` instead of HF files.

The classification head (HF's RoFormerClassificationHead): the pooled state -> dropout -> dense -> act ->
dropout -> linear to the labels. The pooled state is the [CLS] state (``pooling="cls"``, HF's choice) or
the mean of the states of the non-padding tokens (``pooling="mean"``). MLM pretraining never puts a loss
on the [CLS] output (it is never masked): the mean reads only outputs that pretraining trained. The token
head (HF's RoFormerForTokenClassification): each token's state -> dropout -> linear to the labels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from data_pipeline.atomic import atomic_write_text
from data_pipeline.imported import SENTENCEPIECE, ImportedTokenizer, kind_of
from roformer_dist.checkpoint.store import resolve
from roformer_dist.checkpoint.weights import WEIGHTS_NAME, load_checkpoint_weights, load_weights
from roformer_dist.config import ModelConfig, build
from roformer_dist.errors import CheckpointError, ConfigError, DataError
from roformer_dist.hf.convert import (check_exportable, from_hf_pretrained, hf_config_from, model_config_from_hf,
                                      state_dict_to_hf)
from roformer_dist.hf.export import find_tokenizer, source_from_checkpoint
from roformer_dist.hf.tokenizer import (TOKENIZER_FILES, load_hf_tokenizer, write_imported_tokenizer_files,
                                        write_tokenizer_files)
from roformer_dist.nn.model import ACTIVATIONS, RoFormerForMaskedLM

__all__ = ["Classifier", "NativeClassifier", "load_classifier", "load_native_classifier", "pool", "NATIVE_FILE",
           "POOLINGS", "HEADS"]

NATIVE_FILE = "classifier.pt"
NATIVE_FORMAT = "roformer-dist-classifier"
POOLINGS = ("cls", "mean")
HEADS = ("sequence", "token")


def pool(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor], pooling: str) -> torch.Tensor:
    """(B, S, H) encoder states -> (B, H): the [CLS] state, or the mean over positions where the mask is 1."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling != "mean":
        raise ConfigError(f"pooling: got {pooling!r}, expected one of {', '.join(POOLINGS)}")
    if attention_mask is None:
        return hidden.mean(1)
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class NativeClassifier(nn.Module):
    """Our encoder (any ModelConfig model.py supports) + HF RoFormer's classification head on the pooled
    state (``head="sequence"``: logits (B, labels)) or its token head (``head="token"``: (B, S, labels))."""

    def __init__(self, cfg, num_labels: int, pooling: str = "cls", head: str = "sequence"):
        super().__init__()
        if head not in HEADS:
            raise ConfigError(f"head: got {head!r}, expected one of {', '.join(HEADS)}")
        self.config = cfg
        self.num_labels = num_labels
        self.pooling = pooling
        self.head = head
        self.encoder = RoFormerForMaskedLM(cfg)
        del self.encoder.head  # the MLM head is not used: encode() gives the hidden states
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        if head == "sequence":
            self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.act = ACTIVATIONS[cfg.hidden_act]
        self.out_proj = nn.Linear(cfg.hidden_size, num_labels)
        for m in ([self.dense] if head == "sequence" else []) + [self.out_proj]:
            nn.init.normal_(m.weight, 0.0, cfg.initializer_range)
            nn.init.zeros_(m.bias)

    def load_encoder(self, sd: dict) -> None:
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        missing, unexpected = self.encoder.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"weights do not match the model config: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        h = self.encoder.encode(input_ids, attention_mask, token_type_ids)  # (B, S, H)
        if self.head == "token":
            return self.out_proj(self.dropout(h))
        h = pool(h, attention_mask, self.pooling)
        return self.out_proj(self.dropout(self.act(self.dense(self.dropout(h)))))


@dataclass
class Classifier:
    model: nn.Module
    tokenizer: Any
    """A transformers fast tokenizer."""
    backend: str
    """transformers | native"""
    description: str
    max_positions: int
    write_tokenizer: Callable[[Path], None]
    labels: list

    def logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """``model`` is ``self.model`` or its DDP wrapper."""
        if self.backend == "native":
            return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return model(**batch).logits

    def save(self, out: Path) -> None:
        """Write the model and its tokenizer to the (empty) directory ``out``."""
        if self.backend == "native":
            payload = {"format": NATIVE_FORMAT, "version": 1, "model_config": dataclasses.asdict(self.model.config),
                       "num_labels": self.model.num_labels, "pooling": self.model.pooling,
                       "head": self.model.head, "labels": list(self.labels),
                       "state_dict": {k: v.detach().cpu() for k, v in self.model.state_dict().items()}}
            torch.save(payload, out / NATIVE_FILE)
        else:
            self.model.save_pretrained(str(out))
        self.write_tokenizer(out)


def load_native_classifier(path: str | os.PathLike) -> tuple[NativeClassifier, Any]:
    """(model in eval mode, tokenizer) from a directory roformer-finetune saved with the native backend."""
    path = Path(path)
    try:
        obj = torch.load(path / NATIVE_FILE, map_location="cpu", weights_only=True)
        if obj.get("format") != NATIVE_FORMAT:
            raise ValueError(f"format {obj.get('format')!r}")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path / NATIVE_FILE}: not a roformer-finetune classifier ({e})") from None
    cfg = build(ModelConfig, obj["model_config"], f"{path / NATIVE_FILE}: model_config", CheckpointError)
    model = NativeClassifier(cfg, obj["num_labels"], obj["pooling"], obj.get("head", "sequence"))
    model.load_state_dict(obj["state_dict"])
    return model.eval(), load_hf_tokenizer(path)


def _label_maps(labels: list) -> dict:
    return {"id2label": {i: str(x) for i, x in enumerate(labels)},
            "label2id": {str(x): i for i, x in enumerate(labels)}}


def _from_hf_dir(path: Path, labels: list, from_scratch: bool, tokenizer: Optional[str], pooling: str,
                 head: str) -> Classifier:
    import transformers
    from transformers import AutoConfig

    auto = getattr(transformers, "AutoModelForTokenClassification" if head == "token"
                   else "AutoModelForSequenceClassification")
    try:
        config = AutoConfig.from_pretrained(str(path), num_labels=len(labels), **_label_maps(labels))
        if pooling == "mean":
            model = _native_from_hf(path, config, len(labels), from_scratch)
        elif from_scratch:
            model = auto.from_config(config)
        else:
            model = auto.from_pretrained(str(path), config=config)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"--model {path}: cannot load as an HF {head} classifier: {e}") from None
    max_pos = int(getattr(config, "max_position_embeddings", 512))
    tok_src = Path(tokenizer) if tokenizer else path
    tok = load_hf_tokenizer(tok_src, max_pos)

    def write_tokenizer(out: Path) -> None:
        if tok_src.is_dir() and (tok_src / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (tok_src / name).is_file():
                    shutil.copyfile(tok_src / name, out / name)
        else:
            _write_tokenizer(out, tok_src, max_pos)

    backend = "native" if pooling == "mean" else "transformers"
    return Classifier(model, tok, backend, f"HF export {path}", max_pos, write_tokenizer, labels)


def _native_from_hf(path: Path, config, num_labels: int, from_scratch: bool) -> NativeClassifier:
    """Our encoder with the weights of the HF RoFormer in ``path`` (mean pooling has no HF class)."""
    if config.model_type != "roformer":
        raise CheckpointError(f"--model {path}: --pooling mean needs a RoFormer model, this one is "
                              f"{config.model_type!r} (use --pooling cls)")
    model = NativeClassifier(model_config_from_hf(config), num_labels, "mean")
    if not from_scratch:
        model.load_encoder(from_hf_pretrained(path).state_dict())
    return model


def _write_tokenizer(out: Path, source: Path, max_pos: int) -> None:
    """The HF tokenizer files of a run's tokenizer: ours (a SentencePiece model) or an imported one."""
    source = source / "tokenizer.model" if source.is_dir() else source
    kind = kind_of(source)
    if kind == SENTENCEPIECE:
        write_tokenizer_files(out, source, max_pos)
    else:
        write_imported_tokenizer_files(out, ImportedTokenizer(source, kind), max_pos)


def _from_ours(cfg, sd: dict, what: str, sp_model: Path, labels: list, from_scratch: bool,
               pooling: str, head: str) -> Classifier:
    max_pos = cfg.max_position_embeddings
    tok = load_hf_tokenizer(sp_model, max_pos)

    def write_tokenizer(out: Path) -> None:
        _write_tokenizer(out, sp_model, max_pos)

    why = "--pooling mean" if pooling == "mean" else None
    if why is None:
        try:
            check_exportable(cfg)
        except ConfigError as e:
            why = str(e)
    if why is not None:
        model = NativeClassifier(cfg, len(labels), pooling, head)
        if not from_scratch:
            model.load_encoder(sd)
        return Classifier(model, tok, "native", f"{what} (native: {why})", max_pos, write_tokenizer, labels)
    from transformers import RoFormerForSequenceClassification, RoFormerForTokenClassification

    hf_cfg = hf_config_from(cfg)
    hf_cfg.num_labels = len(labels)
    hf_cfg.id2label, hf_cfg.label2id = _label_maps(labels).values()
    hf_cfg.tokenizer_class = "PreTrainedTokenizerFast"
    model = (RoFormerForTokenClassification if head == "token" else RoFormerForSequenceClassification)(hf_cfg)
    if not from_scratch:
        enc = {k: v for k, v in state_dict_to_hf(sd, cfg).items() if k.startswith("roformer.")}
        missing, unexpected = model.load_state_dict(enc, strict=False)
        if unexpected or any(not k.startswith("classifier.") for k in missing):
            raise CheckpointError(f"{what}: weights do not match the model: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")
    return Classifier(model, tok, "transformers", what, max_pos, write_tokenizer, labels)


def load_classifier(spec: str, labels: list, *, from_scratch: bool, seed: int,
                    tokenizer: Optional[str] = None, pooling: str = "cls", head: str = "sequence") -> Classifier:
    """The classifier for ``--model spec`` (see the module docstring): a label per sequence (``head=
    "sequence"``) or per token (``"token"``); head (and, with ``from_scratch``, every weight) initialised
    from ``seed``."""
    if pooling not in POOLINGS:
        raise ConfigError(f"--pooling: got {pooling!r}, expected one of {', '.join(POOLINGS)}")
    if head not in HEADS:
        raise ConfigError(f"head: got {head!r}, expected one of {', '.join(HEADS)}")
    if head == "token" and pooling != "cls":
        raise ConfigError("--pooling applies to sentence tasks: a token classifier reads every token's state")
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"--model {path}: no such file or directory")
    torch.manual_seed(seed)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_hf_dir(path, labels, from_scratch, tokenizer, pooling, head)
    weights = path / WEIGHTS_NAME if path.is_dir() and (path / WEIGHTS_NAME).is_file() else path
    if weights.is_file():
        cfg, sd = load_weights(weights)
        if tokenizer is None:
            raise DataError(f"--model {weights}: a weights file names no tokenizer; pass --tokenizer "
                            "<shard set or tokenizer.model>")
        sp_model, _ = find_tokenizer(tokenizer, None)
        return _from_ours(cfg, sd, f"weights file {weights}", sp_model, labels, from_scratch, pooling, head)
    found = resolve(path)
    model_cfg, sd = load_checkpoint_weights(found)
    source = source_from_checkpoint(found)
    sp_model, jieba = find_tokenizer(tokenizer, source)
    if sp_model is None:
        raise DataError(f"--model {path}: the run's shard set {source.run_config.data.shards!r} was not found, "
                        "so there is no tokenizer; pass --tokenizer <shard set or tokenizer.model>")
    what = f"training checkpoint {found.dir} (step {found.step})"
    if jieba:
        what += " [jieba-trained tokenizer: encoded without jieba]"
    return _from_ours(model_cfg, sd, what, sp_model, labels, from_scratch, pooling, head)


def describe(clf: Classifier) -> str:
    n = sum(p.numel() for p in clf.model.parameters())
    what = "token head" if _head_of(clf.model) == "token" else f"{getattr(clf.model, 'pooling', 'cls')} pooling"
    return f"{clf.description}; {clf.backend} model, {n:,} parameters, {len(clf.labels)} labels, {what}"


def _head_of(model: nn.Module) -> str:
    if isinstance(model, NativeClassifier):
        return model.head
    return "token" if type(model).__name__.endswith("ForTokenClassification") else "sequence"


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
