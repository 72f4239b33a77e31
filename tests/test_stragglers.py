"""Stragglers (``observe/stragglers.py``): on two real ranks, one made slow (``ROFORMER_SLOW_RANK``: a sleep in its
forward) is named in rank 0's log with its host, and the per-rank spread reaches ``metrics.jsonl`` and TensorBoard
with the slow rank as the slowest; a run without a slow rank names nobody."""

from __future__ import annotations

import socket

from roformer_dist.runtime.events import read_scalars
from roformer_dist.runtime.stop import EXIT_DONE
from trainer_runs import make_cfg, records, train

SETTINGS = ("trainer.log_every=1", "trainer.stop_at_step=8", "dist.straggler_log_steps=3")


def test_a_slow_rank_is_named_with_its_host_and_shows_in_the_spread(small_shards, tmp_path):
    run = tmp_path / "slow"
    assert train(make_cfg(small_shards, run, *SETTINGS), {"ROFORMER_SLOW_RANK": "1:0.15"}) == [EXIT_DONE, EXIT_DONE]
    recs = records(run)
    assert all(len(r["rank_forward_s"]) == 2 and len(r["rank_data_wait_s"]) == 2 for r in recs)
    assert all(r["rank_forward_s"][1] > r["rank_forward_s"][0] + 0.1 for r in recs)
    log = (run / "logs" / "rank0.log").read_text()
    assert f"step 3: rank 1 (host {socket.gethostname()}) is a straggler: its forward passes took" in log
    assert "rank 0 (host" not in log
    slowest = read_scalars(run / "tb")["perf/rank_forward_slowest"]
    assert {v for _, v in slowest} == {1.0} and len(slowest) == 8

    calm = tmp_path / "calm"
    assert train(make_cfg(small_shards, calm, *SETTINGS)) == [EXIT_DONE, EXIT_DONE]
    assert "is a straggler" not in (calm / "logs" / "rank0.log").read_text()
