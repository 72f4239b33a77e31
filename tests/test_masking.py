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
