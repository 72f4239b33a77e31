"""What an attention kind declares (see the package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["AttentionKind", "MemoryContext"]


@dataclass(frozen=True)
class MemoryContext:
    """What a kind's activation memory may depend on (``launch/memory_estimate.py``)."""
    seq_len: int
    heads: int
    """Attention heads on one tensor-parallel rank."""
    value_bytes: int
    """Bytes of one activation value in the run's precision."""
    eager_dropout: bool
    """Attention dropout on the CPU: the eager path, which keeps the probabilities."""
    document_mask: bool
    """Rows of several documents through a dense block-diagonal mask."""


@dataclass(frozen=True)
class AttentionKind:
    name: str
    attend: Callable
    mixing: Callable[[int, int], int]
    activation_bytes: Callable[[MemoryContext], float]
    hf_export: bool
    document_kernels: tuple[str, ...]
    document_note: str = ""
    row_masks: bool = True
    """Rows of several documents may go through one masked call (a dense or flex mask); False: each document
    is a block of its own (``documents.plan_rows(blocks_only=True)``)."""
    varlen: bool = False
    draws_dropout: bool = False
