"""Loss spikes (``trainer.spike: skip``, ``loop/spikes.py``): a step whose loss is far above the recent ones
drops its update, exactly as a non-finite step does, and a resumed run takes the same decisions.

- On real ranks: a run with spikes injected at two steps (``ROFORMER_INJECT_SPIKE_AT``, the loss x 50), stopped
  between them and resumed, records both with ``"spike": true`` and equals, step for step, an uninterrupted run
  with NaN injected at those steps (the update-dropping path the project already trusts): the second spike is
  caught after the resume only because the checkpoint kept the guard's history.
- The guard alone: the threshold of a step uses only the losses up to the last log step before it, the window
  and ``spike_max`` count as documented, and its state round-trips.
"""

from __future__ import annotations

import math

import pytest

from roformer_dist.config import load_config
from roformer_dist.errors import ConfigError
from roformer_dist.loop.spikes import SpikeGuard
from roformer_dist.runtime.stop import EXIT_DONE
from trainer_runs import assert_traces_equal, make_cfg, records, train

SPIKES = "10,14"
SETTINGS = ("trainer.spike=skip", "trainer.spike_window=4", "trainer.log_every=1", "trainer.save_every=0")


def _run(shards, run_dir, env, *extra):
    cfg = make_cfg(shards, run_dir, *SETTINGS, *extra, world_size=1)
    assert train(cfg, env) == [EXIT_DONE]
    return records(run_dir)


def test_a_spike_drops_its_update_as_a_nan_does_and_a_resume_skips_the_same_steps(small_shards, tmp_path):
    nan = _run(small_shards, tmp_path / "nan", {"ROFORMER_INJECT_NAN_AT": SPIKES})
    # stopped at 12 (a checkpoint) between the two spikes, then resumed: step 14 is caught only with the history
    # the checkpoint kept (the window is refilled no sooner than step 16 otherwise)
    spiked = tmp_path / "spiked"
    _run(small_shards, spiked, {"ROFORMER_INJECT_SPIKE_AT": SPIKES}, "trainer.stop_at_step=12")
    recs = _run(small_shards, spiked, {"ROFORMER_INJECT_SPIKE_AT": SPIKES})
    assert [r["step"] for r in recs if r.get("spike")] == [10, 14]
    assert all(r["skipped"] for r in recs if r["step"] in (10, 14))
    assert min(r["loss"] for r in recs if r.get("spike")) > 10 * max(r["loss"] for r in recs if not r.get("spike"))
    kept = lambda rs: [r["loss"] for r in rs if r["step"] not in (10, 14)]  # noqa: E731
    assert_traces_equal(kept(recs), kept(nan), tol=0.0)  # the same updates dropped: bit-equal losses
    log = (spiked / "logs" / "rank0.log").read_text()
    assert "step 10: loss spike" in log and "update skipped (1 in the last 4 steps, 1 in all)" in log
    assert "step 14: loss spike" in log and "(1 in the last 4 steps, 2 in all)" in log


def _guard(**overrides):
    cfg = load_config(overrides=["trainer.spike=skip", "trainer.spike_window=4", "trainer.log_every=2",
                                 *(f"trainer.{k}={v}" for k, v in overrides.items())])
    return SpikeGuard(cfg.trainer)


def test_the_threshold_uses_the_losses_up_to_the_last_log_step_only():
    g = _guard()
    for step in range(1, 6):
        g.observe(step, 1.0 + step / 10, spiked=False, nonfinite=False)
    # step 6 runs after log step 4: the losses of steps 1-4 count (median 1.25), not step 5's (read early by a stop)
    assert g.threshold(6) == pytest.approx(5 * 1.25)
    assert g.threshold(7) == pytest.approx(5 * 1.35)  # after log step 6... of steps 2-5: the last 4 up to step 6
    assert _guard().threshold(3) is None  # too little history: nothing is a spike yet
    assert _guard(spike="none").threshold(100) is None


def test_spikes_within_the_window_stop_the_run_and_the_state_round_trips():
    g = _guard(spike_max=2)
    for step in range(1, 9):
        g.observe(step, 1.0, spiked=False, nonfinite=False)
    g.observe(9, 50.0, spiked=True, nonfinite=False)
    assert not g.too_many
    g.observe(14, 50.0, spiked=True, nonfinite=False)  # step 9 is out of the 4-step window by now
    assert not g.too_many and g.spikes == [14]
    g.observe(15, 50.0, spiked=True, nonfinite=False)
    assert g.too_many and "2 loss spikes in the last 4 steps (trainer.spike_max 2)" in g.stop_message(15)
    h = _guard(spike_max=2)
    h.load_state_dict(g.state_dict())
    assert (h.recent, h.spikes, h.total) == (g.recent, g.spikes, g.total) and h.too_many
    g.observe(16, math.nan, spiked=False, nonfinite=True)  # a non-finite loss is not history
    assert all(math.isfinite(v) for _, v in g.recent)


ROLLBACK = ("trainer.spike=rollback", "trainer.spike_window=4", "trainer.log_every=1", "trainer.save_every=4",
            "optim.schedule=constant", "optim.warmup_steps=0")


def test_a_rolled_back_spike_skips_the_batches_since_the_checkpoint_and_a_resume_replays_it(small_shards, tmp_path):
    """Rolled back at step 14 to the checkpoint of step 12: steps 13-18 train on the batches of steps 15-20. With a
    constant LR and no dropout, that is what a run with NaN at steps 13 and 14 (updates dropped, batches used up)
    computes at its steps 15-18, bit for bit. A run stopped before the spike (at 13, a checkpoint that is not a
    rollback target) and after it (at 15), then resumed, records the same losses."""
    def run(name, env, *extra):
        cfg = make_cfg(small_shards, tmp_path / name, *ROLLBACK, *extra, world_size=1)
        assert train(cfg, env) == [EXIT_DONE]
        return records(tmp_path / name)

    nan = run("nan", {"ROFORMER_INJECT_NAN_AT": "13,14"})
    rolled = run("rolled", {"ROFORMER_INJECT_SPIKE_AT": "14"})
    assert [r["step"] for r in rolled] == list(range(1, 19))  # the undone steps' records are gone
    assert rolled[12]["rollback"] == {"spike_step": 14, "to_step": 12, "steps_skipped": 2}
    assert not any(r.get("spike") or r["skipped"] for r in rolled)
    loss = lambda rs, steps: [r["loss"] for r in rs if r["step"] in steps]  # noqa: E731
    assert loss(rolled, range(1, 13)) == loss(nan, range(1, 13))
    assert loss(rolled, range(13, 17)) == loss(nan, range(15, 19))  # the batches of steps 13 and 14 skipped
    log = (tmp_path / "rolled" / "logs" / "rank0.log").read_text()
    assert "step 14: loss spike" in log and "update skipped, rolling back (1 in the last 4 steps, 1 in all)" in log
    assert "step 14: rolled back to step 12; the batches of steps 13-14 are skipped" in log

    for stop_at in (13, 15, 0):
        resumed = run("resumed", {"ROFORMER_INJECT_SPIKE_AT": "14"}, f"trainer.stop_at_step={stop_at}")
    assert [(r["step"], r["loss"], r.get("rollback")) for r in resumed] == \
        [(r["step"], r["loss"], r.get("rollback")) for r in rolled]


def test_without_a_checkpoint_before_the_spike_its_update_is_skipped_and_rollback_needs_checkpoints(small_shards,
                                                                                                     tmp_path):
    cfg = make_cfg(small_shards, tmp_path / "r", *ROLLBACK, "trainer.save_every=8", world_size=1)  # first: step 6
    assert train(cfg, {"ROFORMER_INJECT_SPIKE_AT": "5"}) == [EXIT_DONE]
    recs = records(tmp_path / "r")
    assert [r["step"] for r in recs if r.get("spike")] == [5] and len(recs) == 18
    assert "step 5: no rollback (no checkpoint before it): the spike's update is skipped instead" in \
        (tmp_path / "r" / "logs" / "rank0.log").read_text()
    with pytest.raises(ConfigError, match="trainer.spike: rollback reloads the newest checkpoint.*save_every is 0"):
        load_config(overrides=["trainer.spike=rollback", "trainer.save_every=0"])
