"""The multi-process test helper itself: results, propagated tracebacks, time-outs."""

import time

import pytest
import torch
import torch.distributed as dist

from roformer_dist.testing import DistributedTestError, run_distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank one")
    return rank


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def test_all_reduce_two_ranks():
    assert run_distributed(_all_reduce, world_size=2, timeout=120) == [3.0, 3.0]


def test_rank_exception_propagates_with_traceback():
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_raise_on_rank1, world_size=2, timeout=120)
    msg = str(e.value)
    assert "rank 1 raised" in msg and "boom from rank one" in msg and "_raise_on_rank1" in msg


def test_hung_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang_on_rank0, world_size=2, timeout=8)
    assert time.monotonic() - t0 < 60
