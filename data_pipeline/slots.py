"""Who reads what: the loader's slots, their work per epoch (pieces of shards) and their saved state.

A *slot* is one (data-parallel rank, loader worker) pair: global slot ``g = dp_rank * slots_per_rank
+ worker``, ``total_slots = dp_size * slots_per_rank``. In each epoch a slot reads a list of
*pieces*; a :class:`Piece` is a range of documents of one shard, in that shard's shuffled order
for the epoch (a permutation seeded by (seed, epoch, shard)), so pieces of one shard never overlap.

Dealing (:func:`deal`), deterministic from (seed, epoch) and the manifest: the shards are put in
an order seeded by (seed, epoch). When there are at least as many shards as slots and dealing
whole shards round-robin (slot g gets ``order[g::total_slots]``) gives no slot more than
``WHOLE_SHARD_TOLERANCE`` times its fair share of tokens, each slot reads whole shards (every
shard file is read by one slot only). Otherwise (fewer shards than slots, or very uneven
shards) the shards, in that order, are cut into ``total_slots`` consecutive document ranges of
about equal tokens (estimated from each shard's tokens per document), so slots share shards by
document ranges. Either way every document of the epoch is in exactly one slot's pieces.

:class:`SlotState` is what a slot has consumed: the epoch, its pieces for that epoch, the piece
being read (``cursor``), the document within it and the tokens of that document already read,
and the number of sequences it has produced in the epoch (``sample``, part of the masking key).

Elastic resume (:func:`elastic_slot_states`), when the number of slots changes: the epoch in
progress is the oldest epoch of any old slot. What each old slot in that epoch has not read (the
rest of its current piece, from the exact token where it stopped, and its later pieces) is cut
again into the new number of slots by the same token-balanced rule; so no document is skipped
or read twice. Old slots already in a later epoch had finished their part of the epoch in
progress; what they read of the later epoch is read again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["Piece", "SlotState", "epoch_shard_order", "deal", "cut_pieces", "elastic_slot_states",
           "WHOLE_SHARD_TOLERANCE"]

WHOLE_SHARD_TOLERANCE = 1.25
"""Whole shards per slot while no slot gets more than this times its fair share of the epoch's tokens."""


class Piece(NamedTuple):
    """Documents ``lo <= i < hi`` (in the epoch's shuffled order) of shard ``shard``; reading starts
    ``skip`` tokens into document ``lo`` (non-zero only for the rest of a partly read piece)."""
    shard: int
    lo: int
    hi: int
    skip: int = 0

    @property
    def num_docs(self) -> int:
        return self.hi - self.lo


@dataclass
class SlotState:
    """What one slot has consumed (see the module docstring); the unit of exact resume."""
    epoch: int
    pieces: list = field(default_factory=list)
    """This epoch's pieces of the slot, in reading order."""
    cursor: int = 0
    """Index into ``pieces`` of the piece being read (``len(pieces)``: the epoch is done)."""
    doc: int = 0
    """Document of that piece being read, counted from the piece's first (``lo``)."""
    offset: int = 0
    """Tokens of that document already consumed (its [SEP] counts as its last token)."""
    sample: int = 0
    """Sequences this slot has produced in this epoch (the masking key of the next one)."""

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "pieces": [list(p) for p in self.pieces], "cursor": self.cursor,
                "doc": self.doc, "offset": self.offset, "sample": self.sample}

    @classmethod
    def from_dict(cls, d: dict) -> "SlotState":
        """Read a saved slot state (:meth:`to_dict`)."""
        pieces = [Piece(*map(int, p)) for p in d["pieces"]]
        return cls(int(d["epoch"]), pieces, int(d["cursor"]), int(d["doc"]), int(d["offset"]), int(d["sample"]))


def epoch_shard_order(seed: int, epoch: int, num_shards: int) -> list[int]:
    return np.random.default_rng([seed, epoch, 0x5A4D]).permutation(num_shards).tolist()


def _tokens_per_doc(shards: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.array([t / d if d else 0.0 for d, t in shards], np.float64)


def cut_pieces(pieces: Sequence[Piece], tokens_per_doc: np.ndarray, parts: int) -> list[list[Piece]]:
    """``pieces`` (in order) cut into ``parts`` consecutive runs of about equal estimated tokens.

    Each run is non-empty when there are at least ``parts`` documents. A cut inside a piece splits
    it at a document boundary (the part before keeps the piece's ``skip``)."""
    sizes = np.array([p.num_docs for p in pieces], np.int64)
    total_docs = int(sizes.sum())
    weights = sizes * np.array([tokens_per_doc[p.shard] for p in pieces], np.float64) if len(pieces) else sizes
    ends_w = np.cumsum(weights)
    ends_d = np.cumsum(sizes)
    total_w = float(ends_w[-1]) if len(pieces) else 0.0
    cuts = [0]
    for g in range(1, parts):
        target = total_w * g / parts
        k = int(np.searchsorted(ends_w, target, side="right"))
        if k >= len(pieces):
            c = total_docs
        else:
            before_w = float(ends_w[k - 1]) if k else 0.0
            before_d = int(ends_d[k - 1]) if k else 0
            rate = weights[k] / sizes[k] if sizes[k] else 1.0
            c = before_d + min(int(sizes[k]), int(round((target - before_w) / rate)))
        if total_docs >= parts:  # every part gets a document
            c = min(max(c, cuts[-1] + 1), total_docs - (parts - g))
        cuts.append(max(c, cuts[-1]))
    cuts.append(total_docs)
    out: list[list[Piece]] = [[] for _ in range(parts)]
    cut_arr = np.asarray(cuts, np.int64)
    start = 0  # index (over all pieces) of the current piece's first document
    for p, n in zip(pieces, sizes.tolist()):
        end = start + n
        g = max(0, int(np.searchsorted(cut_arr, start, side="right")) - 1)   # the part holding `start`
        while g < parts and cuts[g] < end:
            lo, hi = max(start, cuts[g]), min(end, cuts[g + 1])
            if hi > lo:
                out[g].append(Piece(p.shard, p.lo + lo - start, p.lo + hi - start, p.skip if lo == start else 0))
            g += 1
        start = end
    return out


def deal(seed: int, epoch: int, shards: Sequence[tuple[int, int]], total_slots: int) -> list[list[Piece]]:
    """Every slot's pieces for ``epoch``; ``shards``: (num_docs, num_tokens) per manifest shard."""
    order = epoch_shard_order(seed, epoch, len(shards))
    if len(shards) >= total_slots:
        whole = [order[g::total_slots] for g in range(total_slots)]
        total = sum(t for _, t in shards)
        heaviest = max(sum(shards[i][1] for i in w) for w in whole)
        if heaviest <= WHOLE_SHARD_TOLERANCE * total / total_slots:
            return [[Piece(i, 0, shards[i][0]) for i in w] for w in whole]
    return cut_pieces([Piece(i, 0, shards[i][0]) for i in order], _tokens_per_doc(shards), total_slots)


def elastic_slot_states(old_slots: dict, seed: int, shards: Sequence[tuple[int, int]],
                        total_slots: int) -> tuple[dict, str]:
    """New ``SlotState`` s (keys "0" ... ) for ``total_slots`` slots from all old slots' states (the
    elastic rule of the module docstring), and a message saying what happened."""
    epoch = min(s.epoch for s in old_slots.values())
    remaining: list[Piece] = []
    partly = 0
    for g in sorted(old_slots, key=int):
        s = old_slots[g]
        if s.epoch != epoch:
            continue
        rest = list(s.pieces[s.cursor:])
        if rest and (s.doc or s.offset):
            first = rest[0]
            lo = first.lo + s.doc
            rest = rest[1:] if lo >= first.hi else [Piece(first.shard, lo, first.hi, s.offset)] + rest[1:]
            partly += 1
        remaining += rest
    runs = cut_pieces(remaining, _tokens_per_doc(shards), total_slots)
    new = {str(g): SlotState(epoch, runs[g]) for g in range(total_slots)}
    docs_left = sum(p.num_docs for p in remaining)
    msg = (f"elastic resume: {len(old_slots)} old slots -> {total_slots} new slots; epoch {epoch}: {docs_left} of "
           f"{sum(d for d, _ in shards)} documents left, re-dealt by tokens; {partly} partly read piece(s) continue "
           f"at the token where they stopped; no document is skipped or read twice")
    ahead = sorted({s.epoch for s in old_slots.values()} - {epoch})
    if ahead:
        msg += f"; slots already in epoch(s) {ahead} read those epochs' documents again"
    return new, msg
