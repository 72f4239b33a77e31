"""Metrics and sinks: each step's line in ``metrics.jsonl``, and at log steps the scalars, the corpus mixture's
shares and the console line.

perf/* cover the steps since the last log step: on a GPU the host runs ahead of the device, so one step's host
time says little, while the window (its steps' host times and the wait for the device at the read) is the real
rate. Everything recorded up to a checkpoint's step is flushed before the checkpoint commits
(``before_commit``); a rollback reopens the sinks at its checkpoint's step, as a resume does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from roformer_dist.config import dump_yaml
from roformer_dist.loop.callback import Callback, StepDone
from roformer_dist.observe.metrics import MetricsWriter, matmul_precision, max_mem_gb, peak_flops

if TYPE_CHECKING:
    from roformer_dist.checkpoint.trainer_state import TrainerState
    from roformer_dist.loop.callbacks import BuildContext
    from roformer_dist.loop.trainer import Trainer

__all__ = ["Recording"]

log = logging.getLogger("roformer_dist.trainer")


class Recording(Callback):
    def __init__(self, ctx: "BuildContext"):
        self.run, self.rank = ctx.run, ctx.env.rank
        self.flops_per_token = ctx.flops_per_token
        self.peak_flops = peak_flops(matmul_precision(ctx.run.cfg.deepspeed.precision))
        """Dense peak FLOP/s of this GPU at the run's matmul precision; None: no MFU (said once in the log)."""
        self.metrics: Optional[MetricsWriter] = None
        self.window = [0, 0, 0.0]
        """Tokens, samples and seconds of the steps since the last log step (perf/*)."""
        self.logged_step = 0
        """The step the window starts after."""
        self.source_tokens_logged: Optional[dict] = None
        """Per source, the tokens the whole job had drawn at the last log step."""

    def open(self, tr: "Trainer", resumed: bool) -> None:
        """The sinks, at the counters' step (after a resume: its events after that step are dropped)."""
        cfg = self.run.cfg
        self.metrics = MetricsWriter(self.run.run_dir.root, self.rank, tr.state.step, self.run.sinks, cfg.logging)
        if self.rank == 0 and not resumed:
            self.metrics.text("config", "```\n" + dump_yaml(cfg) + "\n```")
            self.metrics.text("mixture", "```\n" + self.run.mixture.table() + "\n```")

    def run_start(self, tr: "Trainer") -> None:
        self.open(tr, resumed=tr.resumed_dir is not None)
        self.logged_step = tr.state.step

    def post_step(self, tr: "Trainer", done: StepDone) -> None:
        w = self.window
        w[0], w[1], w[2] = w[0] + done.stats.num_tokens, w[1] + done.stats.num_samples, w[2] + done.dt

    def step_read(self, tr: "Trainer", done: StepDone) -> None:
        """The step's record; at a log step also its scalars (the mixture's: one small all-reduce)."""
        self.window[2] += done.waited_s
        st, stats, runner = done.at.stage, done.stats, tr.runner
        # time: when the host finished the step (Unix seconds); step_time_s: the runner's share of the host's
        # time for the step (data + launching the compute + communication), so that the loop's own cost is
        # time[i] - time[i - 1] - step_time_s[i]
        done.record = {"step": done.step, "loss": None if stats.nonfinite else stats.loss, "mlm_acc": stats.mlm_acc,
                       "lr": done.lr, "seq_len": st.seq_len, "stage": st.name, "samples": stats.num_samples,
                       "global_batch": runner.global_batch_size, "accumulation": runner.accumulation_steps,
                       "tokens_seen": done.tokens_seen, "skipped": stats.skipped, "time": round(done.ended, 4),
                       "step_time_s": round(done.dt, 5), **({"spike": True} if stats.num_spikes else {}),
                       **done.notes}
        if not tr.policy.log(done.step):
            return
        plan = self.run.mixture
        mixture = self._mixture_scalars(tr) if plan and len(plan.sources) > 1 else {}
        if mixture:
            done.record["sources"] = {name: {"tokens": int(mixture[f"data/{name}/tokens"]),
                                             "share": mixture[f"data/{name}/share"]}
                                      for name in tr.loader.stats["sources"]}
        done.scalars = {"train/loss": done.record["loss"], "train/mlm_acc": stats.mlm_acc, "train/lr": done.lr,
                        "train/seq_len": st.seq_len, "train/stage": done.at.index,
                        "train/grad_norm": runner.grad_norm(), "train/loss_scale": runner.loss_scale(),
                        "perf/max_mem_gb": max_mem_gb(), **mixture}

    def step_recorded(self, tr: "Trainer", done: StepDone) -> None:
        self.metrics.step_record(done.record)
        if done.scalars is None:
            return
        tokens, samples, seconds = self.window
        steps = max(1, done.step - self.logged_step)
        self.window, self.logged_step = [0, 0, 0.0], done.step
        toks_per_s = tokens / seconds if seconds > 0 else 0.0
        step_time = seconds / steps
        perf = {"perf/tokens_per_s": toks_per_s, "perf/samples_per_s": samples / seconds if seconds > 0 else 0.0,
                "perf/step_time_s": step_time}
        st = done.at.stage
        if self.peak_flops:
            fpt = self.flops_per_token(st.seq_len, self.run.stages[done.at.index].mlm_probability)
            perf["perf/mfu"] = toks_per_s * fpt / (self.peak_flops * tr.env.world_size)
        self.metrics.scalars(done.step, {**done.scalars, **perf})
        if self.rank == 0:
            stats = done.stats
            shown = "nan (skipped)" if stats.nonfinite else \
                f"{stats.loss:.4f}" + (" (spike, skipped)" if stats.skipped else "")
            log.info("step %d/%d [%s len %d] loss %s acc %.3f lr %.2e %.0f tok/s %.2f s/step", done.step,
                     tr.policy.total_steps, st.name, st.seq_len, shown, stats.mlm_acc, done.lr, toks_per_s, step_time)

    def _mixture_scalars(self, tr: "Trainer") -> dict:
        """Per source: tokens drawn so far by the whole job, and its share of the tokens since the last
        log step beside its target (``data/<name>/tokens|share|target``). Every rank takes part (one
        small all-reduce); each data-parallel replica's batches count once."""
        names = list(tr.loader.stats["sources"])
        counts = tr.runner.reads_data and tr.runner.dims.tp_rank == 0
        mine = torch.tensor([float(tr.loader.stats["sources"][n]["tokens"]) if counts else 0.0 for n in names],
                            dtype=torch.float64)
        tr.comm.sum_on(mine, tr.engine.device)
        totals = dict(zip(names, mine.tolist()))
        before, self.source_tokens_logged = self.source_tokens_logged or {}, totals
        return self.run.mixture.window_scalars(totals, before, tr.stage_index)

    def scalars(self, tr: "Trainer", step: int, values: dict) -> None:
        self.metrics.scalars(step, values)

    def flush(self, tr: "Trainer") -> None:
        self.metrics.flush()

    def before_commit(self, tr: "Trainer", stall_s: float) -> None:
        # Everything recorded up to this step is on disk before the checkpoint can count: a resume from it purges
        # only later events, so no step's events are lost.
        self.metrics.scalars(tr.state.step, {"perf/checkpoint_stall_s": stall_s})
        self.metrics.flush()

    def rewound(self, tr: "Trainer", step: int, note: dict) -> None:
        self.metrics.close()  # every sink drops the steps after the checkpoint, as on a resume
        self.open(tr, resumed=True)
        self.window, self.logged_step = [0, 0, 0.0], step

    def state_dict(self) -> dict:
        return {"source_tokens_logged": self.source_tokens_logged or {}}

    def load_state_dict(self, state: "TrainerState") -> None:
        self.source_tokens_logged = state.source_tokens_logged or None

    def close(self, tr: "Trainer") -> None:
        if self.metrics is not None:
            self.metrics.close()


def build(ctx: "BuildContext") -> Recording:
    return Recording(ctx)
