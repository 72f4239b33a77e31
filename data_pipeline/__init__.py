"""roformer-dist data pipeline: corpus -> SentencePiece -> webdataset shards -> resumable MLM loader.

Stages (see each module): :mod:`.corpus` (readers, normalisation), :mod:`.tokenizer`
(SentencePiece training/loading, word-start marks), :mod:`.imported` (an existing HF tokenizer.json or
WordPiece vocab.txt with its own special ids), :mod:`.tario` (the shard tar format),
:mod:`.manifest` (the manifest and its checks), :mod:`.source` (shard sets in directories or at
URLs), :mod:`.shards` (building, reading, verification), :mod:`.cluster` (preparation split over
tasks, and the merge), :mod:`.slots` (who reads which documents, slot state), :mod:`.mixture`
(corpus mixtures: sources, token shares, the interleaving), :mod:`.loader` (``ShardLoader``),
:mod:`.masking` (dynamic MLM masking), :mod:`.cli` (``roformer-data``); :mod:`.pd_ner` (named entities
from People's Daily's tags, for the demo's NER task).

The pipeline imports nothing of roformer_dist or launcher (a checked contract: ``lint-imports``).
``roformer-data prepare|shards --tasks N`` runs its tasks through a runner handed to
:func:`.cli.main`: the ``roformer-data`` console script is ``launcher.prepare.main``, which hands it
submitit and the cluster profiles of ``roformer-submit``. :mod:`.errors` holds the project's error
protocol (every error class carries its exit status) and ``run_command``, the one CLI runner.
"""

__all__ = ["ShardLoader", "read_manifest", "check_tokenizer", "CorruptShardError", "DataError", "UsageError"]


def __getattr__(name):  # lazy: `roformer-data --help` should not import torch
    if name == "ShardLoader":
        from .loader import ShardLoader
        return ShardLoader
    if name in ("read_manifest", "check_tokenizer"):
        from . import manifest
        return getattr(manifest, name)
    if name == "CorruptShardError":
        from .tario import CorruptShardError
        return CorruptShardError
    if name in ("DataError", "UsageError"):
        from . import errors
        return getattr(errors, name)
    raise AttributeError(name)
