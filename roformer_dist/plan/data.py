"""The training data as the trainer sees it: the shard manifests checked against the config before
anything starts (the model's vocabulary size and [PAD] id come from the manifest), and the loader's
errors turned into one-line DataErrors."""

from __future__ import annotations

from typing import Optional

from data_pipeline.errors import EVAL_SET, MODEL_VOCAB_SIZE, TRAINING_SET, UsageError
from data_pipeline.manifest import MANIFEST, as_source, check_same_tokenizer, check_tokenizer, check_training_data, \
    read_manifest
from data_pipeline.source import RetryPolicy, set_default_retry
from data_pipeline.tario import CorruptShardError
from roformer_dist.config import Config, ModelConfig, replace, training_sources
from roformer_dist.errors import ConfigError, DataError

__all__ = ["resolve_data", "data_error", "source_manifests"]


def data_error(e: Exception, during: str) -> DataError:
    """A DataError with the loader's own message, saying when it happened. A DataLoader worker's
    exception arrives re-raised with the worker's traceback in its text ("Caught X in DataLoader worker
    ... Original Traceback ..."): only its last line, the error itself, is kept. A bad shard (which the
    loader refuses unless told to skip them) says how to skip them."""
    text = str(e)
    if "Original Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        kind, sep, rest = last.partition(": ")
        text = rest if sep and kind.split(".")[-1].endswith("Error") else last
    hint = " (set data.skip_bad_shards=true to skip bad shards)" if isinstance(e, CorruptShardError) else ""
    return DataError(f"{during}: {text}{hint}")


def _source_key(cfg: Config, i: int) -> str:
    """The config key of training source ``i``, for messages."""
    return f"data.sources[{i}] ({cfg.data.sources[i].name})" if cfg.data.sources else "data.shards"


def source_manifests(cfg: Config, first: Optional[dict] = None) -> dict[str, dict]:
    """Name -> manifest of every training source (``first``: the first's, already read), each checked
    against its own tokenizer and against the first source's (DataError naming the source's key)."""
    sources = training_sources(cfg.data)
    out = {}
    for i, s in enumerate(sources):
        key = _source_key(cfg, i)
        if i == 0 and first is not None:
            out[s.name] = first
            continue
        try:
            m = read_manifest(s.shards)
            check_tokenizer(s.shards, m)
        except DataError as e:
            raise e.naming(key) from None
        if i:
            check_same_tokenizer(m, out[sources[0].name], str(as_source(s.shards).child(MANIFEST)),
                                 f"source {sources[0].name!r}'s", input=key)
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
    (:func:`data_pipeline.manifest.check_training_data`: DataError / UsageError saying which input, named here by
    its config key, and which field). Returns the config and every training source's manifest
    (:func:`source_manifests`: name -> manifest, the first source's first)."""
    # URL reads of this process and of the loaders it creates (their workers inherit the policy)
    set_default_retry(RetryPolicy(attempts=cfg.data.url_retries, wait_s=cfg.data.url_retry_wait_s,
                                  timeout_s=cfg.data.url_timeout_s))
    auto = cfg.model.vocab_size == "auto"
    sources = training_sources(cfg.data)
    key = _source_key(cfg, 0)
    keys = {TRAINING_SET: key, EVAL_SET: "data.eval_shards", MODEL_VOCAB_SIZE: "model.vocab_size"}
    try:
        manifest = check_training_data(
            sources[0].shards if sources else "", cfg.data.eval_shards,
            model_vocab_size=None if auto else cfg.model.vocab_size,
            checkpoint_tokenizer_sha256=(resumed_state or {}).get("tokenizer_sha256"))
    except UsageError as e:  # a config value (no training set, model.vocab_size) that disagrees with the data
        hint = "; use model.vocab_size=auto" if e.argument == MODEL_VOCAB_SIZE else ""
        raise ConfigError(f"{e.naming(keys[e.argument]) if e.argument in keys else e}{hint}") from None
    except DataError as e:
        if e.input not in keys:
            raise
        raise e.naming(keys[e.input]) from None
    manifests = source_manifests(cfg, manifest)
    for i, e in enumerate(cfg.data.eval_sources):
        where = f"data.eval_sources[{i}] ({e.name})"
        try:
            ev = read_manifest(e.shards)
            check_tokenizer(e.shards, ev)
        except DataError as err:
            raise err.naming(where) from None
        check_same_tokenizer(ev, manifest, str(as_source(e.shards).child(MANIFEST)), "the training data's",
                             input=where)
    where = f"{key}: {as_source(sources[0].shards).child(MANIFEST)}"
    changes = {"model.pad_token_id": _pad_token_id(cfg, manifest, where)}
    if auto:
        changes["model.vocab_size"] = int(manifest["vocab_size"])
    return replace(cfg, **changes), manifests
