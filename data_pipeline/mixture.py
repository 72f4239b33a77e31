"""Corpus mixtures: several shard sets read as one stream, each source's share of *tokens* fixed.

A :class:`Source` is a named shard set (a directory or a URL prefix, as :mod:`.source` reads). A
loader over several sources keeps, per slot, one position per source (its own
:class:`~.slots.SlotState`: each source is dealt, shuffled and resumed exactly as a single set is, with
its own epochs) and draws every row of every micro-batch from one of them.

Interleaving (:class:`Mixer`): token credits, i.e. smooth weighted round-robin by tokens. Each slot
holds one credit per source (they sum to zero). A row goes to the active source with the largest
credit (the first in the mixture's order on a tie); after it, every active source is credited its
share of the row's tokens and the chosen one is debited the row's tokens. Deterministic from the
state, no random numbers, and token-accurate at every moment: a source's tokens in a slot stay
within a few rows of ``share x tokens`` (the credits are bounded by the number of sources times the
longest row), so the realised share over any window of ``R`` rows of a slot is the target within
about ``2 x sources / R`` (:data:`WINDOW_TOLERANCE_ROWS`), not only on average over an epoch. A row
is one packed sequence of one source (rows are full but for a source's epoch tail), so a micro-batch
mixes sources row by row.

Shares change at a curriculum stage or on resume (:meth:`~.loader.ShardLoader.set_stage`); the
credits are kept, so the new shares hold from the next row on. A source whose share is 0 is not read
(its position waits). A source that reaches its ``max_epochs`` (whole epochs, the hard stop behind
the planner's repetition cap) leaves the mixture of that slot, the others share its part; the
loader ends when every source has.

Seeds: a mixture of one source reads exactly what a plain shard set does. With several, each source's
shard order, document shuffle and masking keys are seeded by :func:`source_seed` (the run's seed and
the source's *name*, so reordering the sources does not change what each reads).
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from .errors import UsageError

__all__ = ["Source", "as_sources", "source_seed", "shares", "Mixer", "DEFAULT_NAME", "SOURCE_NAME",
           "WINDOW_TOLERANCE_ROWS"]

DEFAULT_NAME = "main"
"""The name of a plain shard set read as a one-source mixture."""
SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""What a source's name may be (``fullmatch``): it becomes a directory name and a metric tag."""
WINDOW_TOLERANCE_ROWS = 2
"""Over any window of a slot's rows, a source's tokens differ from ``share x window tokens`` by at most
this many rows times the number of sources."""


@dataclass(frozen=True)
class Source:
    """A named shard set; ``max_epochs``: its repetition cap (None = none); ``manifest``: its manifest when the
    caller has read and checked it already (the loader then does not read it again)."""
    name: str
    location: str
    max_epochs: Optional[float] = None
    manifest: Optional[dict] = field(default=None, compare=False, repr=False)


def as_sources(shards) -> list[Source]:
    """A list of :class:`Source` from one location (a one-source mixture named :data:`DEFAULT_NAME`) or
    from Sources / (name, location[, max_epochs]) tuples; names checked (unique, ``[A-Za-z0-9_-]+``)."""
    if isinstance(shards, (str, os.PathLike)):
        return [Source(DEFAULT_NAME, str(shards))]
    out = [s if isinstance(s, Source) else Source(*s) for s in shards]
    if not out:
        raise UsageError("sources: expected at least one shard set")
    seen = set()
    for s in out:
        if not SOURCE_NAME.fullmatch(s.name or ""):
            raise UsageError(f"sources: name {s.name!r}: expected letters, digits, '_' or '-'")
        if s.name in seen:
            raise UsageError(f"sources: name {s.name!r} is given twice")
        if s.max_epochs is not None and not s.max_epochs > 0:
            raise UsageError(f"sources: {s.name}: max_epochs: expected a positive number, got {s.max_epochs!r}")
        seen.add(s.name)
    return out


def source_seed(seed: int, name: str, num_sources: int) -> int:
    """The seed of one source's shard order, shuffle and masks (see the module docstring)."""
    return seed if num_sources == 1 else seed + (zlib.crc32(name.encode()) << 32)


def shares(weights: Optional[Mapping[str, float]], names: Sequence[str],
           default: Optional[Mapping[str, float]] = None) -> dict[str, float]:
    """``weights`` (name -> non-negative number, any scale) as shares summing to 1, in ``names`` order;
    a name without a weight takes ``default``'s (None: every source weighs 1). Errors name the source."""
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise UsageError(f"weights: unknown source {unknown[0]!r} (the sources are {', '.join(names)})")
    raw = {}
    for n in names:
        w = weights.get(n, (default or {}).get(n, 1.0))
        try:
            w = float(w)
        except (TypeError, ValueError):
            raise UsageError(f"weights: {n}: expected a number, got {w!r}") from None
        if not w >= 0 or w == float("inf"):
            raise UsageError(f"weights: {n}: expected a finite number >= 0, got {w!r}")
        raw[n] = w
    total = sum(raw.values())
    if total <= 0:
        raise UsageError(f"weights: expected a positive sum, got {raw}")
    return {n: w / total for n, w in raw.items()}


class Mixer:
    """One slot's token credits (see the module docstring); ``credits`` in the mixture's order.
    ``share``: the sources' shares; :meth:`deactivate` takes a source out (its share goes to the others)."""

    def __init__(self, credits: Sequence[float], share: Sequence[float]):
        self.credits = [float(c) for c in credits]
        self.share = list(share)
        self._norm()

    def _norm(self) -> None:
        total = sum(self.share)
        self.live = [(i, s / total) for i, s in enumerate(self.share) if s > 0] if total > 0 else []

    def deactivate(self, i: int) -> None:
        self.share[i] = 0.0
        self._norm()

    def pick(self) -> int:
        """The source of the next row; -1 when no active source has a positive share."""
        best, most = -1, 0.0
        for i, _ in self.live:
            if best < 0 or self.credits[i] > most:
                best, most = i, self.credits[i]
        return best

    def charge(self, chosen: int, tokens: int) -> None:
        """Account a row of ``tokens`` from source ``chosen``."""
        c = self.credits
        for i, s in self.live:
            c[i] += tokens * s
        c[chosen] -= tokens
