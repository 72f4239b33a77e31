"""Hang detection: each rank's progress (:class:`Heartbeat`) and a watchdog that ends a launch making none.

A rank moves its heartbeat at known points (a step's start and end, an eval batch, a save's start and end, a
stage switch). Its watchdog thread sees when the rank has made no progress for ``dist.hang_timeout_s`` (for a
stage's switch and first step, which measure the rotary kernel and compile, ``dist.first_step_timeout_s``): the
rank is hung itself (deadlocked, stuck in I/O) or, far more often, waits in a collective for a peer that is
(stopped, frozen, deadlocked, gone without a socket error). Either way nothing will move before the
collective timeout (``dist.timeout_s``, 30 minutes), so the watchdog ends the launch now:

1. it dumps this rank's Python stacks (every thread, ``faulthandler``) to ``<run_dir>/hang/rank<r>.stack``;
2. the first rank to get there writes ``<run_dir>/hang/report.txt``: every rank's last point, step and age
   from their heartbeat files (``<run_dir>/hang/rank<r>.json``, rewritten at most once a second), the rank
   furthest behind first, and which stacks were dumped (a rank that dumped none was stopped or is stuck
   outside Python);
3. it calls the launch's ``on_hang`` (under SLURM: requeue the job) and exits with :data:`EXIT_HANG`.

Nothing is lost beyond the steps since the newest checkpoint: the next launch resumes from it. The watchdog
runs in a thread of its own, so it works while the main thread is blocked in a collective (the collectives
release the GIL).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from roformer_dist.errors import EXIT_HANG

__all__ = ["Heartbeat", "EXIT_HANG", "REPORT", "hang_report"]

log = logging.getLogger(__name__)

REPORT = "report.txt"
WRITE_EVERY_S = 1.0
"""A heartbeat file is rewritten at most this often (the in-memory heartbeat moves at every point)."""
_RECORD_BYTES = 512


class Heartbeat:
    """One rank's progress and its watchdog. ``beat(point, step)`` is cheap (a file write at most once a second);
    ``start()`` arms the watchdog, ``stop()`` disarms it (the end of the loop, a phase with no heartbeat)."""

    def __init__(self, directory: Path, rank: int, world_size: int, timeout_s: float,
                 on_hang: Callable[[], None] = lambda: None):
        self.dir, self.rank, self.world_size, self.timeout_s = Path(directory), rank, world_size, timeout_s
        self.on_hang = on_hang
        self.dir.mkdir(parents=True, exist_ok=True)
        _set_aside(self.dir / f"rank{rank}.stack")  # an earlier launch's
        if rank == 0:
            _set_aside(self.dir / REPORT)
        self.path = self.dir / f"rank{rank}.json"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        self.point, self.step = "start", 0
        self.limit_s, self.setting = timeout_s, "dist.hang_timeout_s"
        """How long the current point may take: ``timeout_s``, or a longer allowance given with the beat."""
        self._moved = self._written = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        self._armed = threading.Event()
        self._write()

    @classmethod
    def armed(cls, directory: Path, env, timeout_s: float, on_hang: Callable[[], None]) -> Optional["Heartbeat"]:
        """A started heartbeat of rank ``env.rank`` of ``env.world_size``; None when ``timeout_s`` is 0 (off)."""
        if timeout_s <= 0:
            return None
        heartbeat = cls(directory, env.rank, env.world_size, timeout_s, on_hang)
        heartbeat.start()
        return heartbeat

    # ------------------------------------------------------------------ the rank's side
    def beat(self, point: str, step: Optional[int] = None, allow_s: Optional[float] = None,
             setting: str = "") -> None:
        """Progress at ``point``. ``allow_s``: the work from here to the next beat may take this long (at least
        the timeout), named by ``setting`` in a report: a stage's switch and first step (the rotary measurement,
        compiling the stage)."""
        self.point = point
        self.limit_s, self.setting = ((max(self.timeout_s, allow_s), setting) if allow_s else
                                      (self.timeout_s, "dist.hang_timeout_s"))
        if step is not None:
            self.step = step
        self._moved = now = time.monotonic()
        if now - self._written >= WRITE_EVERY_S:
            self._write()

    def start(self) -> None:
        """Arm the watchdog (its thread starts on the first call)."""
        self.beat("watch")
        self._armed.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Disarm it; the thread stays, idle, until :meth:`start` or the process's end."""
        self._armed.clear()
        self._write()

    def _write(self) -> None:
        record = {"rank": self.rank, "point": self.point, "step": self.step, "time": time.time(),
                  "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME", ""), "pid": os.getpid()}
        try:
            os.pwrite(self._fd, json.dumps(record).encode().ljust(_RECORD_BYTES), 0)
            self._written = time.monotonic()
        except OSError:  # a full or read-only disk: the save path reports that; the heartbeat stays in memory
            pass

    # ------------------------------------------------------------------ the watchdog
    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while True:
            time.sleep(poll)
            if not self._armed.is_set():
                continue
            idle = time.monotonic() - self._moved
            if idle > self.limit_s:
                self._hung(idle)
                return

    def _hung(self, idle: float) -> None:
        self._write()
        stack = self.dir / f"rank{self.rank}.stack"
        try:
            with open(stack, "w", encoding="utf-8") as f:
                f.write(f"rank {self.rank} (pid {os.getpid()}), no progress for {idle:.0f} s, last at "
                        f"{self.point!r} after {self.step} step(s):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        time.sleep(min(2.0, self.timeout_s / 5))  # the other detecting ranks dump theirs meanwhile
        try:
            fd = os.open(self.dir / REPORT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        except FileExistsError:
            text = None  # another rank writes it
        except OSError:
            text = hang_report(self.dir, self.world_size, self.limit_s, self.setting)
        else:
            text = hang_report(self.dir, self.world_size, self.limit_s, self.setting)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        log.error("%s", text if text is not None else
                  f"no progress for {idle:.0f} s ({self.setting} {self.limit_s:g}): ending the launch; "
                  f"see {self.dir / REPORT}")
        for handler in logging.getLogger().handlers + logging.getLogger("roformer_dist").handlers:
            handler.flush()
        try:
            self.on_hang()
        finally:
            os._exit(EXIT_HANG)


def _set_aside(path: Path) -> None:
    """An earlier launch's file, renamed with its time (kept, out of this launch's way)."""
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(path.with_name(f"{path.stem}.{stamp}{path.suffix}"))
    except OSError:
        pass


def _node(rec: dict) -> str:
    """`` (SLURM node n1)`` where the rank ran on a SLURM node named otherwise than its host."""
    node = rec.get("node", "")
    return f" (SLURM node {node})" if node and node != rec["host"] else ""


def hang_report(directory: Path, world_size: int, timeout_s: float, setting: str = "dist.hang_timeout_s") -> str:
    """The report of a hang from the ranks' heartbeat and stack files in ``directory``; ``timeout_s``: the limit
    that passed, ``setting`` its name."""
    now = time.time()
    rows = []
    for r in range(world_size):
        try:
            rec = json.loads((Path(directory) / f"rank{r}.json").read_bytes().strip())
        except (OSError, ValueError):
            rec = None
        rows.append((r, rec))
    rows.sort(key=lambda x: (x[1] is not None, x[1]["step"] if x[1] else 0, x[1]["time"] if x[1] else 0))
    lines = [f"hang: no progress for {timeout_s:g} s ({setting}); the launch ends with exit status "
             f"{EXIT_HANG} and the next one resumes from the newest checkpoint. Ranks, the one furthest behind first:"]
    for r, rec in rows:
        stack = Path(directory) / f"rank{r}.stack"
        where = ("no heartbeat file" if rec is None else
                 f"last at {rec['point']!r} after {rec['step']} step(s), {now - rec['time']:.0f} s ago, host "
                 f"{rec['host']}{_node(rec)} pid {rec['pid']}")
        dumped = (f"stack: {stack}" if stack.exists() else
                  "no stack dumped (the process is stopped, or stuck outside Python)")
        lines.append(f"  rank {r}: {where}; {dumped}")
    return "\n".join(lines) + "\n"
