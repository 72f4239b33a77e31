"""TensorBoard event files under ``<dir>/tb``: scalars and text.

The events are a view of the run: a failure to write them (a full disk) is logged once and this sink
stops; the run goes on until something that matters fails."""

from __future__ import annotations

import logging

from roformer_dist.runtime.rundir import RunDir

log = logging.getLogger(__name__)



class TensorBoardSink:
    def __init__(self, ctx):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops the events of steps >= resume_step + 1 an interrupted launch left (all of them when
        # this one starts from scratch: a launch killed before its first checkpoint left events of no use)
        self.tb = SummaryWriter(str(RunDir(ctx.dir).tb), purge_step=ctx.resume_step + 1 if ctx.resume_step else 0)

    def _call(self, fn, *args) -> None:
        if self.tb is None:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the events are a view of metrics.jsonl; never fatal
            log.warning("TensorBoard events stop here: %s", e)
            self.tb = None

    def log_record(self, record: dict) -> None:
        pass

    def log_scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            if self.tb is None:
                return
            self._call(self.tb.add_scalar, tag, value, step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.tb is not None:
            self._call(self.tb.add_text, tag, text, step)

    def flush(self) -> None:
        if self.tb is not None:
            self._call(self.tb.flush)

    def close(self) -> None:
        if self.tb is not None:
            self._call(self.tb.close)
            self.tb = None

    @staticmethod
    def read(directory) -> dict[str, list[tuple[int, float]]]:
        """tag -> [(step, value)], as TensorBoard shows them."""
        from roformer_dist.runtime.events import read_scalars

        return read_scalars(RunDir(directory).tb)
