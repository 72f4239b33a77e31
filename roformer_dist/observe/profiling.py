"""A ``torch.profiler`` window over a few optimizer steps of rank 0 (``trainer.profile``).

``trainer.profile.start_step=N`` (1-based optimizer steps, 0 = off) and ``trainer.profile.steps=K`` trace
steps N .. N+K-1 and write, under ``<run_dir>/profile/``:

- ``trace_steps_N-M.pt.trace.json``: the Chrome trace (``export_chrome_trace``). Open it in
  https://ui.perfetto.dev or chrome://tracing. Its name follows ``tensorboard_trace_handler``'s
  ``<worker>.pt.trace.json`` convention, so the TensorBoard profiler plugin (``torch-tb-profiler``, not a
  dependency) also finds it: ``tensorboard --logdir <run_dir>/profile``.
- ``key_averages_steps_N-M.txt``: the top operators by self CPU time (and by self CUDA time on a GPU).
- ``phases_steps_N-M.txt`` and ``.json``: where a step goes (``runtime/phases.py``): each phase's wall time
  (data, forward, backward, optimizer, other) and, on a GPU, the device time each launched, of which NCCL,
  the GPU's busy and idle time and the launches a step.

The loop calls :meth:`ProfileWindow.before_step` and :meth:`ProfileWindow.after_step` around each step and
:meth:`ProfileWindow.close` at the end, also when it ends early (a stop inside the window writes the steps
done). The window opens only at ``start_step`` itself: a run that starts (or resumes) after it, or ends
before it, traces nothing and says so once. Everything between the window's first and last step is in the
trace, the loop's logging, saving and evaluation of those steps included. The files are a view of the run:
failing to write them is a warning, never fatal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from roformer_dist.runtime.phases import format_step_table, read_trace, step_table
from roformer_dist.runtime.rundir import RunDir

if TYPE_CHECKING:
    from roformer_dist.config import ProfileConfig

__all__ = ["ProfileWindow"]

log = logging.getLogger(__name__)

TOP_OPS = 40
"""Rows of each key_averages table."""


class ProfileWindow:
    """Profile steps [start_step, start_step + steps) on rank 0; inert elsewhere and with start_step 0.

    ``last_step``: the run's last step, when known: a window after it is reported at once rather than at
    :meth:`close`. ``record_shapes``, ``profile_memory``, ``with_stack``: as ``torch.profiler.profile``'s
    (stacks make the trace several times larger)."""

    def __init__(self, cfg: "ProfileConfig", run_dir: Path, rank: int, *, last_step: Optional[int] = None,
                 record_shapes: bool = True, profile_memory: bool = False, with_stack: bool = False):
        self.start = cfg.start_step
        self.end = cfg.start_step + cfg.steps - 1  # the last profiled step, inclusive
        self.dir = RunDir(run_dir).profile
        self.enabled = rank == 0 and cfg.start_step > 0
        self._options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self._prof: Optional[torch.profiler.profile] = None
        self._marker: Optional[torch.profiler.record_function] = None
        self._last_done: Optional[int] = None
        self._first_seen: Optional[int] = None
        if self.enabled and last_step is not None and self.start > last_step:
            self._skip(f"the run ends at step {last_step}")

    @property
    def active(self) -> bool:
        return self._prof is not None

    def _skip(self, why: str) -> None:
        log.warning("profile window steps %d-%d not traced: %s", self.start, self.end, why)
        self.enabled = False

    def before_step(self, step: int) -> None:
        """``step``: the 1-based number of the optimizer step about to run."""
        if not self.enabled:
            return
        if self._first_seen is None:
            self._first_seen = step
            if step > self.start:
                self._skip(f"this run starts at step {step}, after the window's start")
                return
        if step == self.start and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, **self._options)
            self._prof.__enter__()
            log.info("profiling steps %d-%d", self.start, self.end)
        if self._prof is not None:
            self._marker = torch.profiler.record_function(f"optimizer_step_{step}")
            self._marker.__enter__()

    def after_step(self, step: int) -> None:
        """``step``: the number of the optimizer step just done (the same as its ``before_step``)."""
        if self._prof is None:
            return
        self._end_marker()
        self._last_done = step
        if step >= self.end:
            self._finish()

    def close(self) -> None:
        """End the window: write what was traced (a run stopped inside the window), or say that the window
        was never reached. Idempotent."""
        if self._prof is not None:
            self._end_marker()
            self._finish()
        elif self.enabled and self._first_seen is not None and self._last_done is None:
            self._skip("the run ended before it")
        self.enabled = False

    def _end_marker(self) -> None:
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        self.enabled = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        if self._last_done is None:
            log.warning("profile window: no step was completed; nothing written")
            return
        span = f"steps_{self.start}-{self._last_done}"
        if self._last_done < self.end:
            log.warning("profile window cut short: steps %d-%d of %d-%d traced", self.start, self._last_done,
                        self.start, self.end)
        trace = self.dir / f"trace_{span}.pt.trace.json"
        table = self.dir / f"key_averages_{span}.txt"
        phases = self.dir / f"phases_{span}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            table.write_text(self._tables(prof, span), encoding="utf-8")
            steps = step_table(read_trace(trace))
            if steps is not None:
                phases.with_suffix(".json").write_text(json.dumps(steps, indent=1) + "\n", encoding="utf-8")
                phases.with_suffix(".txt").write_text(format_step_table(steps), encoding="utf-8")
        except (OSError, ValueError) as e:  # a view of the run, like TensorBoard: the run goes on
            log.warning("profile of %s not written: %s", span, e)
            return
        log.info("profile of %s: %s (open it in https://ui.perfetto.dev or chrome://tracing; TensorBoard with "
                 "torch-tb-profiler: tensorboard --logdir %s); top operators: %s; where a step goes: %s",
                 span.replace("_", " "), trace, self.dir, table, phases.with_suffix(".txt"))

    @staticmethod
    def _tables(prof: torch.profiler.profile, span: str) -> str:
        averages = prof.key_averages()
        parts = [f"torch.profiler key averages, {span.replace('_', ' ')}, by self CPU time\n",
                 averages.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)]
        if torch.cuda.is_available():
            parts += ["\n\nby self CUDA time\n", averages.table(sort_by="self_device_time_total", row_limit=TOP_OPS)]
        return "".join(parts) + "\n"
