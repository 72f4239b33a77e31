"""Dynamic MLM masking, vectorised and counter-based.

Every random number is a hash of (seed, epoch, global slot, sample index, position)
(splitmix64), so a sample's mask depends on nothing else: not on the batch it lands in,
the worker that made it, or how many samples were drawn before. A resumed run, or the
same slots served by another rank/worker arrangement (as many slots in all), masks
identically; nothing reads the OS.

Rule (BERT): choose ``mlm_probability`` of the non-special, non-padding tokens for
prediction (labels = original id, -100 elsewhere); of those, 80% become [MASK], 10% a
random non-special token, 10% stay (``mask_replace`` sets another split). With word-start marks the choice is per *word*: a
token is chosen iff the first token of its word is, so words are masked whole; the
80/10/10 split stays per token (as Google's whole-word-masking BERT).
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

IGNORE_INDEX = -100
"""The label of a position that is not predicted (what torch's cross-entropy ignores by default); the
one definition, used by the model, the baselines and fine-tuning."""

__all__ = ["sample_keys", "hash_uniform_bits", "mask_tokens", "MASK_REPLACE"]

MASK_REPLACE = (0.8, 0.1, 0.1)
"""BERT's split of the chosen tokens: [MASK], a random token, unchanged."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """_mix on one Python int (identical results)."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=1024)
def _base_key(seed: int, epoch: int, slot: int) -> int:
    g = 0x9E3779B97F4A7C15
    k = _mix_int(_mix_int((seed & 0xFFFFFFFFFFFFFFFF) + g) ^ ((epoch + g) & 0xFFFFFFFFFFFFFFFF))
    return _mix_int(k ^ ((slot + g) & 0xFFFFFFFFFFFFFFFF))


def sample_keys(seed, epochs, slot: int, samples, groups=None) -> np.ndarray:
    """uint64 key per sample from (seed, epoch, global slot id, sample index in that slot's epoch).
    ``groups`` (one small int per sample) with ``seed`` a sequence: sample i takes ``seed[groups[i]]``
    (rows of several sources, each with its own seed)."""
    epochs = np.asarray(epochs, np.int64)
    samples = np.asarray(samples, np.uint64)
    base = np.empty(epochs.shape, np.uint64)
    if groups is None:
        for e in set(epochs.tolist()):  # usually one epoch per batch: the scalar part in Python ints
            base[epochs == e] = _base_key(int(seed), e, slot)
    else:  # a handful of rows: one cached scalar key each
        base[:] = [_base_key(int(seed[g]), e, slot) for g, e in zip(np.asarray(groups).tolist(), epochs.tolist())]
    with np.errstate(over="ignore"):
        return _mix(base ^ (samples + _GOLDEN))


_POS: dict[int, np.ndarray] = {}


def _mix_inplace(x: np.ndarray) -> np.ndarray:
    """_mix without temporaries beyond one buffer (the masking hot path)."""
    t = np.empty_like(x)
    for shift, mult in ((30, _M1), (27, _M2)):
        np.right_shift(x, np.uint64(shift), out=t)
        np.bitwise_xor(x, t, out=x)
        np.multiply(x, mult, out=x)
    np.right_shift(x, np.uint64(31), out=t)
    np.bitwise_xor(x, t, out=x)
    return x


def hash_uniform_bits(keys: np.ndarray, seq_len: int) -> np.ndarray:
    """uint64 [B, S] of random bits, one per (sample key, position)."""
    pos = _POS.get(seq_len)
    if pos is None:
        with np.errstate(over="ignore"):
            pos = _POS[seq_len] = (np.arange(1, seq_len + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    with np.errstate(over="ignore"):
        return _mix_inplace(np.bitwise_xor(keys[:, None], pos))


def mask_tokens(input_ids: np.ndarray, attention_mask: np.ndarray, keys: np.ndarray, *, vocab_size: int,
                mask_id: int, special: np.ndarray, mlm_probability: float = 0.15,
                word_starts: Optional[np.ndarray] = None,
                mask_replace: tuple[float, float, float] = MASK_REPLACE) -> tuple[np.ndarray, np.ndarray]:
    """Masked inputs and labels (both int64 [B, S]) for int64 ``input_ids`` [B, S].

    ``special``: bool lookup table [vocab_size], True for ids never chosen (and never drawn
    as random replacements). ``word_starts``: uint8/bool [B, S] word-start marks or None.
    ``mask_replace``: the shares of the chosen tokens that become [MASK], a random token, and stay.
    """
    B, S = input_ids.shape
    h = hash_uniform_bits(keys, S)
    cand = ~special[input_ids]                                       # [PAD] is special: padding excluded
    if attention_mask is not None and not special[0]:
        cand &= attention_mask != 0
    threshold = np.uint64(int(mlm_probability * (1 << 24)))
    sel_draw = (h >> np.uint64(40)) < threshold                      # top 24 bits: chosen?
    if word_starts is not None:
        starts = word_starts.astype(bool) | ~cand                    # specials/pads are their own words
        starts[:, :2] = True                                         # a word cut at the sequence start
        pos = np.where(starts, np.arange(S)[None, :], 0)
        np.maximum.accumulate(pos, axis=1, out=pos)                  # index of each token's word start
        chosen = np.take_along_axis(sel_draw, pos, axis=1) & cand
    else:
        chosen = sel_draw & cand
    kind = (h >> np.uint64(24)) & np.uint64(0xFFFF)                  # next 16 bits: 80/10/10
    to_mask = chosen & (kind < np.uint64(int(mask_replace[0] * 65536)))
    to_random = chosen & ~to_mask & (kind < np.uint64(int((mask_replace[0] + mask_replace[1]) * 65536)))
    labels = np.where(chosen, input_ids, IGNORE_INDEX)
    out = np.where(to_mask, mask_id, input_ids)
    if to_random.any():
        allowed = np.flatnonzero(~special[:vocab_size])
        r = (h[to_random] & np.uint64(0xFFFFFF)) % np.uint64(len(allowed))  # low 24 bits: which token
        out[to_random] = allowed[r.astype(np.int64)]
    return out, labels
