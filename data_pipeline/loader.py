"""The streaming loader: shards -> slots -> shuffled documents -> packed sequences -> masked batches.

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
``slot_batches``     groups ``micro_batch_size`` sequences (one slot per batch; a batch may
                     span an epoch boundary), masks them (:mod:`.masking`, keyed by (seed,
                     epoch, slot, sample index)) and makes numpy arrays. With
                     ``packing="document"`` the attention mask numbers the documents of each
                     row (1, 2, ...; the row's [CLS] opens the first, each [SEP] closes one;
                     0 = padding), else it is 1 on every token; the tokens and the masking do
                     not depend on it, nor does the loader's state.
``ShardLoader``      one torch DataLoader per rank over its slots; batches come round-robin
                     over workers, as torch's DataLoader yields them.

State and resume ("provenance"): every batch carries, next to the tensors, its slot's
:class:`~.slots.SlotState` *after* that batch. The main process records it when the consumer
takes the batch, so :meth:`ShardLoader.state_dict` is what was consumed, never what workers
prefetched. The next worker in the round-robin is stored too, so a resumed DataLoader
continues with the right worker. Resuming with another slot layout follows the elastic rule
(:func:`~.slots.elastic_slot_states`).

State format 2 (``state_dict()``): ``{format: 2, seed, shard_set: {num_shards, sha256},
dp_size, slots_per_rank, slots: {"<g>": SlotState.to_dict()}, next_local: {"<dp rank>": w},
stats}``. Format 1 (whole shards only: a slot's ``shards`` instead of ``pieces``) is read too
and resumes exactly; the later epochs are then dealt by :func:`~.slots.deal`.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import weakref
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .errors import DataError, UsageError
from .manifest import read_manifest
from .masking import mask_tokens, sample_keys
from .shards import CorruptShardError, load_shard
from .slots import Piece, SlotState, deal, elastic_slot_states, epoch_shard_order
from .source import RetryPolicy, ShardSource, default_retry
from .tario import check_token_ids

__all__ = ["ShardLoader", "deal", "epoch_shard_order", "slot_sequences", "slot_batches", "elastic_slot_states",
           "merge_states", "ShardCache", "SlotState", "Piece", "Position", "BatchInfo", "STATE_FORMAT", "PACKINGS"]

log = logging.getLogger(__name__)
STATE_FORMAT = 2
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
                raise CorruptShardError(f"{e} (set data.skip_bad_shards=true to skip bad shards)") from None
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


@dataclass
class BatchInfo:
    """What a worker sends with each batch ("provenance")."""
    slot: int                 # global slot
    state: SlotState          # the slot's state once this batch is consumed
    docs: int                 # documents that end in this batch
    tokens: int               # non-padding tokens
    sequences: int
    bad_shards: list          # shards skipped as bad since the slot's previous batch
    local: int = 0            # the slot's index on its rank (the DataLoader worker)


def slot_batches(cache: ShardCache, state: SlotState, *, seq_len: int, micro_batch_size: int, slot: int,
                 total_slots: int, max_epochs: Optional[int], seed: int, mlm_probability: float,
                 whole_word_mask: bool, packing: str = "document") -> Iterator[tuple[dict, BatchInfo]]:
    """(batch of numpy arrays, BatchInfo) per micro-batch of one slot. ``packing``: "document" numbers
    each row's documents in ``attention_mask`` (1, 2, ...; 0 = padding), "cross_document" marks tokens 1."""
    m = cache.m
    special_ids = m["special_ids"]
    vocab = m["vocab_size"]
    special = np.zeros(max(vocab, max(special_ids.values()) + 1), bool)
    special[list(special_ids.values())] = True
    batch_size = micro_batch_size
    use_marks = whole_word_mask and cache.use_wwm
    sequences = slot_sequences(cache, state, seq_len, slot=slot, total_slots=total_slots, max_epochs=max_epochs)
    while True:
        ids = np.full((batch_size, seq_len), special_ids["pad"], np.int64)
        attention = np.zeros((batch_size, seq_len), np.int64)
        word_starts = np.ones((batch_size, seq_len), np.uint8) if use_marks else None
        epochs = np.zeros(batch_size, np.int64)
        samples = np.zeros(batch_size, np.int64)
        added_sep = np.zeros(batch_size, bool)
        row = 0
        last = None
        for last in sequences:
            n = len(last.content)
            ids[row, 0] = special_ids["cls"]
            ids[row, 1:1 + n] = last.content
            end = 1 + n
            if last.end_sep:
                added_sep[row] = True
                ids[row, end] = special_ids["sep"]
                end += 1
            attention[row, :end] = 1
            if use_marks:
                word_starts[row, 1:1 + n] = last.marks
            epochs[row], samples[row] = last.epoch, last.sample
            row += 1
            if row == batch_size:
                break
        if row == 0:
            return
        if row < batch_size:  # the very end (max_epochs): a smaller last batch
            ids, attention, epochs, samples = ids[:row], attention[:row], epochs[:row], samples[:row]
            word_starts = word_starts[:row] if word_starts is not None else None
        is_sep = ids == special_ids["sep"]
        docs = int(np.count_nonzero(is_sep)) - int(np.count_nonzero(added_sep[:row]))
        if packing == "document":  # a document's number: 1 + the [SEP]s before it ([CLS] opens the first)
            attention = np.where(attention != 0, np.cumsum(is_sep, axis=1) - is_sep + 1, 0)
        keys = sample_keys(seed, epochs, slot, samples)
        inputs, labels = mask_tokens(ids, attention, keys, vocab_size=vocab, mask_id=special_ids["mask"],
                                     special=special, mlm_probability=mlm_probability, word_starts=word_starts)
        batch = {"input_ids": inputs, "attention_mask": attention, "token_type_ids": np.zeros_like(attention),
                 "labels": labels}
        bad, cache.bad = cache.bad, []
        yield batch, BatchInfo(slot, last.after.resolve(), docs, int(np.count_nonzero(attention)), row, bad)
        if row < batch_size:
            return


# --------------------------------------------------------------------------- state helpers


def merge_states(states) -> dict:
    """One state holding the slots of several ranks' ``state_dict()`` s (for elastic resume)."""
    if isinstance(states, dict):
        return states
    states = list(states)
    if not states:
        raise DataError("loader state: expected at least one rank's state")
    out = {k: v for k, v in states[0].items() if k not in ("slots", "next_local")}
    out["slots"], out["next_local"] = {}, {}
    for s in states:
        for k in ("format", "seed", "shard_set", "dp_size", "slots_per_rank"):
            if s.get(k) != out.get(k):
                raise DataError(f"loader state: field {k!r} differs between ranks ({s.get(k)!r} vs "
                                f"{out.get(k)!r}); these states are not from one run")
        out["slots"].update(s["slots"])
        out["next_local"].update(s["next_local"])
    return out


# --------------------------------------------------------------------------- the loader


class _RankDataset(IterableDataset):
    """Picklable iterable over one rank's slots; DataLoader worker w serves local slot (w + rotate) % S."""

    def __init__(self, loader: "ShardLoader", slot_states: dict, rotate: int):
        self.source, self.manifest = loader.source, loader.manifest
        self.kw = dict(seq_len=loader.seq_len, micro_batch_size=loader.micro_batch_size,
                       total_slots=loader.total_slots, max_epochs=loader.max_epochs, seed=loader.seed,
                       mlm_probability=loader.mlm_probability, whole_word_mask=loader.whole_word_mask,
                       packing=loader.packing)
        self.skip_bad, self.verify = loader.skip_bad_shards, loader.verify_hash
        self.dp_rank, self.slots_per_rank = loader.dp_rank, loader.slots_per_rank
        self.slot_states, self.rotate = slot_states, rotate

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        local = (worker + self.rotate) % self.slots_per_rank
        slot = self.dp_rank * self.slots_per_rank + local
        cache = ShardCache(self.source, self.manifest, self.kw["seed"], self.skip_bad, self.kw["whole_word_mask"],
                           self.verify)
        for batch, info in slot_batches(cache, self.slot_states[str(slot)], slot=slot, **self.kw):
            info.local = local
            yield {k: torch.from_numpy(v) for k, v in batch.items()}, info


def _identity(x):
    return x


def _worker_ignores_stop_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's signature
    """DataLoader workers ignore stop signals: the training process decides when to stop.

    SIGTERM / SIGINT sent to the whole process group (``timeout``, Ctrl-C, SLURM, Kubernetes) would
    otherwise kill the workers and crash the main process before it can save."""
    import signal

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)


_LIVE: "weakref.WeakSet[ShardLoader]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    """Stop the workers of loaders still iterating when the interpreter exits. Registered after
    multiprocessing's own exit handler, so it runs before it (see ShardLoader._stop_active)."""
    for loader in list(_LIVE):
        loader._stop_active()


class ShardLoader:
    """Deterministic, resumable MLM batches from a shard set for one data-parallel rank.

    ``shard_dir``: a directory or a URL prefix (:mod:`.source`; ``retry`` bounds the re-reads of a
    URL, default :func:`~.source.default_retry`). See the module docstring for the stages and the
    state. ``num_workers=0`` loads in the calling process and gives exactly the batches of
    ``num_workers=1``. Any number of shards works on any number of slots, as long as the set has a
    document per slot (:mod:`.slots`).
    """

    def __init__(self, shard_dir, *, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 1, seed: int = 0, mlm_probability: float = 0.15, whole_word_mask: bool = True,
                 skip_bad_shards: bool = False, pin_memory: bool = False, max_epochs: Optional[int] = None,
                 verify_hash: bool = True, prefetch_factor: int = 2, multiprocessing_context: Optional[str] = "auto",
                 retry: Optional[RetryPolicy] = None, packing: str = "document"):
        self.source = ShardSource(shard_dir, retry or default_retry())
        self.shard_dir = self.source.location
        self.manifest = read_manifest(self.source)
        if seq_len < 3:
            raise UsageError(f"seq_len: expected at least 3 ([CLS] token [SEP]), got {seq_len}")
        if micro_batch_size < 1:
            raise UsageError(f"micro_batch_size: expected a positive integer, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise UsageError(f"dp_rank: expected 0 <= dp_rank < dp_size ({dp_size}), got {dp_rank}")
        if num_workers < 0:
            raise UsageError(f"num_workers: expected >= 0, got {num_workers}")
        if not 0.0 < mlm_probability < 1.0:
            raise UsageError(f"mlm_probability: expected a value in (0, 1), got {mlm_probability}")
        if packing not in PACKINGS:
            raise UsageError(f"packing: expected one of {', '.join(PACKINGS)}, got {packing!r}")
        self.packing = packing
        if max_epochs is not None and max_epochs < 1:
            raise UsageError(f"max_epochs: expected None or >= 1, got {max_epochs}")
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.seed, self.mlm_probability, self.whole_word_mask = seed, mlm_probability, whole_word_mask
        self.skip_bad_shards, self.pin_memory, self.max_epochs = skip_bad_shards, pin_memory, max_epochs
        self.verify_hash, self.prefetch_factor = verify_hash, prefetch_factor
        if multiprocessing_context == "auto":
            # fork: workers start in milliseconds. A process started by spawn (torch.multiprocessing,
            # our test helper) would otherwise give its DataLoader spawn workers that re-import
            # torch (~10 s each). Workers touch no CUDA, so forking a CUDA process is safe.
            import multiprocessing as mp
            multiprocessing_context = "fork" if "fork" in mp.get_all_start_methods() else None
        self.multiprocessing_context = multiprocessing_context
        self.slots_per_rank = max(1, num_workers)
        self.total_slots = dp_size * self.slots_per_rank
        self.shard_sizes = shard_sizes(self.manifest)
        num_shards, num_docs = len(self.shard_sizes), self.manifest["num_docs"]
        if num_docs < self.total_slots:
            raise UsageError(f"{self.shard_dir}: {num_docs} documents for {self.total_slots} loader slots (dp_size "
                             f"{dp_size} x max(1, num_workers {num_workers})): every slot needs a document; use fewer "
                             "workers or ranks")
        h = hashlib.sha256("".join(s["sha256"] for s in self.manifest["shards"]).encode()).hexdigest()
        self._shard_set = {"num_shards": num_shards, "sha256": h}
        first = deal(seed, 0, self.shard_sizes, self.total_slots)
        self._slots = {str(g): SlotState(0, first[g]) for g in self._my_slots()}
        self._next_local = 0
        self._generation = 0
        self._active = None
        _LIVE.add(self)
        self.stats = {"batches": 0, "sequences": 0, "tokens": 0, "docs": 0, "bad_shards_skipped": 0,
                      "bad_shards": []}

    def _my_slots(self) -> range:
        return range(self.dp_rank * self.slots_per_rank, (self.dp_rank + 1) * self.slots_per_rank)

    # ------------------------------------------------------------------ iteration

    def _stop_active(self) -> None:
        self._generation += 1
        it, self._active = self._active, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
            # torch ends a worker that does not leave in time with SIGTERM, which our workers ignore
            # (_worker_ignores_stop_signals): end it for good, or it would outlive the loader and make
            # multiprocessing's exit handler (SIGTERM + join without a time-out) wait forever.
            for w in getattr(it, "_workers", ()):
                if w.is_alive():
                    w.kill()
                    w.join(timeout=5)

    def __iter__(self):
        self._stop_active()
        generation = self._generation
        dataset = _RankDataset(self, dict(self._slots), self._next_local)
        dl = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                        worker_init_fn=_worker_ignores_stop_signals if self.num_workers else None,
                        pin_memory=self.pin_memory and torch.cuda.is_available(),
                        prefetch_factor=self.prefetch_factor if self.num_workers else None,
                        multiprocessing_context=self.multiprocessing_context if self.num_workers else None)
        it = iter(dl)
        self._active = it
        return self._consume(it, generation)

    def _consume(self, it, generation: int):
        for batch, info in it:
            if generation != self._generation:  # set_stage / load_state_dict / a newer iter() took over
                return
            self._slots[str(info.slot)] = info.state
            self._next_local = (info.local + 1) % self.slots_per_rank
            st = self.stats
            st["batches"] += 1
            st["sequences"] += info.sequences
            st["tokens"] += info.tokens
            st["docs"] += info.docs
            if info.bad_shards:
                st["bad_shards_skipped"] += len(info.bad_shards)
                st["bad_shards"] += info.bad_shards
                log.warning("loader rank %d skipped bad shard(s) %s (%d so far)", self.dp_rank,
                            ", ".join(info.bad_shards), st["bad_shards_skipped"])
            yield batch
        if generation == self._generation:
            self._active = None

    def set_stage(self, seq_len: int, micro_batch_size: int) -> None:
        """New sequence length / micro-batch; the next ``iter()`` re-packs from the consumed position."""
        if seq_len < 3 or micro_batch_size < 1:
            raise UsageError(f"set_stage: expected seq_len >= 3 and micro_batch_size >= 1, got "
                             f"{seq_len}, {micro_batch_size}")
        self._stop_active()
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """What the consumer has taken (state format 2, see the module docstring)."""
        return {"format": STATE_FORMAT, "seed": self.seed, "shard_set": dict(self._shard_set),
                "dp_size": self.dp_size, "slots_per_rank": self.slots_per_rank,
                "slots": {g: s.to_dict() for g, s in self._slots.items()},
                "next_local": {str(self.dp_rank): self._next_local},
                "stats": {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}}

    def load_state_dict(self, state) -> None:
        """Resume from ``state_dict()`` output (format 2): exactly with
        the same slot layout; with another (world size, worker count) by the elastic rule, which needs
        every old rank's state (pass the list of them, or :func:`merge_states` of them) and logs a
        warning."""
        state = merge_states(state)
        where = "loader state"
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"{where}: field 'format': expected {STATE_FORMAT}, got {state.get('format')!r} "
                            "(saved by another version?)")
        if state.get("shard_set") != self._shard_set:
            raise DataError(f"{where}: field 'shard_set': saved for another shard set "
                            f"({state.get('shard_set')}), this loader reads {self.shard_dir} ({self._shard_set})")
        if state.get("seed") != self.seed:
            raise DataError(f"{where}: field 'seed': saved with seed {state.get('seed')}, the loader has "
                            f"seed {self.seed}")
        self._stop_active()
        saved = {g: SlotState.from_dict(s) for g, s in state["slots"].items()}
        old_total = state["dp_size"] * state["slots_per_rank"]
        mine = [str(g) for g in self._my_slots()]
        if old_total == self.total_slots:
            missing = [g for g in mine if g not in saved]
            if missing:
                raise DataError(f"{where}: field 'slots': no state for slot(s) {missing} of dp rank "
                                f"{self.dp_rank}; pass this rank's saved state (or all ranks' states)")
            self._slots = {g: saved[g] for g in mine}
            same = state["dp_size"] == self.dp_size
            self._next_local = state["next_local"].get(str(self.dp_rank), 0) if same else 0
            if not same:
                log.warning("loader: resuming %d x %d slots as %d ranks x %d workers: same %d slots, each "
                            "continues exactly", state["dp_size"], state["slots_per_rank"], self.dp_size,
                            self.slots_per_rank, self.total_slots)
        else:
            if len(saved) != old_total:
                raise DataError(f"{where}: field 'slots': the elastic resume from {state['dp_size']} ranks x "
                                f"{state['slots_per_rank']} slots needs all {old_total} old slots, got "
                                f"{len(saved)}: pass every old rank's state_dict() (a list)")
            new, msg = elastic_slot_states(saved, self.seed, self.shard_sizes, self.total_slots)
            self._slots = {g: new[g] for g in mine}
            self._next_local = 0
            log.warning("loader rank %d: %s", self.dp_rank, msg)
        stats = state.get("stats")
        if isinstance(stats, dict):
            self.stats.update({k: v for k, v in stats.items() if k in self.stats})

    def __repr__(self) -> str:
        return (f"ShardLoader({str(self.shard_dir)!r}, seq_len={self.seq_len}, micro_batch_size="
                f"{self.micro_batch_size}, dp {self.dp_rank}/{self.dp_size}, workers={self.num_workers})")
