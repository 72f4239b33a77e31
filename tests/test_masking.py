import numpy as np

from data_pipeline.masking import mask_tokens, sample_keys

V = 5000


def _special():
    s = np.zeros(V, bool)
    s[:5] = True
    return s


def _batch(B=64, S=512, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, V, (B, S))
    ids[:, 0] = 2
    ids[:, 100::97] = 3
    att = np.ones((B, S), np.int64)
    att[:8, 400:] = 0
    ids[att == 0] = 0
    return ids, att


def test_statistics_and_never_special():
    ids, att = _batch()
    keys = sample_keys(7, np.zeros(len(ids)), 3, np.arange(len(ids)))
    out, labels = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special())
    cand = (att == 1) & (ids >= 5)
    chosen = labels != -100
    assert not (chosen & ~cand).any()                          # never special, never padding
    assert (labels[chosen] == ids[chosen]).all()
    assert abs(chosen.sum() / cand.sum() - 0.15) < 0.005
    m = (out == 4) & chosen
    kept = (out == ids) & chosen
    rnd = chosen & ~m & ~kept
    n = chosen.sum()
    # n ~ 4800 chosen: 3.5 sigma bounds
    assert abs(m.sum() / n - 0.8) < 0.02 and abs(rnd.sum() / n - 0.1) < 0.015 and abs(kept.sum() / n - 0.1) < 0.015
    assert (out[rnd] >= 5).all()                               # random tokens are never special
    assert (out[~chosen] == ids[~chosen]).all()


def test_deterministic_and_per_sample():
    ids, att = _batch(B=8, S=128)
    keys = sample_keys(1, [0] * 8, 0, range(8))
    a = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special())
    b = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special())
    assert all((x == y).all() for x, y in zip(a, b))
    # a sample's mask does not depend on its batch-mates
    single = mask_tokens(ids[5:6], att[5:6], keys[5:6], vocab_size=V, mask_id=4, special=_special())
    assert (single[1][0] == a[1][5]).all()
    other = mask_tokens(ids, att, sample_keys(1, [1] * 8, 0, range(8)), vocab_size=V, mask_id=4,
                        special=_special())
    assert (other[1] != a[1]).any()                            # another epoch masks differently
    # the key of a sample changes with each of epoch, slot and sample index, and with nothing else
    keys = [int(sample_keys(1, [epoch], slot, [sample])[0])
            for epoch in (0, 1) for slot in (0, 1, 5) for sample in (0, 1, 2)]
    assert len(set(keys)) == len(keys) == 18
    assert sample_keys(1, [0, 1, 1], 5, [4, 2, 0])[1] == sample_keys(1, [1], 5, [2])[0]
    assert sample_keys(2, [1], 5, [2])[0] != sample_keys(1, [1], 5, [2])[0]
    # masks of the same tokens in two slots differ
    in_slot = [mask_tokens(ids, att, sample_keys(1, [0] * 8, slot, range(8)), vocab_size=V, mask_id=4,
                           special=_special())[1] for slot in (0, 1)]
    assert (in_slot[0] != in_slot[1]).any()


def test_whole_word_masking_masks_whole_words():
    ids, att = _batch(B=32, S=256)
    rng = np.random.default_rng(3)
    marks = (rng.random(ids.shape) < 0.4).astype(np.uint8)
    marks[:, 1] = 1
    keys = sample_keys(0, [0] * 32, 0, range(32))
    out, labels = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special(), word_starts=marks)
    chosen = labels != -100
    cand = (att == 1) & (ids >= 5)
    assert abs(chosen.sum() / cand.sum() - 0.15) < 0.02
    whole = partial = 0
    for b in range(len(ids)):
        starts = np.flatnonzero(marks[b] | ~cand[b])
        for s, e in zip(starts, list(starts[1:]) + [ids.shape[1]]):
            w = chosen[b, s:e][cand[b, s:e]]
            if w.any():
                whole += w.all()
                partial += not w.all()
    assert whole > 100 and partial == 0


def test_another_replacement_split_is_realised():
    """mask_replace (0.5, 0.3, 0.2): of ~4,800 chosen tokens half become [MASK], 30 % a random token, 20 % stay
    (3.5-sigma bounds); the choice itself (which tokens are predicted) does not depend on the split."""
    ids, att = _batch()
    keys = sample_keys(7, np.zeros(len(ids)), 3, np.arange(len(ids)))
    base_out, base_labels = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special())
    out, labels = mask_tokens(ids, att, keys, vocab_size=V, mask_id=4, special=_special(), mask_replace=(0.5, 0.3, 0.2))
    assert (labels == base_labels).all()
    chosen = labels != -100
    n = chosen.sum()
    m = (out == 4) & chosen
    kept = (out == ids) & chosen
    rnd = chosen & ~m & ~kept
    assert abs(m.sum() / n - 0.5) < 0.025 and abs(rnd.sum() / n - 0.3) < 0.023 and abs(kept.sum() / n - 0.2) < 0.02
    assert (out[~chosen] == ids[~chosen]).all()


def test_the_loader_masks_each_stage_at_its_rate_counted_from_the_batches(small_shards):
    """A loader at 30 % switched by set_stage to 15 % (as the trainer does at a stage with its own rate), whole
    words kept: the share of candidate tokens that carry a label, over 12 batches (~12,000 candidates) of each
    stage, is within 5 binomial standard deviations of the rate."""
    from data_pipeline.loader import ShardLoader

    ld = ShardLoader(small_shards.dir, seq_len=128, micro_batch_size=8, num_workers=0, seed=5, mlm_probability=0.3)
    special = set(ld.manifest["special_ids"].values())

    def realised(n):
        it, chosen, cand = iter(ld), 0, 0
        for _ in range(n):
            b = {k: np.asarray(v) for k, v in next(it).items()}
            original = np.where(b["labels"] != -100, b["labels"], b["input_ids"])
            is_cand = ~np.isin(original, list(special)) & (b["attention_mask"] != 0)
            chosen += int((b["labels"] != -100).sum())
            cand += int(is_cand.sum())
        return chosen / cand, cand

    for rate in (0.3, 0.15):
        if rate != 0.3:
            ld.set_stage(128, 8, mlm_probability=rate)
        got, n = realised(12)
        assert abs(got - rate) < 5 * (rate * (1 - rate) / n) ** 0.5, (rate, got, n)  # ~0.021, ~0.016
