"""One slot's batches: shards -> shuffled documents -> packed sequences -> masked batches; the stages a
:class:`~data_pipeline.loader.ShardLoader` runs in each of its DataLoader workers (one slot each).

A chain of small stages (each a plain function or generator, testable on its own):

``slots.deal``       each slot's pieces (document ranges of shards) per epoch, from (seed, epoch)
                     (:mod:`.slots`: whole shards when they balance, else token-balanced ranges).
``ShardCache.load``  read + verify one shard (a directory or a URL, :mod:`.source`), its documents
                     shuffled by (seed, epoch, shard), a piece's range of them laid out as one
                     stream ``d1 [SEP] d2 [SEP] ...`` (vectorised gather); a token id of the
                     stream at or above the manifest's ``vocab_size`` makes the shard bad (one
                     ``max`` over the stream), so no id reaches the masker or the embedding
                     that the model does not have.
``slot_sequences``   pack a slot's stream into ``[CLS] ... [SEP]`` sequences of ``seq_len``,
                     crossing piece boundaries; documents longer than a sequence are split.
                     A sequence ends with the separator of a document when one falls on its
                     last position, else with an added [SEP]; it is padded only at the end of
                     the slot's epoch (and, rarely, by one position when a document ends one
                     token before the final [SEP]).
``slot_batches``     fills ``micro_batch_size`` rows (one slot per batch; a batch may span an
                     epoch boundary), each row a packed sequence of one source of the slot:
                     one for a plain shard set, else chosen by the slot's :class:`~.mixture.Mixer`
                     (token shares, :mod:`.mixture`); masks them (:mod:`.masking`, keyed by
                     (source seed, epoch, slot, sample index)) and makes numpy arrays. With
                     ``packing="document"`` the attention mask numbers the documents of each
                     row (1, 2, ...; the row's [CLS] opens the first, each [SEP] closes one;
                     0 = padding), else it is 1 on every token; the tokens and the masking do
                     not depend on it, nor does the loader's state.

Each batch comes with its :class:`BatchInfo` ("provenance": the slot's position in every source and its
mixer credits once the batch is consumed, the source of each row), from which the loader's state is made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

import numpy as np

from .masking import MASK_REPLACE, mask_tokens, sample_keys
from .mixture import Mixer
from .shards import CorruptShardError, load_shard
from .slots import Piece, SlotState, deal
from .source import ShardSource
from .tario import check_token_ids

__all__ = ["PACKINGS", "shard_sizes", "PieceStream", "ShardCache", "Position", "PackedSequence", "slot_sequences",
           "BatchInfo", "SlotSource", "slot_batches"]

log = logging.getLogger(__name__)
PACKINGS = ("document", "cross_document")
"""``packing``: the rows are the same either way; ``document`` numbers each row's documents in the
attention mask (so that the model keeps them apart, roformer_dist/nn/documents.py)."""


def shard_sizes(manifest: dict) -> list[tuple[int, int]]:
    return [(e["num_docs"], e["num_tokens"]) for e in manifest["shards"]]


class PieceStream(NamedTuple):
    tokens: np.ndarray                 # int [n]: the piece's documents, each followed by [SEP]
    marks: Optional[np.ndarray]        # uint8 [n]: word starts ([SEP] = 1), or None
    doc_starts: np.ndarray             # int64 [num_docs + 1]: stream index of each document, then n


class ShardCache:
    """Loads the pieces of one slot (see the module docstring)."""

    def __init__(self, source, manifest: dict, seed: int, skip_bad_shards: bool, use_wwm: bool,
                 verify_hash: bool = True):
        self.source = source if isinstance(source, ShardSource) else ShardSource(source)
        self.m, self.seed = manifest, seed
        self.skip_bad, self.use_wwm, self.verify = skip_bad_shards, use_wwm and manifest["wwm"], verify_hash
        self.sep, self.vocab = manifest["special_ids"]["sep"], manifest["vocab_size"]
        self.shard_sizes = shard_sizes(manifest)
        self.bad: list[str] = []  # names skipped since the last drain (reported with the next batch)

    def load(self, piece: Piece, epoch: int) -> Optional[PieceStream]:
        """The piece's stream; None when its shard is bad (unreadable, damaged, or a token id of the piece at
        or above ``vocab_size``) and skipping is on."""
        entry = self.m["shards"][piece.shard]
        try:
            return self._stream(piece, epoch)
        except CorruptShardError as e:
            if not self.skip_bad:
                raise
            log.warning("skipping bad shard: %s", e)
            self.bad.append(entry["name"])
            return None

    def _stream(self, piece: Piece, epoch: int) -> PieceStream:
        shard = load_shard(self.source, self.m, piece.shard, self.verify, check_ids=False)
        order = np.random.default_rng([self.seed, epoch, piece.shard, 0xD0C5]).permutation(shard.num_docs)
        order = order[piece.lo:piece.hi]
        lens = shard.lengths[order] + 1                   # +1: the [SEP] after each document
        doc_starts = np.zeros(len(order) + 1, np.int64)
        np.cumsum(lens, out=doc_starts[1:])
        total = int(doc_starts[-1])
        # Source index of every stream position (vectorised gather of the shuffled documents).
        src_start = shard.tok_start[order]
        idx = np.arange(total, dtype=np.int64) + np.repeat(src_start - doc_starts[:-1], lens)
        sep_pos = doc_starts[1:] - 1
        idx[sep_pos] = 0
        tokens = shard.tokens[idx]
        tokens[sep_pos] = self.sep
        # one pass: an id past the embedding is bad data
        check_token_ids(int(tokens.max()) if total else -1, self.vocab,
                        self.source.child(self.m["shards"][piece.shard]["name"]))
        marks = None
        if self.use_wwm and shard.marks is not None:
            midx = idx + np.repeat(shard.wwm_start[order] - src_start, lens)
            midx[sep_pos] = 0
            marks = shard.marks[midx]
            marks[sep_pos] = 1
        return PieceStream(tokens, marks, doc_starts)


@dataclass(frozen=True)
class Position:
    """Where a slot stands after a packed sequence; :meth:`resolve` turns it into a SlotState."""
    epoch: int
    pieces: list
    piece: int               # index of the newest loaded piece (the position lies in it)
    next_piece: int          # the piece to load after it (bad pieces in between are skipped)
    stream_pos: int          # index into that piece's stream
    doc_starts: np.ndarray   # that stream's document starts (last entry: its length)
    sample: int              # the slot's next sample index in this epoch

    def resolve(self) -> SlotState:
        if self.stream_pos >= self.doc_starts[-1]:
            return SlotState(self.epoch, self.pieces, self.next_piece, 0, 0, self.sample)
        doc = int(np.searchsorted(self.doc_starts, self.stream_pos, side="right")) - 1
        return SlotState(self.epoch, self.pieces, self.piece, doc, int(self.stream_pos - self.doc_starts[doc]),
                         self.sample)


class PackedSequence(NamedTuple):
    content: np.ndarray           # the tokens between [CLS] and the final [SEP] (or padding)
    marks: Optional[np.ndarray]   # their word-start marks
    end_sep: bool                 # an added [SEP] closes the sequence
    epoch: int
    sample: int                   # this sequence's sample index in the slot's epoch
    after: Position               # the slot's position once this sequence is consumed


def slot_sequences(cache: ShardCache, state: SlotState, seq_len: int, *, slot: int, total_slots: int,
                   max_epochs: Optional[int]) -> Iterator[PackedSequence]:
    """Packed sequences of one slot from ``state`` on (see the module docstring)."""
    sep = cache.sep
    epoch, pieces, sample = state.epoch, list(state.pieces), state.sample
    resume: Optional[SlotState] = state       # the first piece loaded continues where the state stopped
    while max_epochs is None or epoch < max_epochs:
        window = np.zeros(0, np.int64)        # tokens not yet packed (the tail of older pieces + the newest)
        window_marks = None
        pos = 0                               # next token to pack, index into window
        base = 0                              # window index of the newest piece's stream index 0
        next_piece = resume.cursor if resume is not None else 0
        loaded, loaded_starts = -1, None
        while True:
            while len(window) - pos < seq_len - 1 and next_piece < len(pieces):
                index = next_piece
                next_piece += 1
                stream = cache.load(pieces[index], epoch)
                start = pieces[index].skip
                if resume is not None and index == resume.cursor and stream is not None:
                    num_docs = len(stream.doc_starts) - 1   # (doc, offset) count from the piece's start
                    start = (max(start, int(stream.doc_starts[resume.doc]) + resume.offset) if resume.doc < num_docs
                             else int(stream.doc_starts[-1]))
                resume = None
                if stream is None:
                    continue
                left = len(window) - pos
                tokens, marks = stream.tokens[start:], None
                if cache.use_wwm:
                    marks = (stream.marks if stream.marks is not None else np.ones(len(stream.tokens), np.uint8))
                    marks = marks[start:]
                if left:
                    window = np.concatenate([window[pos:], tokens])
                    window_marks = np.concatenate([window_marks[pos:], marks]) if marks is not None else None
                else:
                    window, window_marks = tokens, marks
                base, pos = left - start, 0
                loaded, loaded_starts = index, stream.doc_starts
            remaining = len(window) - pos
            if remaining <= 0:
                break
            if remaining <= seq_len - 1 and next_piece >= len(pieces):
                n_take, end_sep = remaining, False                 # the epoch's tail: ends with a [SEP]; padded
            elif window[pos + seq_len - 2] == sep:
                n_take, end_sep = seq_len - 1, False               # a document's [SEP] on the last position
            else:
                n_take = seq_len - 2
                end_sep = window[pos + seq_len - 3] != sep         # else [CLS] ... d [SEP] + one pad
            content = window[pos:pos + n_take]
            content_marks = window_marks[pos:pos + n_take] if window_marks is not None else None
            pos += n_take
            after = Position(epoch, pieces, loaded, next_piece, pos - base, loaded_starts, sample + 1)
            yield PackedSequence(content, content_marks, end_sep, epoch, sample, after)
            sample += 1
        epoch += 1
        pieces = deal(cache.seed, epoch, cache.shard_sizes, total_slots)[slot]
        sample = 0
        resume = None  # a state at the very end of its epoch (cursor == len(pieces)) loaded no piece of it


@dataclass
class BatchInfo:
    """What a worker sends with each batch ("provenance")."""
    slot: int                 # global slot
    states: dict              # source name -> the slot's SlotState in it once this batch is consumed
    credits: list             # the slot's mixer credits then (the mixture's order)
    docs: int                 # documents that end in this batch
    tokens: int               # non-padding tokens
    sequences: int
    bad_shards: list          # shards skipped as bad since the slot's previous batch
    sources: tuple = ()       # the source (name) of each row
    source_tokens: dict = field(default_factory=dict)   # name -> non-padding tokens of its rows
    source_docs: dict = field(default_factory=dict)     # name -> documents of its rows that end here
    local: int = 0            # the slot's index on its rank (the DataLoader worker)


@dataclass
class SlotSource:
    """One source as a slot reads it: its shards (cache), position and seed."""
    name: str
    cache: ShardCache
    state: SlotState
    max_epochs: Optional[int]


def slot_batches(sources: list, credits, share, *, seq_len: int, micro_batch_size: int, slot: int,
                 total_slots: int, mlm_probability: float, whole_word_mask: bool,
                 packing: str = "document",
                 mask_replace: tuple[float, float, float] = MASK_REPLACE) -> Iterator[tuple[dict, BatchInfo]]:
    """(batch of numpy arrays, BatchInfo) per micro-batch of one slot, its rows drawn from ``sources``
    (:class:`SlotSource`, one for a plain shard set) by a :class:`~.mixture.Mixer` with ``credits`` and
    ``share`` (one per source). ``packing``: "document" numbers each row's documents in
    ``attention_mask`` (1, 2, ...; 0 = padding), "cross_document" marks tokens 1."""
    m = sources[0].cache.m
    special_ids = m["special_ids"]
    vocab = m["vocab_size"]
    special = np.zeros(max(vocab, max(special_ids.values()) + 1), bool)
    special[list(special_ids.values())] = True
    batch_size = micro_batch_size
    use_marks = whole_word_mask and any(s.cache.use_wwm for s in sources)
    streams = [slot_sequences(s.cache, s.state, seq_len, slot=slot, total_slots=total_slots,
                              max_epochs=s.max_epochs) for s in sources]
    states = {s.name: s.state for s in sources}
    mixer = Mixer(credits, share)
    seeds = [s.cache.seed for s in sources]
    single = len(sources) == 1
    source_names = [s.name for s in sources]
    while True:
        ids = np.full((batch_size, seq_len), special_ids["pad"], np.int64)
        attention = np.zeros((batch_size, seq_len), np.int64)
        word_starts = np.ones((batch_size, seq_len), np.uint8) if use_marks else None
        epochs = np.zeros(batch_size, np.int64)
        samples = np.zeros(batch_size, np.int64)
        origin = np.zeros(batch_size, np.int64)
        added_sep = np.zeros(batch_size, bool)
        after: dict = {}
        row = 0
        while row < batch_size:
            k = mixer.pick()
            if k < 0:
                break
            seq = next(streams[k], None)
            if seq is None:             # this source reached its max_epochs: the others share its part
                mixer.deactivate(k)
                continue
            n = len(seq.content)
            ids[row, 0] = special_ids["cls"]
            ids[row, 1:1 + n] = seq.content
            end = 1 + n
            if seq.end_sep:
                added_sep[row] = True
                ids[row, end] = special_ids["sep"]
                end += 1
            attention[row, :end] = 1
            if use_marks and seq.marks is not None:
                word_starts[row, 1:1 + n] = seq.marks
            epochs[row], samples[row], origin[row] = seq.epoch, seq.sample, k
            after[k] = seq.after
            mixer.charge(k, end)
            row += 1
        if row == 0:
            return
        if row < batch_size:  # the very end (max_epochs): a smaller last batch
            ids, attention, epochs, samples = ids[:row], attention[:row], epochs[:row], samples[:row]
            origin, added_sep = origin[:row], added_sep[:row]
            word_starts = word_starts[:row] if word_starts is not None else None
        is_sep = ids == special_ids["sep"]
        row_docs = np.count_nonzero(is_sep, axis=1) - added_sep
        row_tokens = np.count_nonzero(attention, axis=1)
        if packing == "document":  # a document's number: 1 + the [SEP]s before it ([CLS] opens the first)
            attention = np.where(attention != 0, np.cumsum(is_sep, axis=1) - is_sep + 1, 0)
        keys = sample_keys(seeds[0], epochs, slot, samples) if single else \
            sample_keys(seeds, epochs, slot, samples, groups=origin)
        inputs, labels = mask_tokens(ids, attention, keys, vocab_size=vocab, mask_id=special_ids["mask"],
                                     special=special, mlm_probability=mlm_probability, word_starts=word_starts,
                                     mask_replace=mask_replace)
        batch = {"input_ids": inputs, "attention_mask": attention, "token_type_ids": np.zeros_like(attention),
                 "labels": labels}
        for k, pos in after.items():
            states[sources[k].name] = pos.resolve()
        bad = []
        for s in sources:
            if s.cache.bad:
                bad, s.cache.bad = bad + s.cache.bad, []
        docs, tokens = int(row_docs.sum()), int(row_tokens.sum())
        if single:
            names, tokens_by, docs_by = (source_names[0],) * row, {source_names[0]: tokens}, {source_names[0]: docs}
        else:
            names = tuple(source_names[k] for k in origin.tolist())
            tokens_by = dict(zip(source_names, np.bincount(origin, row_tokens, len(sources)).astype(int).tolist()))
            docs_by = dict(zip(source_names, np.bincount(origin, row_docs, len(sources)).astype(int).tolist()))
        yield batch, BatchInfo(slot, dict(states), list(mixer.credits), docs, tokens, row, bad, names, tokens_by,
                               docs_by)
        if row < batch_size:
            return

