"""roformer-dist data pipeline: corpus -> SentencePiece -> webdataset shards -> resumable MLM loader.

Stages (see each module): :mod:`.corpus` (input files -> documents, through the format table of
:mod:`.formats`: one reader per format, ``txt.py``, ``jsonl.py``, ``pd.py``, ``parquet.py``, ``arrow.py``
(Arrow files, ``datasets`` ``save_to_disk`` directories); :mod:`.lines`: files read as lines, ``.gz``,
``.zst``, :class:`~.lines.CorpusStats`; :mod:`.normalization`: what every document goes
through), :mod:`.tokenizer` (SentencePiece training/loading, word-start marks), :mod:`.imported` (an
existing HF tokenizer.json or WordPiece vocab.txt with its own special ids), :mod:`.tario` (the shard
tar format), :mod:`.manifest` (the manifest and its checks), :mod:`.source` (shard sets in directories
or at URLs), :mod:`.shards` (building, reading, verification), :mod:`.cluster` (preparation split over
tasks, and the merge), :mod:`.slots` (who reads which documents, slot state), :mod:`.mixture` (corpus
mixtures: sources, token shares, the interleaving), :mod:`.batches` (a slot's packed, masked batches),
:mod:`.loader` (``ShardLoader``), :mod:`.masking` (dynamic MLM masking); ``roformer-data``:
:mod:`.cli` (the flags, turned into one typed :mod:`.options` object at the edge, ``main``), :mod:`.cli_prepare`
(``prepare``, ``--source`` mixtures), :mod:`.cli_commands` (``tokenizer``, ``shards``, ``inspect``, ``--tasks``,
the steps they share);
:mod:`.pd_ner` (named entities from People's Daily's tags, for the demo's NER task); :mod:`.atomic`
(atomic writes, staged directories); :mod:`.errors` (below); :mod:`.command_line` (the argument parser of
every command of the project: options and positionals in any order, ``--version``).

Layers, top to bottom (``|``: modules that may not import each other; a module imports only from the
layers below its own), a checked contract (``lint-imports``, ``pyproject.toml``)::

    cli > cli_prepare > cli_commands > cluster | loader > batches > shards > manifest > imported
      > tokenizer | tario | source | corpus | mixture | masking | slots | pd_ner | options > formats
      > lines | normalization > atomic | errors | command_line

The pipeline imports nothing of roformer_dist or launcher (checked too), and knows none of their
config keys: an error about one of several inputs says which in a structured field (``DataError.input``,
``UsageError.argument``: a role of :mod:`.errors`), and the caller names it in its own words
(``roformer_dist.plan.data``: ``data.shards``; :mod:`.cli`: ``--tokenizer``). ``roformer-data
prepare|shards --tasks N`` runs its tasks through a runner handed to :func:`.cli.main`: the
``roformer-data`` console script is ``launcher.prepare.main``, which hands it submitit and the cluster
profiles of ``roformer-submit``. :mod:`.errors` holds the project's error protocol (every error class
carries its exit status) and ``run_command``, the one CLI runner. Start reading at :mod:`.corpus` and
:mod:`.loader`.
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
