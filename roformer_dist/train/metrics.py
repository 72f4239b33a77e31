"""Rank 0's view of a run: TensorBoard scalars, ``metrics.jsonl`` and console lines.

``metrics.jsonl`` holds one JSON line per optimizer step (step, loss, seq_len,
stage, lr, ...). On resume both it and TensorBoard drop what came after the
checkpoint (``purge_step``), so a resumed run's curves equal an uninterrupted one's.
"""

from __future__ import annotations

import json
import logging
import os
import resource
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.atomic import atomic_write_text
from roformer_dist.errors import StorageError

log = logging.getLogger(__name__)


def max_mem_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_flops() -> Optional[float]:
    """bf16 dense peak of the current GPU, when known."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("V100", 125e12),
                        ("A10", 125e12), ("L4", 121e12)):
        if key in name:
            return tflops
    return None


class MetricsWriter:
    """No-op on ranks other than 0.

    ``metrics.jsonl`` is the record of the run: a failure to write it is a StorageError (exit 74).
    TensorBoard events are a view: a failure to write them (disk full) is logged once and the events
    stop, the run goes on until something that matters fails."""

    def __init__(self, run_dir: Path, rank: int, resume_step: int, tensorboard: bool = True):
        self.enabled = rank == 0
        self.tb = None
        self.jsonl_path = run_dir / "metrics.jsonl"
        if not self.enabled:
            return
        self._truncate_jsonl(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events of steps >= resume_step + 1 left by the interrupted run.
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def _truncate_jsonl(self, resume_step: int) -> None:
        if not self.jsonl_path.exists():
            return
        keep = []
        for line in self.jsonl_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                if json.loads(line)["step"] <= resume_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash
        try:
            atomic_write_text(self.jsonl_path, "".join(line + "\n" for line in keep))
        except OSError as e:
            raise StorageError.from_os_error(e, "rewriting metrics.jsonl for the resumed run") from None

    def step_record(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            if not e.filename:
                e = OSError(e.errno, e.strerror, str(self.jsonl_path))
            raise StorageError.from_os_error(e, f"recording step {record.get('step')}") from None

    def _tb_call(self, fn, *args) -> None:
        if self.tb is None:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the events are a view of metrics.jsonl; never fatal
            log.warning("TensorBoard events stop here: %s", e)
            self.tb = None

    def scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            if value is not None and self.tb is not None:
                self._tb_call(self.tb.add_scalar, tag, value, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.tb is not None:
            self._tb_call(self.tb.add_text, tag, text, step)

    def close(self) -> None:
        if self.tb is not None:
            self._tb_call(self.tb.close)
            self.tb = None

