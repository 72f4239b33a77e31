"""The training data as the trainer sees it: the shard manifests checked against the config before
anything starts, and the loader's errors turned into one-line DataErrors."""

from __future__ import annotations

from typing import Optional

from data_pipeline.errors import UsageError
from data_pipeline.manifest import check_training_data
from data_pipeline.source import RetryPolicy, set_default_retry
from roformer_dist.config import Config, replace
from roformer_dist.errors import ConfigError, DataError

__all__ = ["resolve_data", "data_error"]


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


def resolve_data(cfg: Config, resumed_state: Optional[dict] = None) -> tuple[Config, dict]:
    """Read the shard manifests; fill model.vocab_size; refuse mismatches before training
    (:func:`data_pipeline.manifest.check_training_data`: DataError / UsageError naming the key and field)."""
    # URL reads of this process and of the loaders it creates (their workers inherit the policy)
    set_default_retry(RetryPolicy(attempts=cfg.data.url_retries, wait_s=cfg.data.url_retry_wait_s,
                                  timeout_s=cfg.data.url_timeout_s))
    auto = cfg.model.vocab_size == "auto"
    try:
        manifest = check_training_data(
            cfg.data.shards, cfg.data.eval_shards, model_vocab_size=None if auto else cfg.model.vocab_size,
            checkpoint_tokenizer_sha256=(resumed_state or {}).get("tokenizer_sha256"))
    except UsageError as e:  # a config key (data.shards empty, model.vocab_size) that disagrees with the data
        raise ConfigError(str(e)) from None
    if auto:
        cfg = replace(cfg, **{"model.vocab_size": int(manifest["vocab_size"])})
    return cfg, manifest
