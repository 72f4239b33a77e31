"""``metrics.jsonl``: one JSON line per optimizer step, the run's record (always on).

Its failures are ``StorageError`` s (exit 74): a run whose record cannot be written stops. Only
``log_record`` writes; scalars and text go to the other sinks."""

from __future__ import annotations

import json

from data_pipeline.atomic import atomic_write_text
from roformer_dist.errors import StorageError
from roformer_dist.runtime.rundir import RunDir



class JsonlSink:
    def __init__(self, ctx):
        self.path = RunDir(ctx.dir).metrics
        self._truncate(ctx.resume_step)

    def _truncate(self, resume_step: int) -> None:
        """Keep the lines of steps <= ``resume_step`` (a line cut by a crash goes too)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                if json.loads(line)["step"] <= resume_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        try:
            atomic_write_text(self.path, "".join(line + "\n" for line in keep))
        except OSError as e:
            raise StorageError.from_os_error(e, f"rewriting {self.path.name} for the resumed run") from None

    def log_record(self, record: dict) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            if not e.filename:
                e = OSError(e.errno, e.strerror, str(self.path))
            raise StorageError.from_os_error(e, f"recording step {record.get('step')}") from None

    def log_scalars(self, step: int, values: dict) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        pass

    def flush(self) -> None:
        pass  # every line is written (and the file closed) as it comes

    def close(self) -> None:
        pass

    @staticmethod
    def read(directory) -> dict[int, dict]:
        """step -> record, as written."""
        path = RunDir(directory).metrics
        return {r["step"]: r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}
