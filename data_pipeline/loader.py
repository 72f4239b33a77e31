"""The streaming loader: shards -> slots -> shuffled documents -> packed sequences -> masked batches.

``ShardLoader`` runs one torch DataLoader per rank over its slots (a slot per worker); each worker runs the
stages of :mod:`.batches` for its slot (``slots.deal`` -> ``ShardCache.load`` -> ``slot_sequences`` ->
``slot_batches``: shards dealt, read and verified, documents shuffled, packed into sequences, masked);
batches come round-robin over workers, as torch's DataLoader yields them.

State and resume ("provenance"): every batch carries, next to the tensors, its slot's position
in every source (a :class:`~.slots.SlotState` each) and its mixer credits *after* that batch, and
the source of each row. The main process records it when the consumer takes the batch, so
:meth:`ShardLoader.state_dict` is what was consumed, never what workers prefetched
(:attr:`ShardLoader.last` is the provenance of the batch taken last). The next worker in the
round-robin is stored too, so a resumed DataLoader continues with the right worker. Resuming
with another slot layout follows the elastic rule (:func:`~.slots.elastic_slot_states`), source
by source; the credits then start at zero.

State format 3 (``state_dict()``): ``{format: 3, seed, dp_size, slots_per_rank, sources: {name:
{shard_set: {num_shards, sha256}, slots: {"<g>": SlotState.to_dict()}}}, credits: {"<g>": {name:
credit}}, next_local: {"<dp rank>": w}, stats}``; ``stats`` counts batches, sequences, tokens,
documents and bad shards, and per source (``stats["sources"][name]``) tokens, documents and
sequences. Format 2 (one shard set: ``shard_set`` and ``slots`` at the top) is read as the source
reading that shard set.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import logging
import math
import os
import signal
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .batches import (PACKINGS, BatchInfo, PackedSequence, PieceStream, Position, ShardCache, SlotSource,
                      shard_sizes, slot_batches, slot_sequences)
from .errors import DataError, UsageError
from .manifest import check_same_tokenizer, read_manifest
from .masking import MASK_REPLACE
from .mixture import Source, as_sources, shares, source_seed
from .slots import Piece, SlotState, deal, elastic_slot_states, epoch_shard_order
from .source import RetryPolicy, ShardSource, default_retry

__all__ = ["ShardLoader", "LoaderSettings", "deal", "epoch_shard_order", "slot_sequences", "slot_batches", "elastic_slot_states",
           "merge_states", "upgrade_state", "ShardCache", "SlotState", "SlotSource", "SourceSet", "Piece", "Position",
           "BatchInfo", "STATE_FORMAT", "PACKINGS", "Source", "shard_sizes", "PieceStream", "PackedSequence"]

log = logging.getLogger(__name__)
STATE_FORMAT = 3
_SOURCE_STATS = {"tokens": 0, "docs": 0, "sequences": 0}


# --------------------------------------------------------------------------- state helpers


def merge_states(states) -> dict:
    """One state holding the slots of several ranks' ``state_dict()`` s (for elastic resume)."""
    if isinstance(states, dict):
        return states
    states = list(states)
    if not states:
        raise DataError("loader state: expected at least one rank's state")
    out = {k: v for k, v in states[0].items() if k not in ("sources", "credits", "next_local")}
    out["sources"] = {n: {"shard_set": v.get("shard_set"), "slots": {}} for n, v in states[0]["sources"].items()}
    out["credits"], out["next_local"] = {}, {}
    for s in states:
        for k in ("format", "seed", "dp_size", "slots_per_rank"):
            if s.get(k) != out.get(k):
                raise DataError(f"loader state: field {k!r} differs between ranks ({s.get(k)!r} vs "
                                f"{out.get(k)!r}); these states are not from one run")
        if {n: v.get("shard_set") for n, v in s["sources"].items()} != \
                {n: v["shard_set"] for n, v in out["sources"].items()}:
            raise DataError("loader state: field 'sources' differs between ranks; these states are not from one run")
        for n, v in s["sources"].items():
            out["sources"][n]["slots"].update(v["slots"])
        out["credits"].update(s.get("credits") or {})
        out["next_local"].update(s["next_local"])
    return out


def upgrade_state(state: dict, sets: list) -> dict:
    """A saved state in the current format: format 2 (one shard set) becomes the one source of ``sets``
    with that shard set (a run that gained sources keeps its old set's position)."""
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt == STATE_FORMAT:
        return state
    if fmt != 2:
        raise DataError(f"loader state: field 'format': expected {STATE_FORMAT} (or 2), got {fmt!r} "
                        "(saved by another version?)")
    match = [st.name for st in sets if st.shard_set == state.get("shard_set")]
    if not match:
        where = ", ".join(f"{st.source.location} ({st.shard_set})" for st in sets)
        raise DataError(f"loader state: field 'shard_set': saved for another shard set ({state.get('shard_set')}), "
                        f"this loader reads {where}")
    out = {k: v for k, v in state.items() if k not in ("shard_set", "slots")}
    out["format"] = STATE_FORMAT
    out["sources"] = {match[0]: {"shard_set": state["shard_set"], "slots": state["slots"]}}
    out["credits"] = {}
    stats = dict(state.get("stats") or {})
    stats["sources"] = {match[0]: {k: stats.get(k, 0) for k in _SOURCE_STATS}}
    out["stats"] = stats
    return out


# --------------------------------------------------------------------------- the loader


def _check_rate(mlm_probability: float) -> None:
    if not 0.0 < mlm_probability < 1.0:
        raise UsageError(f"mlm_probability: expected a value in (0, 1), got {mlm_probability}")


class _RankDataset(IterableDataset):
    """Picklable iterable over one rank's slots; DataLoader worker w serves local slot (w + rotate) % S."""

    def __init__(self, loader: "ShardLoader", slot_states: dict, credits: dict, rotate: int):
        self.sets = loader.sets
        self.kw = dict(seq_len=loader.seq_len, micro_batch_size=loader.micro_batch_size,
                       total_slots=loader.total_slots, mlm_probability=loader.mlm_probability,
                       whole_word_mask=loader.whole_word_mask, packing=loader.packing,
                       mask_replace=loader.mask_replace)
        self.share = [loader.shares[s.name] for s in loader.sets]
        self.skip_bad, self.verify, self.max_epochs = loader.skip_bad_shards, loader.verify_hash, loader.max_epochs
        self.dp_rank, self.slots_per_rank = loader.dp_rank, loader.slots_per_rank
        self.slot_states, self.credits, self.rotate = slot_states, credits, rotate
        self.prepare = loader.prepare

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        local = (worker + self.rotate) % self.slots_per_rank
        slot = str(self.dp_rank * self.slots_per_rank + local)
        sources = [SlotSource(s.name, ShardCache(s.source, s.manifest, s.seed, self.skip_bad,
                                                 self.kw["whole_word_mask"], self.verify),
                              self.slot_states[s.name][slot], s.epoch_limit(self.max_epochs)) for s in self.sets]
        for batch, info in slot_batches(sources, self.credits[slot], self.share, slot=int(slot), **self.kw):
            info.local = local
            tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
            if self.prepare is not None:
                tensors.update(self.prepare(tensors))
            yield tensors, info


def _identity(x):
    return x


def _worker_ignores_stop_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's signature
    """DataLoader workers ignore stop signals: the training process decides when to stop.

    SIGTERM / SIGINT sent to the whole process group (``timeout``, Ctrl-C, SLURM, Kubernetes) would
    otherwise kill the workers and crash the main process before it can save. A worker whose training
    process died (killed) while it handed a batch over says nothing of the broken connection: it is
    about to end too, and the launcher reports the death (:func:`_quiet_when_orphaned`)."""
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the fork: pending ones are dropped
    sys.excepthook = _quiet_when_orphaned(os.getppid(), sys.excepthook)


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR2}


@contextlib.contextmanager
def _stop_signals_blocked():
    """Stop signals held (not lost) in this thread while DataLoader workers are forked from it: a worker
    inherits the mask, so a signal to the process group between the fork and the worker's own
    :func:`_worker_ignores_stop_signals` cannot kill it (torch's worker loop puts SIGTERM's default action
    back first)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _quiet_when_orphaned(parent: int, hook):
    """``sys.excepthook`` of a worker: a connection error is not reported when ``parent`` is gone within a
    second (multiprocessing's resource sharer thread reports through ``sys.excepthook``); anything else is."""

    def excepthook(kind, value, tb):
        if issubclass(kind, (ConnectionError, EOFError)):
            # a killed process closes its sockets before its children are handed to a new parent: wait for that
            for _ in range(50):
                if os.getppid() != parent:
                    return
                time.sleep(0.02)
        hook(kind, value, tb)

    return excepthook


_LIVE: "weakref.WeakSet[ShardLoader]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    """Stop the workers of loaders still iterating when the interpreter exits. Registered after
    multiprocessing's own exit handler, so it runs before it (see ShardLoader._stop_active)."""
    for loader in list(_LIVE):
        loader._stop_active()


@dataclass
class SourceSet:
    """One source of a loader: its shard set (manifest read once), seed and repetition cap."""
    name: str
    source: ShardSource
    manifest: dict
    seed: int
    max_epochs: Optional[float] = None

    @property
    def sizes(self) -> list[tuple[int, int]]:
        return shard_sizes(self.manifest)

    @property
    def shard_set(self) -> dict:
        h = hashlib.sha256("".join(e["sha256"] for e in self.manifest["shards"]).encode()).hexdigest()
        return {"num_shards": len(self.manifest["shards"]), "sha256": h}

    def epoch_limit(self, loader_max: Optional[int]) -> Optional[int]:
        """Epochs this source may start: the loader's ``max_epochs`` and its own cap (rounded up)."""
        own = None if self.max_epochs is None else max(1, math.ceil(self.max_epochs - 1e-9))
        return own if loader_max is None else loader_max if own is None else min(own, loader_max)


@dataclass(frozen=True)
class LoaderSettings:
    """What a :class:`ShardLoader` reads with, apart from its sources, its rank and the stage's source weights;
    :meth:`build` makes the loader (the trainer's: ``launch/build.py``, from the resolved run)."""
    seq_len: int
    micro_batch_size: int
    num_workers: int = 1
    seed: int = 0
    mlm_probability: float = 0.15
    whole_word_mask: bool = True
    skip_bad_shards: bool = False
    pin_memory: bool = False
    packing: str = "document"
    mask_replace: tuple[float, float, float] = MASK_REPLACE

    def build(self, sources, dp_rank: int = 0, dp_size: int = 1, *, weights: Optional[dict] = None,
              prepare: Optional[Callable[[dict], dict]] = None) -> "ShardLoader":
        return ShardLoader(sources, dp_rank=dp_rank, dp_size=dp_size, weights=weights, prepare=prepare, **asdict(self))


class ShardLoader:
    """Deterministic, resumable MLM batches from a shard set, or a mixture of them, for one data-parallel rank.

    ``shards``: a directory or a URL prefix (:mod:`.source`; ``retry`` bounds the re-reads of a
    URL, default :func:`~.source.default_retry`), or several named sets: :class:`~.mixture.Source` s
    or (name, location[, max_epochs]) tuples, mixed by ``weights`` (name -> share of tokens, any
    scale; default: in proportion to each set's tokens), see :mod:`.mixture`. Every set must have the
    tokenizer of the first. See the module docstring for the stages and the state.
    ``num_workers=0`` loads in the calling process and gives exactly the batches of
    ``num_workers=1``. Any number of shards works on any number of slots, as long as every set has a
    document per slot (:mod:`.slots`).
    ``prepare``: a picklable function of a batch's tensors whose entries are added to the batch, run in the
    workers (the trainer's: what the model would otherwise compute from the batch on its device, e.g. the
    layout of the packed documents); the tokens, masks and the loader's state do not depend on it.
    """

    def __init__(self, shards, *, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 1, seed: int = 0, mlm_probability: float = 0.15, whole_word_mask: bool = True,
                 skip_bad_shards: bool = False, pin_memory: bool = False, max_epochs: Optional[int] = None,
                 verify_hash: bool = True, prefetch_factor: int = 2, multiprocessing_context: Optional[str] = "auto",
                 retry: Optional[RetryPolicy] = None, packing: str = "document",
                 weights: Optional[dict] = None, prepare: Optional[Callable[[dict], dict]] = None,
                 mask_replace: tuple[float, float, float] = MASK_REPLACE):
        if seq_len < 3:
            raise UsageError(f"seq_len: expected at least 3 ([CLS] token [SEP]), got {seq_len}")
        if micro_batch_size < 1:
            raise UsageError(f"micro_batch_size: expected a positive integer, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise UsageError(f"dp_rank: expected 0 <= dp_rank < dp_size ({dp_size}), got {dp_rank}")
        if num_workers < 0:
            raise UsageError(f"num_workers: expected >= 0, got {num_workers}")
        _check_rate(mlm_probability)
        if len(mask_replace) != 3 or min(mask_replace) < 0 or not math.isclose(sum(mask_replace), 1.0, abs_tol=1e-6):
            raise UsageError(f"mask_replace: expected three shares >= 0 ([MASK], random, unchanged) summing to 1, "
                             f"got {list(mask_replace)}")
        if packing not in PACKINGS:
            raise UsageError(f"packing: expected one of {', '.join(PACKINGS)}, got {packing!r}")
        if max_epochs is not None and max_epochs < 1:
            raise UsageError(f"max_epochs: expected None or >= 1, got {max_epochs}")
        self.packing, self.prepare = packing, prepare
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.seed, self.mlm_probability, self.whole_word_mask = seed, mlm_probability, whole_word_mask
        self.mask_replace = tuple(mask_replace)
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
        listed = as_sources(shards)
        retry = retry or default_retry()
        self.sets: list[SourceSet] = []
        for src in listed:
            where = ShardSource(src.location, retry)
            manifest = src.manifest if src.manifest is not None else read_manifest(where)
            self.sets.append(SourceSet(src.name, where, manifest, source_seed(seed, src.name, len(listed)),
                                       src.max_epochs))
        first = self.sets[0]
        self.source, self.shard_dir, self.manifest = first.source, first.source.location, first.manifest
        for st in self.sets[1:]:
            check_same_tokenizer(st.manifest, first.manifest, f"source {st.name!r} ({st.source.location})",
                                 f"source {first.name!r}")
        for st in self.sets:
            if st.manifest["num_docs"] < self.total_slots:
                raise UsageError(f"{st.source.location}: {st.manifest['num_docs']} documents for {self.total_slots} "
                                 f"loader slots (dp_size {dp_size} x max(1, num_workers {num_workers})): every slot "
                                 "needs a document; use fewer workers or ranks")
        self.shares = shares(weights, [st.name for st in self.sets],
                             default={st.name: st.manifest["num_tokens"] for st in self.sets})
        self._slots = {st.name: self._fresh(st) for st in self.sets}
        self._credits = {g: [0.0] * len(self.sets) for g in self._my_slots()}
        self._next_local = 0
        self._generation = 0
        self._active = None
        self.last: Optional[BatchInfo] = None
        """The provenance of the batch taken last (slot, rows' sources, tokens per source, ...)."""
        _LIVE.add(self)
        self.stats = {"batches": 0, "sequences": 0, "tokens": 0, "docs": 0, "bad_shards_skipped": 0,
                      "bad_shards": [], "sources": {st.name: dict(_SOURCE_STATS) for st in self.sets}}

    def _my_slots(self) -> list[str]:
        return [str(g) for g in range(self.dp_rank * self.slots_per_rank, (self.dp_rank + 1) * self.slots_per_rank)]

    def _fresh(self, st: SourceSet) -> dict:
        first = deal(st.seed, 0, st.sizes, self.total_slots)
        return {g: SlotState(0, first[int(g)]) for g in self._my_slots()}

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
            # each index queue's feeder thread exits after the close above, on its own: the next iter() forks
            # new workers, and a fork while a thread is being torn down can leave the child stuck for good in
            # Python's after-fork clean-up (seen at a stage switch: a worker never started, its rank waited)
            for q in getattr(it, "_index_queues", ()):
                feeder = getattr(q, "_thread", None)
                if feeder is not None:
                    feeder.join(timeout=5)

    def __iter__(self):
        self._stop_active()
        generation = self._generation
        dataset = _RankDataset(self, {n: dict(v) for n, v in self._slots.items()},
                               {g: list(c) for g, c in self._credits.items()}, self._next_local)
        dl = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                        worker_init_fn=_worker_ignores_stop_signals if self.num_workers else None,
                        pin_memory=self.pin_memory and torch.cuda.is_available(),
                        prefetch_factor=self.prefetch_factor if self.num_workers else None,
                        multiprocessing_context=self.multiprocessing_context if self.num_workers else None)
        with _stop_signals_blocked():  # the workers start with them blocked, until they ignore them
            it = iter(dl)
        self._active = it
        return self._consume(it, generation)

    def _consume(self, it, generation: int):
        for batch, info in it:
            if generation != self._generation:  # set_stage / load_state_dict / a newer iter() took over
                return
            g = str(info.slot)
            for name, state in info.states.items():
                self._slots[name][g] = state
            self._credits[g] = info.credits
            self._next_local = (info.local + 1) % self.slots_per_rank
            self.last = info
            st = self.stats
            st["batches"] += 1
            st["sequences"] += info.sequences
            st["tokens"] += info.tokens
            st["docs"] += info.docs
            per_source = st["sources"]
            for name, tokens in info.source_tokens.items():
                per = per_source[name]
                per["tokens"] += tokens
                per["docs"] += info.source_docs[name]
            if len(per_source) == 1:
                per["sequences"] += info.sequences
            else:
                for name in info.sources:
                    per_source[name]["sequences"] += 1
            if info.bad_shards:
                st["bad_shards_skipped"] += len(info.bad_shards)
                st["bad_shards"] += info.bad_shards
                log.warning("loader rank %d skipped bad shard(s) %s (%d so far)", self.dp_rank,
                            ", ".join(info.bad_shards), st["bad_shards_skipped"])
            yield batch
        if generation == self._generation:
            self._active = None

    def close(self) -> None:
        """End the workers of the iteration in flight (a later ``iter()`` starts new ones)."""
        self._stop_active()

    def set_stage(self, seq_len: int, micro_batch_size: int, weights: Optional[dict] = None,
                  mlm_probability: Optional[float] = None) -> None:
        """New sequence length / micro-batch (and, given ``weights``, new shares of the sources; given
        ``mlm_probability``, a new masking rate); the next ``iter()`` re-packs from the consumed position."""
        if seq_len < 3 or micro_batch_size < 1:
            raise UsageError(f"set_stage: expected seq_len >= 3 and micro_batch_size >= 1, got "
                             f"{seq_len}, {micro_batch_size}")
        if mlm_probability is not None:
            _check_rate(mlm_probability)
        new = shares(weights, [st.name for st in self.sets]) if weights is not None else self.shares
        self._stop_active()
        self.seq_len, self.micro_batch_size, self.shares = seq_len, micro_batch_size, new
        self.mlm_probability = self.mlm_probability if mlm_probability is None else mlm_probability

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """What the consumer has taken (state format 3, see the module docstring)."""
        names = [st.name for st in self.sets]
        return {"format": STATE_FORMAT, "seed": self.seed, "dp_size": self.dp_size,
                "slots_per_rank": self.slots_per_rank,
                "sources": {st.name: {"shard_set": st.shard_set,
                                      "slots": {g: s.to_dict() for g, s in self._slots[st.name].items()}}
                            for st in self.sets},
                "credits": {g: dict(zip(names, c)) for g, c in self._credits.items()},
                "next_local": {str(self.dp_rank): self._next_local},
                "stats": copy.deepcopy(self.stats)}

    def load_state_dict(self, state) -> None:
        """Resume from ``state_dict()`` output (format 3, or format 2 of a one-source loader): exactly with
        the same slot layout; with another (world size, worker count) by the elastic rule, which needs
        every old rank's state (pass the list of them, or :func:`merge_states` of them) and logs a
        warning. A source new to the mixture starts at its beginning (logged); a saved source the
        mixture lacks is refused (a share of 0 pauses a source)."""
        states = [state] if isinstance(state, dict) else list(state)
        state = merge_states([upgrade_state(st, self.sets) for st in states])
        where = "loader state"
        if state.get("seed") != self.seed:
            raise DataError(f"{where}: field 'seed': saved with seed {state.get('seed')}, the loader has "
                            f"seed {self.seed}")
        mine = {st.name: st for st in self.sets}
        saved_sources = state["sources"]
        gone = sorted(set(saved_sources) - set(mine))
        if gone:
            raise DataError(f"{where}: field 'sources': the saved position reads source {gone[0]!r}, which this "
                            f"loader lacks (it reads {', '.join(mine)}); keep the source (a weight of 0 pauses it)")
        for name, saved in saved_sources.items():
            if saved.get("shard_set") != mine[name].shard_set:
                raise DataError(f"{where}: field 'shard_set': source {name!r} was saved for another shard set "
                                f"({saved.get('shard_set')}), this loader reads {mine[name].source.location} "
                                f"({mine[name].shard_set})")
        self._stop_active()
        old_total = state["dp_size"] * state["slots_per_rank"]
        exact = old_total == self.total_slots
        for name, st in mine.items():
            if name not in saved_sources:
                log.warning("loader: source %r is new to this run: it starts at its beginning", name)
                self._slots[name] = self._fresh(st)
                continue
            saved = {g: SlotState.from_dict(s) for g, s in saved_sources[name]["slots"].items()}
            if exact:
                missing = [g for g in self._my_slots() if g not in saved]
                if missing:
                    raise DataError(f"{where}: field 'slots': no state for slot(s) {missing} of dp rank "
                                    f"{self.dp_rank}; pass this rank's saved state (or all ranks' states)")
                self._slots[name] = {g: saved[g] for g in self._my_slots()}
                continue
            if len(saved) != old_total:
                raise DataError(f"{where}: field 'slots': the elastic resume from {state['dp_size']} ranks x "
                                f"{state['slots_per_rank']} slots needs all {old_total} old slots, got "
                                f"{len(saved)}: pass every old rank's state_dict() (a list)")
            new, msg = elastic_slot_states(saved, st.seed, st.sizes, self.total_slots)
            self._slots[name] = {g: new[g] for g in self._my_slots()}
            log.warning("loader rank %d%s: %s", self.dp_rank, f", source {name!r}" if len(mine) > 1 else "", msg)
        credits = state.get("credits") or {}
        self._credits = {g: [float(credits.get(g, {}).get(st.name, 0.0)) if exact else 0.0 for st in self.sets]
                         for g in self._my_slots()}
        same = state["dp_size"] == self.dp_size
        self._next_local = state["next_local"].get(str(self.dp_rank), 0) if exact and same else 0
        if exact and not same:
            log.warning("loader: resuming %d x %d slots as %d ranks x %d workers: same %d slots, each "
                        "continues exactly", state["dp_size"], state["slots_per_rank"], self.dp_size,
                        self.slots_per_rank, self.total_slots)
        stats = state.get("stats")
        if isinstance(stats, dict):
            self.stats.update({k: v for k, v in stats.items() if k in self.stats and k != "sources"})
            for name, per in (stats.get("sources") or {}).items():
                if name in self.stats["sources"] and isinstance(per, dict):
                    self.stats["sources"][name].update({k: v for k, v in per.items() if k in _SOURCE_STATS})

    def __repr__(self) -> str:
        where = (repr(str(self.shard_dir)) if len(self.sets) == 1 else
                 "[" + ", ".join(f"{st.name}: {self.shares[st.name]:.3f}" for st in self.sets) + "]")
        return (f"ShardLoader({where}, seq_len={self.seq_len}, micro_batch_size="
                f"{self.micro_batch_size}, dp {self.dp_rank}/{self.dp_size}, workers={self.num_workers})")
