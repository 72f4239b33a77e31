"""A rank's logging: its own file under ``run_dir/logs/`` and the console (rank 0 at the configured
level, the others warnings only)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from roformer_dist.errors import StorageError

__all__ = ["setup_logging"]


class _FileHandler(logging.FileHandler):
    """A rank's log file that, when it cannot be written (disk full), says so once on stderr and goes
    quiet, instead of printing a traceback for every record."""

    failed = False

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            e = sys.exc_info()[1]
            print(f"roformer-train: cannot write the log file {self.baseFilename} ({e}); logging to it stops",
                  file=sys.stderr, flush=True)


def setup_logging(logs: Path, level: str, rank: int) -> None:
    """This process's log: ``logs/rank<rank>.log`` at ``level`` (``logging.level``), and the console (rank 0 at
    ``level``, the other ranks' warnings)."""
    try:
        logs.mkdir(parents=True, exist_ok=True)
        fh = _FileHandler(logs / f"rank{rank}.log")
    except OSError as e:
        raise StorageError.from_os_error(e, "opening the rank log") from None
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    fh.setFormatter(fmt)
    sh = logging.StreamHandler(sys.stdout)
    sh.setFormatter(fmt)
    sh.setLevel(level.upper() if rank == 0 else logging.WARNING)
    root.addHandler(fh)
    root.addHandler(sh)
    root.setLevel(level.upper())
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "compilers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
