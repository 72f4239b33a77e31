"""roformer-dist data pipeline: corpus -> SentencePiece -> webdataset shards -> resumable MLM loader.

Stages (see each module): :mod:`.corpus` (readers, normalisation), :mod:`.tokenizer`
(SentencePiece training/loading, word-start marks), :mod:`.shards` (format, manifest,
parallel writer, reader, verification), :mod:`.loader` (``ShardLoader``), :mod:`.masking`
(dynamic MLM masking), :mod:`.cli` (``roformer-data``). Does not import roformer_dist or launcher.
"""

__all__ = ["ShardLoader", "read_manifest", "check_tokenizer", "CorruptShardError"]


def __getattr__(name):  # lazy: `roformer-data --help` should not import torch
    if name == "ShardLoader":
        from .loader import ShardLoader
        return ShardLoader
    if name in ("read_manifest", "check_tokenizer", "CorruptShardError"):
        from . import shards
        return getattr(shards, name)
    raise AttributeError(name)
