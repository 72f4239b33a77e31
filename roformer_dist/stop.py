"""Stop requests: signals only set a flag; ranks agree at a step boundary.

SLURM sends SIGUSR2 before the time limit (and on preemption with
``preempt_send_user_signal``); schedulers and ``kill`` send SIGTERM. The handler
must not save from inside a signal: it records the request, and the trainer asks
``agree`` at the next step boundary (an all-reduce, so every rank stops at the
same step even if only one was signalled).
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_DONE = 0
EXIT_REQUEUE = 75  # EX_TEMPFAIL: saved because of a stop signal; run again to continue
EXIT_NONFINITE = 3  # too many consecutive NaN/inf losses; the last good state was saved


class StopFlag:
    def __init__(self, signals=(signal.SIGUSR2, signal.SIGTERM)):
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agree(self) -> bool:
        """True on every rank if any rank was signalled (collective)."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
