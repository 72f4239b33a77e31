"""The trainer's contracts without DeepSpeed: the loop's policies (when to log, save, eval, stop), the
loop itself on a fake runner, the step statistics' one all-reduce tensor, the checkpoint payload and
its versions, fault hooks, and the resume compatibility check. Every test runs in well under a second."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from roformer_dist.checkpoint.compat import differences
from roformer_dist.checkpoint.trainer_state import FORMAT_VERSION, TrainCounters, TrainerState
from roformer_dist.config import load_config, replace, to_dict
from roformer_dist.errors import EXIT_DONE, EXIT_NONFINITE, EXIT_REQUEUE, CheckpointError, DataError
from roformer_dist.loop.policies import LoopPolicy
from roformer_dist.parallel.runner import StepStats
from roformer_dist.runtime.faults import NO_FAULTS, Faults

DEBUG = Path(__file__).resolve().parent.parent / "configs" / "experiments" / "debug.yaml"


def cfg_with(*overrides):
    return load_config(DEBUG, ["data.shards=/nowhere", "model.vocab_size=100", *overrides])


def run_of(cfg):
    """A ResolvedRun of ``cfg`` for one rank without data (the loop's tests give the trainer fakes of it)."""
    from roformer_dist.config import stage_plans
    from roformer_dist.launch.resolved import ResolvedRun, Resume
    from roformer_dist.plan.mixture import MixturePlan
    from roformer_dist.runtime.rundir import RunDir

    return ResolvedRun(cfg, 1, "", {"main": {"tokenizer": {"sha256": "ab" * 32}}}, MixturePlan((), (), ()), stage_plans(cfg, 1), Resume(),
                       RunDir(cfg.run_dir))


# --------------------------------------------------------------------------- policies


def test_policy_schedule_over_the_debug_curriculum():
    # debug curriculum: stages of 6, 6, 6 steps
    p = LoopPolicy.from_config(cfg_with("trainer.save_every=4", "trainer.eval_every=5", "trainer.log_every=3"))
    assert p.total_steps == 18 and p.stage_ends == {6, 12, 18} and p.last_step == 18
    assert [s for s in range(1, 19) if p.save(s)] == [4, 6, 8, 12, 16, 18]
    assert [s for s in range(1, 19) if p.eval(s)] == [5, 6, 10, 12, 15, 18]
    assert [s for s in range(1, 19) if p.log(s)] == [3, 6, 9, 12, 15, 18]
    assert not p.done(17) and p.done(18)


def test_policy_stop_at_step_saves_there_and_ends_the_run():
    p = LoopPolicy.from_config(cfg_with("trainer.save_every=0", "trainer.stop_at_step=8"))
    assert p.last_step == 8
    assert [s for s in range(1, 19) if p.save(s)] == [6, 8, 12, 18]
    assert p.stop(8, stop_requested=False, consecutive_nonfinite=0).status == EXIT_DONE
    assert p.stop(7, stop_requested=False, consecutive_nonfinite=0) is None


def test_policy_stop_reasons_and_their_order():
    p = LoopPolicy.from_config(cfg_with("trainer.max_nonfinite_steps=2"))
    assert p.stop(3, stop_requested=True, consecutive_nonfinite=0).status == EXIT_REQUEUE
    # too many non-finite losses say what went wrong, even when a signal came too
    assert p.stop(3, stop_requested=True, consecutive_nonfinite=2).status == EXIT_NONFINITE
    # a signal at the last step: the run is done
    assert p.stop(18, stop_requested=True, consecutive_nonfinite=0).status == EXIT_DONE
    signal_stop = p.stop(3, stop_requested=True, consecutive_nonfinite=0)
    assert p.save_now(3, signal_stop) and not p.save_now(3, None)
    # an eval due at a stage end is skipped when stopping early, kept when the run is done
    assert not p.eval_now(6, signal_stop) and p.eval_now(6, None)
    assert p.eval_now(18, p.stop(18, stop_requested=False, consecutive_nonfinite=0))


# --------------------------------------------------------------------------- the loop on a fake runner


class FakeRunner:
    """The runner's interface: every step returns the statistics the test scripted."""

    reads_data = True
    dp_rank, dp_size, seed_offset = 0, 1, 0
    global_batch_size = 8
    accumulation_steps = 1

    def __init__(self, events, stop_at=(), nonfinite_at=()):
        from roformer_dist.parallel.runner import RankTimes

        self.events, self.stop_at, self.nonfinite_at = events, set(stop_at), set(nonfinite_at)
        self.step = 0
        self.times = RankTimes(torch.device("cpu"))

    def set_lr(self, lr):
        self.lr = lr

    def set_stage(self, stage, choose_kernel=None):
        self.events.append(("stage", stage.seq_len))

    def train_step(self, batches, stop=False, inject_nan=False, spike_above=None, inject_spike=1.0, delay_s=0.0):
        next(batches)
        self.step += 1
        self.events.append(("step", self.step))
        bad = self.step in self.nonfinite_at or inject_nan
        return StepStats(loss_sum=0.0 if bad else 2.0, num_micro_batches=1, num_correct=3.0, num_predicted=10,
                         num_tokens=100, num_samples=8, num_nonfinite=int(bad),
                         num_stop_requests=int(stop or self.step in self.stop_at))

    def read_stats(self, steps):
        self.events.append(("read", len(steps)))
        return list(steps)

    def grad_norm(self):
        return 1.0

    def loss_scale(self):
        return 1.0


class FakeLoader:
    def set_stage(self, seq_len, mbs, weights=None, mlm_probability=None):
        pass

    def __iter__(self):
        while True:
            yield {}

    def state_dict(self):
        return {}

    def close(self):
        pass


def loop(*overrides, stop_at=(), nonfinite_at=(), eval_fails_at=None, faults=NO_FAULTS, full=False):
    """Trainer.fit over the debug curriculum with a fake runner and loader, the real callbacks of the loop's
    decisions (spikes, evaluation, checkpointing: when to evaluate and save) and fakes of what they write;
    returns (status, events, trainer)."""
    from roformer_dist.loop.callback import Callback, Callbacks
    from roformer_dist.loop.callbacks import BuildContext, faults as faulting, spikes
    from roformer_dist.loop.callbacks.checkpointing import Checkpointing
    from roformer_dist.loop.callbacks.evaluation import Evaluation
    from roformer_dist.loop.trainer import Trainer
    from roformer_dist.runtime.process_group import DistEnv, TorchComm

    events = []

    class Records(Callback):
        def step_read(self, tr, done):
            done.scalars = {} if tr.policy.log(done.step) else None

        def step_recorded(self, tr, done):
            events.append(("record", done.step))
            if done.scalars is not None:
                events.append(("log", done.step))

    class Saves(Checkpointing):
        def save(self, tr, payload):
            events.append(("save", tr.state.step))

    class Evals(Evaluation):
        def evaluate(self, tr):
            events.append(("eval", tr.state.step))
            if tr.state.step == eval_fails_at:
                from data_pipeline.shards import CorruptShardError

                raise CorruptShardError("shard-000001.tar: sha256 mismatch")
            return {}

    run, env = run_of(cfg_with("trainer.log_every=100", *overrides)), DistEnv(0, 1, 0)
    ctx = BuildContext(run, env, TorchComm(), lambda *_: 0.0, faults)
    table = {"faults": faulting.build(ctx), "records": Records(), "spikes": spikes.build(ctx), "evaluation": Evals(ctx),
             "checkpointing": Saves(ctx)}
    t = Trainer(run, env, FakeRunner(events, stop_at, nonfinite_at), FakeLoader(),
                Callbacks({k: v for k, v in table.items() if v is not None}))
    try:
        status = t.fit()
    except DataError as e:
        status = e
    return status, events if full else [e for e in events if e[0] in ("step", "save", "eval", "stage")], t


def test_loop_order_is_step_record_eval_save():
    status, events, t = loop("trainer.save_every=4", "trainer.eval_every=0")
    assert status == EXIT_DONE and t.state.step == 18
    assert events[:9] == [("stage", 128), ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("save", 4),
                          ("step", 5), ("step", 6), ("eval", 6)]
    # the eval comes before the save: a checkpoint of step 6 exists only once step 6's eval is recorded
    assert events[9] == ("save", 6) and events[10] == ("stage", 256)
    assert [e for e in events if e[0] == "save"] == [("save", s) for s in (4, 6, 8, 12, 16, 18)]
    assert [e for e in events if e[0] == "eval"] == [("eval", s) for s in (6, 12, 18)]
    assert t.state.tokens_seen == 1800 and t.state.samples_seen == 144


def test_loop_signal_saves_skips_the_eval_and_requeues():
    status, events, t = loop("trainer.save_every=0", stop_at={6})
    assert status == EXIT_REQUEUE
    assert events[-2:] == [("step", 6), ("save", 6)]  # no eval at this stage end: stopping
    assert ("eval", 6) not in events and t.callbacks.get("evaluation").due  # the checkpoint says so: the next launch runs it first


def test_loop_signal_mid_stage_saves_that_step():
    status, events, _ = loop("trainer.save_every=4", stop_at={9})
    assert status == EXIT_REQUEUE and events[-2:] == [("step", 9), ("save", 9)]


def test_loop_nonfinite_losses_stop_with_a_save():
    status, events, t = loop("trainer.max_nonfinite_steps=2", "trainer.log_every=1", nonfinite_at={3, 4})
    assert status == EXIT_NONFINITE and events[-2:] == [("step", 4), ("save", 4)]
    assert t.state.nonfinite_total == 2 and t.last_good == 2


def test_loop_nonfinite_losses_are_counted_where_the_steps_are_read():
    """Losses are read at log, save and stop steps only (a read waits for the device): a run of non-finite
    steps is judged at the read, by the run that ends the steps read."""
    status, events, t = loop("trainer.max_nonfinite_steps=2", nonfinite_at={3, 4, 5, 6})
    assert status == EXIT_NONFINITE and events[-2:] == [("step", 6), ("save", 6)]  # read at the stage end
    assert t.state.nonfinite_total == 4 and t.last_good == 2
    status, events, t = loop("trainer.max_nonfinite_steps=2", nonfinite_at={3, 4})  # step 5 recovered
    assert status == EXIT_DONE and t.state.nonfinite_total == 2 and t.state.consecutive_nonfinite == 0


def test_loop_reads_the_device_statistics_only_at_log_save_and_stop_steps():
    _, events, _ = loop("trainer.log_every=3", "trainer.save_every=0", "trainer.eval_every=0",
                        "trainer.stop_at_step=9", full=True)
    reads = [(prev[1], e[1]) for prev, e in zip(events, events[1:]) if e[0] == "read"]
    # log steps 3, 6 (also the stage end) and 9 (the last step): each reads the steps since the last read
    assert reads == [(3, 3), (6, 3), (9, 3)]


def test_loop_failing_eval_saves_its_step_first():
    status, events, _ = loop("trainer.save_every=0", eval_fails_at=6)
    assert isinstance(status, DataError)
    assert "eval at step 6 (the checkpoint of this step is saved)" in str(status) and "shard-000001.tar" in str(status)
    assert events[-2:] == [("eval", 6), ("save", 6)]
    status, events, _ = loop("trainer.save_every=0", "trainer.eval_every=4", eval_fails_at=4)  # no save due at 4
    assert isinstance(status, DataError) and "is saved" not in str(status) and events[-1] == ("eval", 4)


def test_loop_injected_nan_comes_through_the_fault_hook():
    status, _, t = loop("trainer.stop_at_step=5", faults=Faults(nan_at_steps=frozenset({3})))
    assert status == EXIT_DONE and t.state.nonfinite_total == 1 and t.state.consecutive_nonfinite == 0


def test_loop_nothing_to_do_when_already_at_the_end():
    from roformer_dist.loop.callback import Callbacks
    from roformer_dist.loop.trainer import Trainer
    from roformer_dist.runtime.process_group import DistEnv

    t = Trainer(run_of(cfg_with("trainer.stop_at_step=4")), DistEnv(0, 1, 0), FakeRunner([]), FakeLoader(),
                Callbacks({}))
    t.state.step = 4
    assert t.fit() == EXIT_DONE


# --------------------------------------------------------------------------- step statistics


def test_step_stats_tensor_round_trip_and_sum_over_ranks():
    a = StepStats(loss_sum=3.5, num_micro_batches=2, num_correct=4.0, num_predicted=10, num_tokens=500,
                  num_samples=8, num_nonfinite=0, num_stop_requests=1)
    b = StepStats(loss_sum=1.5, num_micro_batches=2, num_correct=1.0, num_predicted=10, num_tokens=300,
                  num_samples=8)
    assert StepStats.from_tensor(a.to_tensor()) == a
    total = StepStats.from_tensor(a.to_tensor() + b.to_tensor())  # what all_reduce(SUM) does
    assert total.loss == pytest.approx(5.0 / 4) and total.mlm_acc == pytest.approx(0.25)
    assert total.num_tokens == 800 and total.num_samples == 16 and total.stop and not total.nonfinite


def test_step_stats_nonfinite_and_reporting_share():
    s = StepStats()
    s.add_micro_batch(float("nan"), 1.0, 5)
    s.add_micro_batch(2.0, 1.0, 5)
    assert s.nonfinite and math.isnan(s.loss) and s.loss_sum == 2.0 and s.num_micro_batches == 2
    s.num_tokens, s.num_stop_requests = 70, 1
    data_only = s.keep_only(loss=False, data=True)
    assert (data_only.loss_sum, data_only.num_predicted, data_only.num_nonfinite) == (0.0, 0, 0)
    assert data_only.num_tokens == 70 and data_only.num_stop_requests == 1  # a stop request always counts
    assert s.keep_only(loss=True, data=False).num_tokens == 0


# --------------------------------------------------------------------------- payload and faults


def _payload_dict(**changes):
    cfg = cfg_with()
    d = {"format": FORMAT_VERSION, "trainer": TrainCounters(step=7, tokens_seen=10).state_dict(),
         "loader": {"format": 1}, "rng": {"torch": torch.get_rng_state()}, "world_size": 2, "rank": 1,
         "config": to_dict(cfg), "tokenizer_sha256": "ab" * 32, "stage_index": 1}
    d.update(changes)
    return d


def test_trainer_state_round_trip_through_torch_save(tmp_path):
    state = TrainerState.from_dict(_payload_dict())
    torch.save(state.to_dict(), tmp_path / "s.pt")
    back = TrainerState.from_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert back.step == 7 and back.trainer == state.trainer and back.rank == 1 and back.stage_index == 1


def test_trainer_state_without_its_format_is_refused_naming_it():
    old = _payload_dict()
    del old["format"]
    with pytest.raises(CheckpointError, match="payload format None is not the one this version reads"):
        TrainerState.from_dict(old, where="x/trainer_state_rank0.pt")


@pytest.mark.parametrize("change, message", [
    ({"format": 99}, "format 99"),
    ({"trainer": {"step": 1}}, "field 'trainer'"),
    ({"world_size": "two"}, "field 'world_size': expected int"),
    ({"loader": None}, "field 'loader'"),
    ({"source_tokens_logged": [1]}, "field 'source_tokens_logged'"),
    ({"source_tokens_logged": {"news": "many"}}, "field 'source_tokens_logged'"),
    ({"eval_due": 1}, "field 'eval_due': expected bool"),
])
def test_trainer_state_damage_is_a_checkpoint_error(change, message):
    with pytest.raises(CheckpointError, match=message):
        TrainerState.from_dict(_payload_dict(**change), where="x/trainer_state_rank0.pt")
    with pytest.raises(CheckpointError, match="expected a mapping"):
        TrainerState.from_dict([1, 2])


def test_faults_come_from_the_environment_once():
    f = Faults.from_environ({"ROFORMER_INJECT_NAN_AT": "3, 4", "ROFORMER_STEP_DELAY_S": "0.25"})
    assert f.nan_at(3) and f.nan_at(4) and not f.nan_at(5) and f.step_delay_s == 0.25
    assert Faults.from_environ({}) == NO_FAULTS


# --------------------------------------------------------------------------- resume compatibility


def test_differences_list_model_keys_shapes_and_layout_in_one_go():
    saved = cfg_with()
    now = replace(saved, **{"model.hidden_size": 96, "model.intermediate_size": 192, "parallel.tensor": 2,
                            "model.hidden_dropout_prob": 0.2})
    diffs = differences(to_dict(saved), 2, now, 2, "a" * 64, "b" * 64, 8, 8)
    text = "\n".join(diffs)
    assert "model.hidden_size: 64 in the checkpoint, 96 now" in text
    assert "model.intermediate_size: 128 in the checkpoint, 192 now" in text
    assert "parameter embeddings.word_embeddings.weight: [100, 64] in the checkpoint, [100, 96] now" in text
    assert "parallel: tensor 1 x pipeline 1 in the checkpoint, tensor 2 x pipeline 1 now" in text
    assert "tokenizer: sha256 aaaaaaaaaaaa" in text
    assert "hidden_dropout_prob" not in text  # dropout may change on resume


def test_differences_in_the_zero_stage_follow_the_file_formats():
    saved = cfg_with("deepspeed.zero_stage=2")
    assert differences(to_dict(saved), 2, replace(saved, **{"deepspeed.zero_stage": 1}), 2) == []
    (line,) = differences(to_dict(saved), 2, replace(saved, **{"deepspeed.zero_stage": 3}), 2)
    assert line.startswith("deepspeed.zero_stage: 2 in the checkpoint, 3 now")


def test_differences_allow_another_world_size_and_curriculum():
    saved = cfg_with()
    now = replace(saved, **{"trainer.save_every": 7, "optim.lr": 1e-4})
    assert differences(to_dict(saved), 2, now, 1, "a", "a", 8, 8) == []
    assert "8 shards" in differences(to_dict(saved), 2, now, 2, "", "", 8, 9)[0]
