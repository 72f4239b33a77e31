import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.errors import DataError
from data_pipeline.loader import ShardLoader
from data_pipeline.shards import write_shard_set
from roformer_dist.testing import run_distributed

KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def _original(batch):
    """Unmasked token ids per sequence (labels hold the originals where masked)."""
    ids = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])
    return [row[m.bool()].numpy() for row, m in zip(ids, batch["attention_mask"])]


def _distinct_docs(seed: int, count: int, lengths: tuple[int, int]) -> list[np.ndarray]:
    """``count`` documents of seeded random lengths in [lengths), ids counting up from 5: no id repeats."""
    rng = np.random.default_rng(seed)
    docs, nxt = [], 5
    for _ in range(count):
        n = int(rng.integers(*lengths))
        docs.append(np.arange(nxt, nxt + n))
        nxt += n
    return docs


@pytest.fixture(scope="module")
def unique_set(tmp_path_factory):
    """8 shards of documents whose token ids are all distinct: a token names its document."""
    docs = _distinct_docs(seed=0, count=64, lengths=(5, 150))
    d = tmp_path_factory.mktemp("unique")
    write_shard_set(docs, d, vocab_size=60000, max_docs_per_shard=8)
    return d, np.concatenate(docs)


def test_batch_format(small_shards):
    ld = ShardLoader(small_shards.dir, seq_len=128, micro_batch_size=4, num_workers=0, seed=3)
    b = _take(ld, 1)[0]
    assert set(b) == set(KEYS)
    for k in KEYS:
        assert b[k].dtype == torch.int64 and b[k].shape == (4, 128)
    assert (b["input_ids"][:, 0] == 2).all() and (b["token_type_ids"] == 0).all()
    assert ld.manifest["vocab_size"] == small_shards.vocab_size


def test_packing_covers_each_document_once_and_no_pads_mid_epoch(unique_set):
    d, all_tokens = unique_set
    ld = ShardLoader(d, seq_len=32, micro_batch_size=3, num_workers=2, seed=5, max_epochs=1)
    seen, pads = [], 0
    batches = list(ld)
    for b in batches:
        for row in _original(b):
            assert row[0] == 2 and row[-1] == 3          # [CLS] ... [SEP]
            seen.append(row[row > 4])
        pads += int((b["attention_mask"] == 0).sum())
    seen = np.concatenate(seen)
    assert np.array_equal(np.sort(seen), all_tokens)        # every token exactly once
    assert ld.stats["docs"] == 64
    assert pads < 2 * (32 + 20)                             # padding only at each slot's end (and rare 1-pads)


def test_one_rank_two_workers_equals_two_ranks_one_worker(small_shards):
    kw = dict(seq_len=64, micro_batch_size=2, seed=11)
    one = _take(ShardLoader(small_shards.dir, num_workers=2, **kw), 10)
    r0 = _take(ShardLoader(small_shards.dir, dp_rank=0, dp_size=2, num_workers=1, **kw), 5)
    r1 = _take(ShardLoader(small_shards.dir, dp_rank=1, dp_size=2, num_workers=0, **kw), 5)
    assert _same(one[0::2], r0) and _same(one[1::2], r1)
    assert not torch.equal(r0[0]["input_ids"], r1[0]["input_ids"])


def test_workers_zero_equals_one_and_deterministic(small_shards):
    kw = dict(seq_len=64, micro_batch_size=2, seed=2)
    a = _take(ShardLoader(small_shards.dir, num_workers=0, **kw), 6)
    assert _same(a, _take(ShardLoader(small_shards.dir, num_workers=1, **kw), 6))
    assert _same(a, _take(ShardLoader(small_shards.dir, num_workers=0, **kw), 6))
    assert not _same(a, _take(ShardLoader(small_shards.dir, num_workers=0, seq_len=64, micro_batch_size=2, seed=3), 6))


def test_eval_loader_is_deterministic(small_shards):
    kw = dict(seq_len=128, micro_batch_size=4, num_workers=1, max_epochs=1)
    assert _same(_take(ShardLoader(small_shards.eval_dir, **kw), 4), _take(ShardLoader(small_shards.eval_dir, **kw), 4))


def _exact_resume_rank(rank, world, shard_dir, n, m):
    kw = dict(seq_len=64, micro_batch_size=2, dp_rank=rank, dp_size=world, num_workers=2, seed=7)
    full = _take(ShardLoader(shard_dir, **kw), n + m)
    first = ShardLoader(shard_dir, **kw)
    _take(first, n)
    state = first.state_dict()
    resumed = ShardLoader(shard_dir, **kw)
    resumed.load_state_dict(state)
    rest = _take(resumed, m)
    other = _take(ShardLoader(shard_dir, **{**kw, "dp_rank": 1 - rank}), 1)
    return _same(full[n:], rest), torch.equal(full[0]["input_ids"], other[0]["input_ids"])


def test_exact_resume_two_ranks_two_workers(small_shards):
    # n odd: the resumed DataLoader must start with the second worker; 40 batches cross shard boundaries
    results = run_distributed(_exact_resume_rank, world_size=2, args=(small_shards.dir, 41, 12), timeout=240)
    assert results == [(True, False), (True, False)]


def _elastic_phase1(rank, world, shard_dir, n):
    ld = ShardLoader(shard_dir, seq_len=32, micro_batch_size=2, dp_rank=rank, dp_size=world, num_workers=2,
                     seed=9, max_epochs=1)
    batches = _take(ld, n)
    return ld.state_dict(), np.concatenate([r for b in batches for r in _original(b)])


def test_elastic_resume_two_ranks_to_one_covers_the_epoch_exactly_once(unique_set, caplog):
    d, all_tokens = unique_set
    results = run_distributed(_elastic_phase1, world_size=2, args=(d, 7), timeout=240)
    states = [s for s, _ in results]
    seen = [t for _, t in results]
    ld = ShardLoader(d, seq_len=32, micro_batch_size=2, num_workers=1, seed=9, max_epochs=1)
    with caplog.at_level(logging.WARNING):
        ld.load_state_dict(states)
    assert "elastic resume: 4 old slots -> 1 new slots" in caplog.text
    assert "4 partly read piece(s) continue at the token where they stopped" in caplog.text
    seen += [r for b in ld for r in _original(b)]
    seen = np.concatenate(seen)
    assert np.array_equal(np.sort(seen[seen > 4]), all_tokens)   # nothing skipped, nothing read twice
    with pytest.raises(ValueError, match="needs all 4 old slots"):
        ShardLoader(d, seq_len=32, micro_batch_size=2, num_workers=1, seed=9).load_state_dict(states[0])


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    """One shard of 48 documents whose token ids are all distinct."""
    docs = _distinct_docs(seed=1, count=48, lengths=(3, 90))
    d = tmp_path_factory.mktemp("one_shard")
    write_shard_set(docs, d, vocab_size=60000)
    return d, np.concatenate(docs)


def _tokens(batches):
    out = [r for b in batches for r in _original(b)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def test_one_shard_on_two_ranks_two_workers_stopped_and_resumed_sees_each_document_once(one_shard, caplog):
    d, all_tokens = one_shard
    kw = dict(seq_len=24, micro_batch_size=2, seed=6, max_epochs=1)
    phase1 = [ShardLoader(d, dp_rank=r, dp_size=2, num_workers=2, **kw) for r in range(2)]
    first = [_take(ld, 3) for ld in phase1]                      # 3 batches per rank: both workers, mid-document
    states = [ld.state_dict() for ld in phase1]
    assert all(len(s["sources"]["main"]["slots"]) == 2 for s in states)
    pieces = [p for s in states for slot in s["sources"]["main"]["slots"].values() for p in slot["pieces"]]
    assert {p[0] for p in pieces} == {0} and len(pieces) == 4      # 4 slots share the shard by document ranges
    seen_first = _tokens(first[0] + first[1])

    def rest(layouts):
        out = []
        for rank, world, workers in layouts:
            ld = ShardLoader(d, dp_rank=rank, dp_size=world, num_workers=workers, **kw)
            ld.load_state_dict(states if (world, workers) != (2, 2) else states[rank])
            out += list(ld)
        return _tokens(out)

    same = rest([(0, 2, 2), (1, 2, 2)])
    with caplog.at_level(logging.WARNING):
        one = rest([(0, 1, 3)])                                   # another world size and worker count
        three = rest([(r, 3, 1) for r in range(3)])
    assert "elastic resume: 4 old slots -> 3 new slots" in caplog.text
    for resumed in (same, one, three):
        seen = np.concatenate([seen_first, resumed])
        assert np.array_equal(np.sort(seen[seen > 4]), all_tokens)  # every document of the epoch exactly once


def test_deal_covers_every_document_once_and_balances_tokens():
    from data_pipeline.slots import WHOLE_SHARD_TOLERANCE, deal

    cases = {"even": [(100, 10_000)] * 8, "fewer shards than slots": [(100, 10_000)] * 3,
             "uneven": [(1000, 100_000), (10, 1_000), (10, 1_000), (20, 2_000), (5, 500)],
             "one shard": [(7, 700)]}
    for name, shards in cases.items():
        total = sum(t for _, t in shards)
        for slots in (1, 2, 3, 4, 7):
            if sum(d for d, _ in shards) < slots:
                continue
            for epoch in (0, 1):
                dealt = deal(3, epoch, shards, slots)
                assert dealt == deal(3, epoch, shards, slots)              # deterministic from (seed, epoch)
                ranges = {i: [] for i in range(len(shards))}
                for g, pieces in enumerate(dealt):
                    assert pieces, f"{name}: slot {g} of {slots} got nothing"
                    for p in pieces:
                        ranges[p.shard].append((p.lo, p.hi))
                for i, rs in ranges.items():    # the ranges of a shard tile [0, num_docs): each document once
                    rs.sort()
                    assert rs[0][0] == 0 and rs[-1][1] == shards[i][0], (name, slots, rs)
                    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:])), (name, slots, rs)
                loads = [sum(p.num_docs * shards[p.shard][1] / shards[p.shard][0] for p in ps) for ps in dealt]
                assert max(loads) <= WHOLE_SHARD_TOLERANCE * total / slots + 100 + 1e-6, (name, slots, loads)
    # a balanced set on fewer slots than shards reads whole shards (each file read by one slot)
    assert all(p.lo == 0 and p.hi == 100 for ps in deal(0, 0, cases["even"], 4) for p in ps)
    assert deal(0, 0, cases["even"], 4) != deal(0, 1, cases["even"], 4)


def test_a_state_of_another_format_is_refused_naming_it(small_shards):
    kw = dict(seq_len=64, micro_batch_size=2, num_workers=0, seed=8)
    ld = ShardLoader(small_shards.dir, **kw)
    _take(ld, 3)
    state = ld.state_dict()
    assert state["format"] == 3
    for other in (1, 4):
        with pytest.raises(DataError, match=rf"field .format.: expected 3 \(or 2\), got {other}"):
            ShardLoader(small_shards.dir, **kw).load_state_dict({**state, "format": other})


def test_stage_switch_128_to_512_repacks_from_the_consumed_position(unique_set):
    d, all_tokens = unique_set
    kw = dict(micro_batch_size=2, num_workers=2, seed=4, max_epochs=1)
    ld = ShardLoader(d, seq_len=128, **kw)
    first = _take(ld, 5)                    # workers have prefetched more than this
    state = ld.state_dict()
    ld.set_stage(512, 1)
    rest = list(ld)
    assert all(b["input_ids"].shape[1] == 512 for b in rest) and rest[0]["input_ids"].shape[0] == 1
    seen = np.concatenate([r for b in first + rest for r in _original(b)])
    seen = seen[seen > 4]
    assert np.array_equal(np.sort(seen), all_tokens)         # nothing lost, nothing repeated
    other = ShardLoader(d, seq_len=128, **kw)                # the same from a saved state
    other.load_state_dict(state)
    other.set_stage(512, 1)
    assert _same(list(other), rest)


def test_state_errors(small_shards, unique_set):
    ld = ShardLoader(small_shards.dir, seq_len=64, micro_batch_size=2, num_workers=0, seed=1)
    st = ld.state_dict()
    with pytest.raises(ValueError, match="field 'seed'"):
        ShardLoader(small_shards.dir, seq_len=64, micro_batch_size=2, num_workers=0, seed=2).load_state_dict(st)
    with pytest.raises(ValueError, match="field 'shard_set'"):
        ShardLoader(unique_set[0], seq_len=64, micro_batch_size=2, num_workers=0, seed=1).load_state_dict(st)
    # more slots than shards is fine (slots share shards); more slots than documents is not
    ShardLoader(small_shards.dir, seq_len=64, micro_batch_size=2, dp_size=9, num_workers=0)
    with pytest.raises(ValueError, match="64 documents for 66 loader slots"):
        ShardLoader(unique_set[0], seq_len=64, micro_batch_size=2, dp_size=33, num_workers=2)


def test_process_exits_while_a_loader_with_workers_is_mid_epoch(small_shards):
    """Workers ignore SIGTERM (the trainer decides when to stop); a script that ends while a loader is
    still iterating must still exit, not wait forever in multiprocessing's exit handler."""
    import subprocess
    import sys

    script = (f"from data_pipeline.loader import ShardLoader\n"
              f"it = iter(ShardLoader({str(small_shards.dir)!r}, seq_len=64, micro_batch_size=2, num_workers=2))\n"
              f"next(it)\nprint('took a batch', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert p.returncode == 0 and "took a batch" in p.stdout, p.stderr


def test_resume_from_every_batch_with_a_bad_shard_skipped(tmp_path):
    """skip_bad_shards with the bad shard last in the slot's order: a state saved after any batch
    (also once the bad shard was tried and skipped) resumes exactly where it stopped."""
    from data_pipeline.slots import deal

    rng = np.random.default_rng(3)
    docs, nxt = [], 5
    for _ in range(24):
        n = int(rng.integers(4, 40))
        docs.append(np.arange(nxt, nxt + n))
        nxt += n
    d = tmp_path / "set"
    write_shard_set(docs, d, vocab_size=60000, max_docs_per_shard=6)
    last = deal(2, 0, [(6, 0)] * 4, 1)[0][-1].shard                # the shard read last in epoch 0
    p = d / f"shard-{last:06d}.tar"
    b = bytearray(p.read_bytes())
    b[700] ^= 0xFF
    p.write_bytes(bytes(b))
    kw = dict(seq_len=24, micro_batch_size=1, num_workers=0, seed=2, max_epochs=1, skip_bad_shards=True)
    full = list(ShardLoader(d, **kw))
    assert len(full) > 10
    for n in range(1, len(full)):
        ld = ShardLoader(d, **kw)
        _take(ld, n)
        resumed = ShardLoader(d, **kw)
        resumed.load_state_dict(ld.state_dict())
        assert _same(list(resumed), full[n:]), f"resumed after batch {n}"


def test_a_state_saved_at_the_very_end_of_a_slots_epoch_resumes_with_the_next_epoch(unique_set):
    """One row a batch: the batch holding an epoch's last (padded) sequence leaves its slot at the end of that
    epoch's pieces (cursor == len(pieces)); resumed from there, the loader reads the next epoch from its first
    piece, as the uninterrupted loader does (in a mixture the same state arises with a batch's later rows from
    another source). Every other batch's state resumes exactly too."""
    d, _ = unique_set
    kw = dict(seq_len=96, micro_batch_size=1, num_workers=0, seed=4, max_epochs=2)
    full = list(ShardLoader(d, **kw))
    at_end = []
    for n in range(1, len(full)):
        ld = ShardLoader(d, **kw)
        _take(ld, n)
        state = ld.state_dict()
        slot = state["sources"][next(iter(state["sources"]))]["slots"]["0"]
        if slot["epoch"] == 0 and slot["cursor"] == len(slot["pieces"]):
            at_end.append(n)
        resumed = ShardLoader(d, **kw)
        resumed.load_state_dict(state)
        assert _same(list(resumed), full[n:]), f"resumed after batch {n} of {len(full)}"
    assert len(at_end) == 1


def test_the_loader_takes_the_manifest_it_is_given_and_reads_it_no_more(unique_set, tmp_path):
    """The trainer hands the loader the manifests its resolved run read and checked: the loader of a set whose
    manifest.json is gone gives the batches of one that reads it, and LoaderSettings builds the same loader."""
    import shutil

    from data_pipeline.loader import LoaderSettings
    from data_pipeline.manifest import read_manifest
    from data_pipeline.mixture import Source

    copy = tmp_path / "set"
    shutil.copytree(unique_set[0], copy)
    manifest = read_manifest(copy)
    (copy / "manifest.json").unlink()
    settings = LoaderSettings(seq_len=64, micro_batch_size=2, num_workers=0, seed=1)
    given = settings.build([Source("main", str(copy), None, manifest)])
    read = ShardLoader(unique_set[0], seq_len=64, micro_batch_size=2, num_workers=0, seed=1)
    for a, b in zip(_take(given, 3), _take(read, 3)):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    with pytest.raises(DataError, match="manifest.json"):
        settings.build([Source("main", str(copy))])  # without it the loader reads the file, which is gone
