"""``roformer-data``'s options, typed: the command line is turned into one :class:`DataOptions` at the edge
(``cli.options_of``), and nothing below the command line sees argparse's namespace.

The groups follow the flags' groups: the corpus (:class:`CorpusOptions`: the inputs, their format and how a
format reads them, :class:`~data_pipeline.formats.base.ReadOptions`, handed whole to the readers), the
tokenizer's training (:class:`TokenizerTraining`), the shard set (:class:`ShardOptions`), the tasks of
``--tasks`` (:class:`ClusterOptions`) and ``inspect``'s (:class:`InspectOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .formats import AUTO, ReadOptions

__all__ = ["CorpusOptions", "TokenizerTraining", "ShardOptions", "ClusterOptions", "InspectOptions", "DataOptions"]


@dataclass(frozen=True)
class CorpusOptions:
    inputs: tuple[str, ...] = ()
    """Files, directories or globs (``--input``)."""
    fmt: str = AUTO
    """A format of :data:`~data_pipeline.formats.FORMATS`, or ``auto`` (file by file)."""
    read: ReadOptions = ReadOptions()
    """How the files are read (``--doc-boundary``, ``--text-field``, ``--strict``, ``--max-line-bytes``)."""
    jieba: bool = False
    """jieba word pre-segmentation."""


@dataclass(frozen=True)
class TokenizerTraining:
    vocab_size: Optional[int] = None
    model_type: str = "unigram"
    character_coverage: float = 0.9995
    byte_fallback: bool = True
    input_sentence_size: int = 2_000_000
    num_threads: int = 1


@dataclass(frozen=True)
class ShardOptions:
    workers: Optional[int] = None
    """Tokenising processes (None: one per CPU)."""
    shard_size_mb: float = 64.0
    max_docs_per_shard: Optional[int] = None
    progress: bool = True


@dataclass(frozen=True)
class ClusterOptions:
    tasks: Optional[int] = None
    cluster: Optional[str] = None
    """local | slurm; None: slurm where sbatch exists."""
    profile: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time: Optional[int] = None
    """Minutes per task."""
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    sample_docs: int = 200_000


@dataclass(frozen=True)
class InspectOptions:
    dir: str = ""
    verify: bool = False
    samples: int = 3
    url_timeout_s: Optional[float] = None


@dataclass(frozen=True)
class DataOptions:
    """One ``roformer-data`` command with its options."""
    command: str
    out: str = ""
    force: bool = False
    tokenizer: Optional[str] = None
    """An existing tokenizer (``--tokenizer``) instead of training one."""
    corpus: CorpusOptions = CorpusOptions()
    training: TokenizerTraining = TokenizerTraining()
    shards: ShardOptions = ShardOptions()
    cluster: ClusterOptions = ClusterOptions()
    sources: tuple[str, ...] = ()
    """``prepare --source NAME=INPUT``, as given."""
    tokenizer_weights: Optional[str] = None
    inspect: InspectOptions = InspectOptions()
    run_tasks: Optional[Callable] = field(default=None, compare=False)
    """The launcher's runner of ``--tasks`` (``launcher.prepare.run_tasks``); None: ``--tasks`` is refused."""
