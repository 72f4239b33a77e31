import logging

import numpy as np
import pytest
import torch

from data_pipeline.loader import ShardLoader
from data_pipeline.shards import write_shard_set
from multiproc import run_distributed

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


@pytest.fixture(scope="module")
def unique_set(tmp_path_factory):
    """8 shards of documents whose token ids are all distinct: a token names its document."""
    rng = np.random.default_rng(0)
    docs, nxt = [], 5
    for _ in range(64):
        n = int(rng.integers(5, 150))
        docs.append(np.arange(nxt, nxt + n))
        nxt += n
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


def test_elastic_resume_two_ranks_to_one_covers_the_epoch(unique_set, caplog):
    d, all_tokens = unique_set
    results = run_distributed(_elastic_phase1, world_size=2, args=(d, 7), timeout=240)
    states = [s for s, _ in results]
    seen = [t for _, t in results]
    ld = ShardLoader(d, seq_len=32, micro_batch_size=2, num_workers=1, seed=9, max_epochs=1)
    with caplog.at_level(logging.WARNING):
        ld.load_state_dict(states)
    assert "elastic resume: 4 old slots -> 1 new slots" in caplog.text
    seen += [r for b in ld for r in _original(b)]
    seen = np.concatenate(seen)
    seen = seen[seen > 4]
    assert set(all_tokens.tolist()) <= set(seen.tolist())        # nothing skipped
    # what is read twice lies in the shards the old slots had partly read
    uniq, counts = np.unique(seen, return_counts=True)
    repeated = uniq[counts > 1]
    partly = [s["shards"][s["cursor"]] for s in (x for st in states for x in st["slots"].values())
              if s["doc"] or s["offset"]]
    per_shard = 8
    doc_tokens = np.split(all_tokens, np.cumsum([len(x) for x in _docs_of(d)])[:-1])
    allowed = set(np.concatenate([doc_tokens[i] for s in partly for i in range(s * per_shard, (s + 1) * per_shard)]).tolist())
    assert len(repeated) > 0 and set(repeated.tolist()) <= allowed
    with pytest.raises(ValueError, match="needs all 4 old slots"):
        ShardLoader(d, seq_len=32, micro_batch_size=2, num_workers=1, seed=9).load_state_dict(states[0])


def _docs_of(d):
    from data_pipeline.shards import read_manifest, read_shard
    m = read_manifest(d)
    out = []
    for e in m["shards"]:
        sd = read_shard(d / e["name"], m["dtype"], e)
        out += [sd.tokens[s:s + n] for s, n in zip(sd.tok_start, sd.lengths)]
    return out


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
    with pytest.raises(ValueError, match="8 shards for 9 loader slots"):
        ShardLoader(small_shards.dir, seq_len=64, micro_batch_size=2, dp_size=9, num_workers=0)
