"""The training data as the trainer sees it: the shard manifests checked against the config before
anything starts (the model's vocabulary size and [PAD] id come from the manifest), and the loader's
errors turned into one-line DataErrors."""

from __future__ import annotations

from typing import Optional

from data_pipeline.errors import UsageError
from data_pipeline.manifest import MANIFEST, as_source, check_same_tokenizer, check_tokenizer, check_training_data, \
    read_manifest
from data_pipeline.source import RetryPolicy, set_default_retry
from roformer_dist.config import Config, ModelConfig, replace, training_sources
from roformer_dist.errors import ConfigError, DataError

__all__ = ["resolve_data", "data_error", "source_manifests"]


def data_error(e: Exception, during: str) -> DataError:
    """A DataError with the loader's own message, saying when it happened. A DataLoader worker's
    exception arrives re-raised with the worker's traceback in its text ("Caught X in DataLoader worker
    ... Original Traceback ..."): only its last line, the error itself, is kept."""
    text = str(e)
    if "Original Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        kind, sep, rest = last.partition(": ")
        text = rest if sep and kind.split(".")[-1].endswith("Error") else last
    return DataError(f"{during}: {text}")


def source_manifests(cfg: Config, first: Optional[dict] = None) -> dict[str, dict]:
    """Name -> manifest of every training source (``first``: the first's, already read), each checked
    against its own tokenizer and against the first source's (DataError naming the source's key)."""
    sources = training_sources(cfg.data)
    out = {}
    for i, s in enumerate(sources):
        key = f"data.sources[{i}] ({s.name})" if cfg.data.sources else "data.shards"
        if i == 0 and first is not None:
            out[s.name] = first
            continue
        try:
            m = read_manifest(s.shards)
            check_tokenizer(s.shards, m)
        except DataError as e:
            raise DataError(f"{key}: {e}") from None
        if i:
            check_same_tokenizer(m, out[sources[0].name], f"{key}: {as_source(s.shards).child(MANIFEST)}",
                                 f"source {sources[0].name!r}'s")
        out[s.name] = m
    return out


def _pad_token_id(cfg: Config, manifest: dict, where: str) -> int:
    """The manifest's [PAD] id, which the model's ``pad_token_id`` must be: the default (0) is taken to mean
    "the data's"; another value that disagrees is a ConfigError naming both."""
    pad = int(manifest["special_ids"]["pad"])
    given = cfg.model.pad_token_id
    if given != pad and given != ModelConfig.pad_token_id:
        raise ConfigError(f"model.pad_token_id: {given} differs from the [PAD] id {pad} of the shards ({where}: "
                          "field 'special_ids.pad'); leave model.pad_token_id out to take the data's")
    return pad


def resolve_data(cfg: Config, resumed_state: Optional[dict] = None) -> tuple[Config, dict[str, dict]]:
    """Read the shard manifests; fill model.vocab_size and model.pad_token_id; refuse mismatches before training
    (:func:`data_pipeline.manifest.check_training_data`: DataError / UsageError naming the key and field).
    Returns the config and every training source's manifest (:func:`source_manifests`: name -> manifest,
    the first source's first)."""
    # URL reads of this process and of the loaders it creates (their workers inherit the policy)
    set_default_retry(RetryPolicy(attempts=cfg.data.url_retries, wait_s=cfg.data.url_retry_wait_s,
                                  timeout_s=cfg.data.url_timeout_s))
    auto = cfg.model.vocab_size == "auto"
    sources = training_sources(cfg.data)
    key = "data.sources[0]" if cfg.data.sources else "data.shards"
    try:
        manifest = check_training_data(
            sources[0].shards if sources else "", cfg.data.eval_shards,
            model_vocab_size=None if auto else cfg.model.vocab_size,
            checkpoint_tokenizer_sha256=(resumed_state or {}).get("tokenizer_sha256"))
    except UsageError as e:  # a config key (data.shards empty, model.vocab_size) that disagrees with the data
        raise ConfigError(str(e)) from None
    except DataError as e:
        text = str(e)
        raise DataError(key + text[len("data.shards"):] if text.startswith("data.shards") and cfg.data.sources
                        else text) from None
    manifests = source_manifests(cfg, manifest)
    for i, e in enumerate(cfg.data.eval_sources):
        where = f"data.eval_sources[{i}] ({e.name})"
        try:
            ev = read_manifest(e.shards)
            check_tokenizer(e.shards, ev)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        check_same_tokenizer(ev, manifest, f"{where}: {as_source(e.shards).child(MANIFEST)}", "the training data's")
    where = f"{key}: {as_source(sources[0].shards).child(MANIFEST)}"
    changes = {"model.pad_token_id": _pad_token_id(cfg, manifest, where)}
    if auto:
        changes["model.vocab_size"] = int(manifest["vocab_size"])
    return replace(cfg, **changes), manifests
