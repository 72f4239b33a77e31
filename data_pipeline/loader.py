"""The streaming loader: shards -> slots -> shuffled documents -> packed sequences -> masked batches.

A chain of small stages (each a plain function or generator, testable on its own):

``deal_shards``      shard order per epoch = permutation seeded by (seed, epoch); slot g of T
                     gets ``perm[g::T]``. Slots: each data-parallel rank has
                     ``max(1, num_workers)``; global slot = dp_rank * slots_per_rank + worker.
``ShardCache.load``  read + verify one shard, documents shuffled by (seed, epoch, shard) and
                     laid out as one stream ``d1 [SEP] d2 [SEP] ...`` (vectorised gather).
``slot_sequences``   pack a slot's stream into ``[CLS] ... [SEP]`` sequences of ``seq_len``,
                     crossing shard boundaries; documents longer than a sequence are split.
                     A sequence ends with the separator of a document when one falls on its
                     last position, else with an added [SEP]; it is padded only at the end of
                     the slot's epoch (and, rarely, by one position when a document ends one
                     token before the final [SEP]).
``slot_batches``     groups ``micro_batch_size`` sequences (one slot per batch; a batch may
                     span an epoch boundary), masks them (:mod:`masking`, keyed by (seed,
                     epoch, slot, sample index)) and makes torch tensors.
``ShardLoader``      one torch DataLoader per rank over its slots; batches come round-robin
                     over workers, as torch's DataLoader yields them.

State and resume ("provenance"): every batch carries, next to the tensors, the state of
its slot *after* that batch (epoch, the slot's shard list for that epoch, shard cursor,
document index, token offset, sample index). The main process records it when the
consumer takes the batch, so :meth:`ShardLoader.state_dict` is what was consumed, never
what workers prefetched. The next worker in the round-robin is stored too, so a resumed
DataLoader continues with the right worker. Resuming with another slot layout follows
the elastic rule (:func:`elastic_slot_states`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .masking import mask_tokens, sample_keys
from .shards import CorruptShardError, read_manifest, read_shard

__all__ = ["ShardLoader", "deal_shards", "epoch_shard_order", "slot_sequences", "slot_batches",
           "elastic_slot_states", "merge_states", "ShardCache"]

log = logging.getLogger(__name__)
STATE_FORMAT = 1


def epoch_shard_order(seed: int, epoch: int, num_shards: int) -> list[int]:
    return np.random.default_rng([seed, epoch, 0x5A4D]).permutation(num_shards).tolist()


def deal_shards(seed: int, epoch: int, num_shards: int, slot: int, total_slots: int) -> list[int]:
    """The shards (manifest indices) that global slot ``slot`` reads in ``epoch``."""
    return epoch_shard_order(seed, epoch, num_shards)[slot::total_slots]


def fresh_slot_state(seed: int, epoch: int, num_shards: int, slot: int, total_slots: int) -> dict:
    return {"epoch": epoch, "shards": deal_shards(seed, epoch, num_shards, slot, total_slots),
            "cursor": 0, "doc": 0, "offset": 0, "sample": 0}


class ShardCache:
    """Loads shards for one slot; documents shuffled by (seed, epoch, shard) into one stream."""

    def __init__(self, shard_dir: Path, manifest: dict, seed: int, skip_bad_shards: bool, use_wwm: bool,
                 verify_hash: bool = True):
        self.dir, self.m, self.seed = shard_dir, manifest, seed
        self.skip_bad, self.use_wwm, self.verify = skip_bad_shards, use_wwm and manifest["wwm"], verify_hash
        self.sep = manifest["special_ids"]["sep"]
        self.bad: list[str] = []  # names skipped since the last drain (reported with the next batch)

    def load(self, index: int, epoch: int):
        """(tokens, marks or None, doc_starts) with doc_starts[i] = stream index of document i and
        doc_starts[-1] = len(stream); None when the shard is bad and skipping is on."""
        entry = self.m["shards"][index]
        try:
            sd = read_shard(self.dir / entry["name"], self.m["dtype"], entry, self.verify)
        except CorruptShardError as e:
            if not self.skip_bad:
                raise CorruptShardError(f"{e} (set data.skip_bad_shards=true to skip bad shards)") from None
            log.warning("skipping bad shard: %s", e)
            self.bad.append(entry["name"])
            return None
        n = sd.num_docs
        order = np.random.default_rng([self.seed, epoch, index, 0xD0C5]).permutation(n)
        lens = sd.lengths[order] + 1                      # +1: the [SEP] after each document
        doc_starts = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=doc_starts[1:])
        total = int(doc_starts[-1])
        # Source index of every stream position (vectorised gather of the shuffled documents).
        src_start = sd.tok_start[order]
        idx = np.arange(total, dtype=np.int64) + np.repeat(src_start - doc_starts[:-1], lens)
        sep_pos = doc_starts[1:] - 1
        idx[sep_pos] = 0
        tokens = sd.tokens[idx]
        tokens[sep_pos] = self.sep
        marks = None
        if self.use_wwm and sd.marks is not None:
            midx = idx + np.repeat(sd.wwm_start[order] - src_start, lens)
            midx[sep_pos] = 0
            marks = sd.marks[midx]
            marks[sep_pos] = 1
        return tokens, marks, doc_starts


def slot_sequences(cache: ShardCache, state: dict, seq_len: int, *, slot: int, total_slots: int,
                   max_epochs: Optional[int]) -> Iterator[tuple]:
    """Packed sequences of one slot from ``state`` on.

    Yields ``(content, marks, end_sep, epoch, sample, after)``: the sequence is
    ``[CLS] + content (+ [SEP] if end_sep)``, padded to ``seq_len``; :func:`resolve_state` turns
    ``after`` into the slot state once this sequence is consumed.
    """
    num_shards = len(cache.m["shards"])
    sep = cache.sep
    L = seq_len
    st = dict(state)
    epoch, shards, cursor, sample = st["epoch"], list(st["shards"]), st["cursor"], st["sample"]
    while max_epochs is None or epoch < max_epochs:
        buf = np.zeros(0, np.int64)
        mbuf = None
        p = base = 0
        newest = cursor - 1
        newest_len = 0
        ds = None
        first = True
        while True:
            # Fill the window: at least L-1 tokens ahead, or everything left in this epoch.
            while len(buf) - p < L - 1 and newest + 1 < len(shards):
                newest += 1
                loaded = cache.load(shards[newest], epoch)
                if loaded is None:
                    continue
                tok, mk, ds = loaded
                start = 0
                if first and newest == cursor:
                    start = int(ds[st["doc"]]) + st["offset"] if st["doc"] < len(ds) - 1 else int(ds[-1])
                first = False
                left = len(buf) - p
                buf = np.concatenate([buf[p:], tok]) if left else tok
                if cache.use_wwm:
                    mk = mk if mk is not None else np.ones(len(tok), np.uint8)
                    mbuf = np.concatenate([mbuf[p:], mk]) if left else mk
                base = left
                p = 0 if left else start                # only the first shard starts mid-way
                newest_len = len(tok)
            rem = len(buf) - p
            if rem <= 0:
                break
            if rem <= L - 1 and newest + 1 >= len(shards):
                n_take, end_sep = rem, False           # the epoch's tail: ends with a separator; padded
            elif buf[p + L - 2] == sep:
                n_take, end_sep = L - 1, False         # a document's separator falls on the last position
            else:
                n_take = L - 2
                end_sep = buf[p + L - 3] != sep        # else [CLS] ... d [SEP] + one pad
            content = buf[p:p + n_take]
            marks = mbuf[p:p + n_take] if mbuf is not None else None
            p += n_take
            # the position after this sequence, resolved to (cursor, doc, offset) only when needed
            after = (epoch, shards, newest, p - base, ds, newest_len, sample + 1)
            yield content, marks, end_sep, epoch, sample, after
            sample += 1
        epoch += 1
        shards = deal_shards(cache.seed, epoch, num_shards, slot, total_slots)
        cursor, sample = 0, 0
        st = {"doc": 0, "offset": 0}


def resolve_state(after: tuple) -> dict:
    epoch, shards, newest, q, ds, newest_len, sample = after
    if q >= newest_len:
        return {"epoch": epoch, "shards": shards, "cursor": newest + 1, "doc": 0, "offset": 0, "sample": sample}
    d = int(np.searchsorted(ds, q, side="right")) - 1
    return {"epoch": epoch, "shards": shards, "cursor": newest, "doc": d, "offset": int(q - ds[d]),
            "sample": sample}


def slot_batches(cache: ShardCache, state: dict, *, seq_len: int, micro_batch_size: int, slot: int,
                 total_slots: int, max_epochs: Optional[int], seed: int, mlm_probability: float,
                 whole_word_mask: bool) -> Iterator[tuple[dict, dict]]:
    """(batch of numpy arrays, provenance) per micro-batch of one slot."""
    m = cache.m
    sp = m["special_ids"]
    vocab = m["vocab_size"]
    special = np.zeros(max(vocab, max(sp.values()) + 1), bool)
    special[list(sp.values())] = True
    L, B = seq_len, micro_batch_size
    use_marks = whole_word_mask and cache.use_wwm
    seqs = slot_sequences(cache, state, L, slot=slot, total_slots=total_slots, max_epochs=max_epochs)
    while True:
        ids = np.full((B, L), sp["pad"], np.int64)
        att = np.zeros((B, L), np.int64)
        wwm = np.ones((B, L), np.uint8) if use_marks else None
        epochs = np.zeros(B, np.int64)
        samples = np.zeros(B, np.int64)
        end_seps = np.zeros(B, bool)
        b = 0
        after = None
        for content, marks, end_sep, epoch, sample, after in seqs:
            n = len(content)
            ids[b, 0] = sp["cls"]
            ids[b, 1:1 + n] = content
            end = 1 + n
            if end_sep:
                end_seps[b] = True
                ids[b, end] = sp["sep"]
                end += 1
            att[b, :end] = 1
            if use_marks:
                wwm[b, 1:1 + n] = marks
            epochs[b], samples[b] = epoch, sample
            b += 1
            if b == B:
                break
        if b == 0:
            return
        if b < B:  # the very end (max_epochs): a smaller last batch
            ids, att, epochs, samples = ids[:b], att[:b], epochs[:b], samples[:b]
            wwm = wwm[:b] if wwm is not None else None
        docs = int(np.count_nonzero(ids == sp["sep"])) - int(np.count_nonzero(end_seps[:b]))
        keys = sample_keys(seed, epochs, slot, samples)
        inputs, labels = mask_tokens(ids, att, keys, vocab_size=vocab, mask_id=sp["mask"], special=special,
                                     mlm_probability=mlm_probability, word_starts=wwm)
        batch = {"input_ids": inputs, "attention_mask": att, "token_type_ids": np.zeros_like(att),
                 "labels": labels}
        bad, cache.bad = cache.bad, []
        prov = {"slot": slot, "state": resolve_state(after), "docs": docs, "tokens": int(att.sum()), "sequences": b,
                "bad_shards": bad}
        yield batch, prov
        if b < B:
            return


# --------------------------------------------------------------------------- state helpers


def merge_states(states) -> dict:
    """One state holding the slots of several ranks' ``state_dict()`` s (for elastic resume)."""
    if isinstance(states, dict):
        return states
    states = list(states)
    if not states:
        raise ValueError("loader state: expected at least one rank's state")
    out = {k: v for k, v in states[0].items() if k not in ("slots", "next_local")}
    out["slots"], out["next_local"] = {}, {}
    for s in states:
        for k in ("format", "seed", "shard_set", "dp_size", "slots_per_rank"):
            if s.get(k) != out.get(k):
                raise ValueError(f"loader state: field {k!r} differs between ranks ({s.get(k)!r} vs "
                                 f"{out.get(k)!r}); these states are not from one run")
        out["slots"].update(s["slots"])
        out["next_local"].update(s["next_local"])
    return out


def elastic_slot_states(old_slots: dict, seed: int, num_shards: int, total_slots: int) -> tuple[dict, str]:
    """New slot states for ``total_slots`` slots from all old slots' states (the elastic rule).

    The epoch in progress is the oldest old-slot epoch ``e``. Shards that old slots in ``e``
    finished are done; every other shard of ``e`` (including each old slot's partly read shard,
    which is read again from its start) is dealt to the new slots in epoch order. Later epochs
    are dealt normally. Old slots already past ``e`` finished their part of ``e``; what they
    read of later epochs is read again.
    """
    e = min(s["epoch"] for s in old_slots.values())
    order = {s: i for i, s in enumerate(epoch_shard_order(seed, e, num_shards))}
    remaining, partial = [], []
    for g in sorted(old_slots, key=int):
        s = old_slots[g]
        if s["epoch"] != e:
            continue
        rest = list(s["shards"][s["cursor"]:])
        remaining += rest
        if rest and (s["doc"] or s["offset"]):
            partial.append(rest[0])
    remaining.sort(key=order.__getitem__)
    new = {}
    for g in range(total_slots):
        new[str(g)] = {"epoch": e, "shards": remaining[g::total_slots], "cursor": 0, "doc": 0, "offset": 0,
                       "sample": 0}
    ahead = sorted({s["epoch"] for s in old_slots.values()} - {e})
    msg = (f"elastic resume: {len(old_slots)} old slots -> {total_slots} new slots; epoch {e}: "
           f"{len(remaining)} of {num_shards} shards left, {len(partial)} partly read shard(s) read again from "
           f"their start; no document is skipped")
    if ahead:
        msg += f"; slots already in epoch(s) {ahead} restart those epochs' shards"
    return new, msg


# --------------------------------------------------------------------------- the loader


class _RankDataset(IterableDataset):
    """Picklable iterable over one rank's slots; DataLoader worker w serves local slot (w + rotate) % S."""

    def __init__(self, loader: "ShardLoader", slot_states: dict, rotate: int):
        self.dir, self.m = loader.shard_dir, loader.manifest
        self.kw = dict(seq_len=loader.seq_len, micro_batch_size=loader.micro_batch_size,
                       total_slots=loader.total_slots, max_epochs=loader.max_epochs, seed=loader.seed,
                       mlm_probability=loader.mlm_probability, whole_word_mask=loader.whole_word_mask)
        self.skip_bad, self.verify = loader.skip_bad_shards, loader.verify_hash
        self.rank, self.S = loader.dp_rank, loader.slots_per_rank
        self.slot_states, self.rotate = slot_states, rotate

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        local = (w + self.rotate) % self.S
        g = self.rank * self.S + local
        cache = ShardCache(self.dir, self.m, self.kw["seed"], self.skip_bad, self.kw["whole_word_mask"],
                           self.verify)
        for batch, prov in slot_batches(cache, self.slot_states[str(g)], slot=g, **self.kw):
            prov["local"] = local
            yield {k: torch.from_numpy(v) for k, v in batch.items()}, prov


def _identity(x):
    return x


def _worker_ignores_stop_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's signature
    """DataLoader workers ignore stop signals: the training process decides when to stop.

    SIGTERM / SIGINT sent to the whole process group (``timeout``, Ctrl-C, SLURM, Kubernetes) would
    otherwise kill the workers and crash the main process before it can save."""
    import signal

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)


class ShardLoader:
    """Deterministic, resumable MLM batches from a shard set for one data-parallel rank.

    See the module docstring for the stages and the state. ``num_workers=0`` loads in the
    calling process and gives exactly the batches of ``num_workers=1``.
    """

    def __init__(self, shard_dir, *, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 1, seed: int = 0, mlm_probability: float = 0.15, whole_word_mask: bool = True,
                 skip_bad_shards: bool = False, pin_memory: bool = False, max_epochs: Optional[int] = None,
                 verify_hash: bool = True, prefetch_factor: int = 2, multiprocessing_context: Optional[str] = "auto"):
        self.shard_dir = Path(shard_dir)
        self.manifest = read_manifest(self.shard_dir)
        if seq_len < 3:
            raise ValueError(f"seq_len: expected at least 3 ([CLS] token [SEP]), got {seq_len}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: expected a positive integer, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank: expected 0 <= dp_rank < dp_size ({dp_size}), got {dp_rank}")
        if num_workers < 0:
            raise ValueError(f"num_workers: expected >= 0, got {num_workers}")
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability: expected a value in (0, 1), got {mlm_probability}")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs: expected None or >= 1, got {max_epochs}")
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
        num_shards = len(self.manifest["shards"])
        if num_shards < self.total_slots:
            raise ValueError(f"{self.shard_dir}: {num_shards} shards for {self.total_slots} loader slots "
                             f"(dp_size {dp_size} x max(1, num_workers {num_workers})): every slot needs a "
                             f"shard; rebuild with a smaller --shard-size-mb or use fewer workers")
        h = hashlib.sha256("".join(s["sha256"] for s in self.manifest["shards"]).encode()).hexdigest()
        self._shard_set = {"num_shards": num_shards, "sha256": h}
        self._slots = {str(g): fresh_slot_state(seed, 0, num_shards, g, self.total_slots) for g in self._my_slots()}
        self._next_local = 0
        self._generation = 0
        self._active = None
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

    def __iter__(self):
        self._stop_active()
        gen = self._generation
        ds = _RankDataset(self, dict(self._slots), self._next_local)
        dl = DataLoader(ds, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                        worker_init_fn=_worker_ignores_stop_signals if self.num_workers else None,
                        pin_memory=self.pin_memory and torch.cuda.is_available(),
                        prefetch_factor=self.prefetch_factor if self.num_workers else None,
                        multiprocessing_context=self.multiprocessing_context if self.num_workers else None)
        it = iter(dl)
        self._active = it
        return self._consume(it, gen)

    def _consume(self, it, gen: int):
        S = self.slots_per_rank
        for batch, prov in it:
            if gen != self._generation:  # set_stage / load_state_dict / a newer iter() took over
                return
            self._slots[str(prov["slot"])] = prov["state"]
            self._next_local = (prov["local"] + 1) % S
            st = self.stats
            st["batches"] += 1
            st["sequences"] += prov["sequences"]
            st["tokens"] += prov["tokens"]
            st["docs"] += prov["docs"]
            if prov["bad_shards"]:
                st["bad_shards_skipped"] += len(prov["bad_shards"])
                st["bad_shards"] += prov["bad_shards"]
                log.warning("loader rank %d skipped bad shard(s) %s (%d so far)", self.dp_rank,
                            ", ".join(prov["bad_shards"]), st["bad_shards_skipped"])
            yield batch
        if gen == self._generation:
            self._active = None

    def set_stage(self, seq_len: int, micro_batch_size: int) -> None:
        """New sequence length / micro-batch; the next ``iter()`` re-packs from the consumed position."""
        if seq_len < 3 or micro_batch_size < 1:
            raise ValueError(f"set_stage: expected seq_len >= 3 and micro_batch_size >= 1, got "
                             f"{seq_len}, {micro_batch_size}")
        self._stop_active()
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """What the consumer has taken: per slot (epoch, shard list, cursor, doc, offset, sample)."""
        return {"format": STATE_FORMAT, "seed": self.seed, "shard_set": dict(self._shard_set),
                "dp_size": self.dp_size, "slots_per_rank": self.slots_per_rank,
                "slots": {g: {**s, "shards": list(s["shards"])} for g, s in self._slots.items()},
                "next_local": {str(self.dp_rank): self._next_local},
                "stats": {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}}

    def load_state_dict(self, state) -> None:
        """Resume from ``state_dict()`` output: exactly with the same slot layout; with another
        (world size, worker count) by the elastic rule, which needs every old rank's state
        (pass the list of them, or :func:`merge_states` of them) and logs a warning."""
        state = merge_states(state)
        where = "loader state"
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{where}: field 'format': expected {STATE_FORMAT}, got {state.get('format')!r}")
        if state.get("shard_set") != self._shard_set:
            raise ValueError(f"{where}: field 'shard_set': saved for another shard set "
                             f"({state.get('shard_set')}), this loader reads {self.shard_dir} ({self._shard_set})")
        if state.get("seed") != self.seed:
            raise ValueError(f"{where}: field 'seed': saved with seed {state.get('seed')}, the loader has "
                             f"seed {self.seed}")
        self._stop_active()
        old_total = state["dp_size"] * state["slots_per_rank"]
        mine = [str(g) for g in self._my_slots()]
        if old_total == self.total_slots:
            missing = [g for g in mine if g not in state["slots"]]
            if missing:
                raise ValueError(f"{where}: field 'slots': no state for slot(s) {missing} of dp rank "
                                 f"{self.dp_rank}; pass this rank's saved state (or all ranks' states)")
            self._slots = {g: dict(state["slots"][g]) for g in mine}
            same = state["dp_size"] == self.dp_size
            self._next_local = state["next_local"].get(str(self.dp_rank), 0) if same else 0
            if not same:
                log.warning("loader: resuming %d x %d slots as %d ranks x %d workers: same %d slots, each "
                            "continues exactly", state["dp_size"], state["slots_per_rank"], self.dp_size,
                            self.slots_per_rank, self.total_slots)
        else:
            if len(state["slots"]) != old_total:
                raise ValueError(f"{where}: field 'slots': the elastic resume from {state['dp_size']} ranks x "
                                 f"{state['slots_per_rank']} slots needs all {old_total} old slots, got "
                                 f"{len(state['slots'])}: pass every old rank's state_dict() (a list)")
            new, msg = elastic_slot_states(state["slots"], self.seed, self._shard_set["num_shards"],
                                           self.total_slots)
            self._slots = {g: new[g] for g in mine}
            self._next_local = 0
            log.warning("loader rank %d: %s", self.dp_rank, msg)
        saved = state.get("stats")
        if isinstance(saved, dict):
            self.stats.update({k: v for k, v in saved.items() if k in self.stats})

    def __repr__(self) -> str:
        return (f"ShardLoader({str(self.shard_dir)!r}, seq_len={self.seq_len}, micro_batch_size="
                f"{self.micro_batch_size}, dp {self.dp_rank}/{self.dp_size}, workers={self.num_workers})")
