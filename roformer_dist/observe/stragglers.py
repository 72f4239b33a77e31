"""Stragglers: one slow rank makes every rank slow, and a step's time cannot say which one it is.

In data-parallel training every rank waits for the slowest in each step's collectives, so each rank's step
time is the same. What differs is the part of a step a rank spends on its own: waiting for its batches and
its forward passes (``parallel.runner.RankTimes``; with ZeRO 0-2 no collective runs in a forward). At every log
step each rank's sums since the last one are gathered (one small collective), and rank 0 records the spread:

- ``metrics.jsonl``: ``rank_forward_s`` and ``rank_data_wait_s``, per step, one value per rank;
- TensorBoard: ``perf/rank_forward_s_min|max``, ``perf/rank_forward_slowest`` (the rank),
  ``perf/rank_data_wait_s_max`` and ``perf/rank_data_wait_slowest``;
- a warning naming a rank (and its host: ``SLURMD_NODENAME`` under SLURM) whose forward or data wait took more
  than ``dist.straggler_factor`` times the ranks' median for ``dist.straggler_log_steps`` log steps in a row
  (again after as many more).

Pipeline layouts have no per-rank forward (DeepSpeed's schedule interleaves them): there only the data wait
is compared.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics

__all__ = ["StragglerWatch"]

log = logging.getLogger(__name__)

_FLOOR_S = 0.01
"""Per-step times below this (10 ms) are noise: no rank is named for being slower than a median under it."""


class StragglerWatch:
    def __init__(self, factor: float, log_steps: int, rank: int, comm):
        self.factor, self.log_steps, self.rank, self.comm = factor, log_steps, rank, comm
        self.host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._streak: dict[tuple[str, int], int] = {}

    def gather(self, step: int, times: tuple[float, float], steps: int) -> tuple[dict, dict]:
        """Every rank, at a log step (collective): this rank's (data wait, forward) seconds over the ``steps``
        steps since the last log step. Returns (fields for the step's record, TensorBoard scalars)."""
        rows = self.comm.all_gather((times[0] / steps, times[1] / steps, self.host))
        data = [r[0] for r in rows]
        forward = [r[1] for r in rows]
        record = {"rank_forward_s": [round(x, 5) for x in forward], "rank_data_wait_s": [round(x, 5) for x in data]}
        scalars = {"perf/rank_data_wait_s_max": max(data), "perf/rank_data_wait_slowest": data.index(max(data))}
        if any(forward):
            scalars.update({"perf/rank_forward_s_min": min(forward), "perf/rank_forward_s_max": max(forward),
                            "perf/rank_forward_slowest": forward.index(max(forward))})
        for what, values in (("forward passes", forward), ("data wait", data)):
            self._check(step, what, values, [r[2] for r in rows])
        return record, scalars

    def _check(self, step: int, what: str, values: list[float], hosts: list[str]) -> None:
        median = statistics.median(values)
        for r, value in enumerate(values):
            key = (what, r)
            slow = len(values) > 1 and value > self.factor * max(median, _FLOOR_S)
            self._streak[key] = self._streak.get(key, 0) + 1 if slow else 0
            if self.rank == 0 and slow and self._streak[key] % self.log_steps == 0:
                log.warning("step %d: rank %d (host %s) is a straggler: its %s took %.4f s per step, %.1fx the "
                            "ranks' median %.4f s, for %d log steps in a row (dist.straggler_factor %g)", step, r,
                            hosts[r], what, value, value / max(median, 1e-12), median, self._streak[key],
                            self.factor)
