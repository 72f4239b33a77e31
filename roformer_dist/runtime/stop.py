"""Stop requests and process lifetime: signals only set a flag; ranks agree at a step boundary.

SLURM sends SIGUSR2 before the time limit (and on preemption with ``preempt_send_user_signal``);
schedulers, ``timeout`` and ``kill`` send SIGTERM; Ctrl-C sends SIGINT to the whole process group.
Each is a *stop request*: :class:`StopFlag` records it and nothing else happens inside the signal
handler. The trainer passes the flag into every step's statistics; the one all-reduce of a step
(``StepStats``) makes every rank see the request of any rank, so all ranks save the same step
together and exit with ``EXIT_REQUEUE``.

A second SIGINT (Ctrl-C pressed again) aborts at once: the process kills its own children (DataLoader
workers, or the ranks in the launcher), runs the registered abort callbacks (releasing the run lock)
and exits ``EXIT_ABORTED`` without saving; the newest complete checkpoint stays ``latest``.

Handlers are installed once, where the process starts (``roformer-train``'s ``main``, also under
torchrun and srun; the rank entry of its spawner; ``run_rank`` when its caller installed none, as the
submitit job of ``roformer-submit``). :func:`blocked_stop_signals` lets the spawner
start children whose stop signals stay pending until their own handlers are in place, so that a
Ctrl-C during start-up neither kills a half-started rank nor prints a ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn, Optional

from roformer_dist.errors import EXIT_ABORTED, EXIT_DONE, EXIT_NONFINITE, EXIT_REQUEUE

__all__ = ["StopFlag", "adopt_orphans", "blocked_stop_signals", "children", "die_with_parent", "exit_now", "kill_tree", "EXIT_DONE", "EXIT_REQUEUE", "EXIT_NONFINITE",
           "EXIT_ABORTED", "STOP_SIGNALS"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class StopFlag:
    """The stop request of this process. ``StopFlag()`` alone is inert (nothing installed): a trainer
    built in a test or a notebook never sees a signal; ``StopFlag.install()`` handles the signals."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        """The first stop signal received, None while none was."""
        self.num_interrupts = 0
        """SIGINTs received; the second one aborts."""
        self._previous: dict[int, object] = {}
        self._forward: Optional[Callable[[int], None]] = None
        self._on_abort: list[Callable[[], None]] = []
        self._quiet_abort = False

    @classmethod
    def install(cls, forward: Optional[Callable[[int], None]] = None, quiet_abort: bool = False) -> "StopFlag":
        """Handle SIGTERM, SIGINT and SIGUSR2 in this process from now on (main thread only).

        ``forward(signum)`` is called for every stop signal (the launcher passes it on to its
        ranks). Signals blocked by :func:`blocked_stop_signals` in the parent are unblocked here, so
        one that arrived during start-up is handled now. ``quiet_abort``: a second Ctrl-C exits
        without a message (the ranks of a launcher, which prints it once)."""
        flag = cls()
        flag._forward = forward
        flag._quiet_abort = quiet_abort
        for s in STOP_SIGNALS:
            flag._previous[s] = signal.signal(s, flag._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return flag

    def forward_to(self, forward: Optional[Callable[[int], None]]) -> None:
        """Call ``forward(signum)`` for every stop signal from now on (the launcher's ranks)."""
        self._forward = forward

    def on_abort(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (no arguments, must not block) before an abort exits the process."""
        self._on_abort.append(callback)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if signum == signal.SIGINT:
            self.num_interrupts += 1
            if self.num_interrupts >= 2:
                self.abort()
        if self.signum is None:
            self.signum = signum
        if self._forward is not None:
            self._forward(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"

    def abort(self) -> None:
        """Kill this process's children, run the abort callbacks and exit 130 at once (no saving)."""
        if not self._quiet_abort:
            print("roformer-train: interrupted twice: aborting without saving (the newest complete checkpoint "
                  "stays latest)", file=sys.stderr, flush=True)
        for child in multiprocessing.active_children():
            kill_tree(child.pid)
        for callback in self._on_abort:
            with contextlib.suppress(Exception):
                callback()
        os._exit(EXIT_ABORTED)

    def restore(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def ignore_late_stop_signals() -> None:
    """For a process whose run is complete: ignore SIGUSR2 and SIGTERM until it exits.

    A time limit or preemption that comes after the last save has nothing left to save. Without this, a
    signal that arrives while the process tears down (Python puts the default action back for its own
    handlers at exit; torch and gloo take a moment to close) kills it, and SLURM records a finished job
    as FAILED."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in task.read_text().split()]
    return out


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it (a rank and its DataLoader workers), so that an abort
    leaves no process behind for the workers' own parent watchdog to notice seconds later."""
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` at once: its children (DataLoader workers, whose work is done) are
    killed, logs and output flushed, and the interpreter's teardown is skipped (a full garbage
    collection of torch and DeepSpeed's objects: seconds on a busy machine, during which the launcher
    and a SLURM requeue wait)."""
    from multiprocessing import util

    for child in multiprocessing.active_children():
        kill_tree(child.pid)
    # multiprocessing's own exit clean-up (named semaphores unregistered from the resource tracker, which
    # would otherwise warn of leaks); the rest of the teardown is what we skip
    with contextlib.suppress(Exception):
        util._run_finalizers(0)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def blocked_stop_signals():
    """Block SIGTERM/SIGINT/SIGUSR2 in this thread while child processes are started.

    Children inherit the mask: their stop signals stay pending until ``StopFlag.install`` unblocks
    them. The multiprocessing resource tracker is started first, inside the block: it keeps SIGUSR2
    blocked for good (it ignores SIGINT and SIGTERM itself), so a USR2 sent to the process group does
    not kill it."""
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # ensure_running unblocks SIGINT/SIGTERM
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: "int | bytes") -> bool:
    """Linux ``prctl(option, arg)`` (bytes: a pointer to them); False where it is not available or refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except OSError:
        return False


_PR_GET_CHILD_SUBREAPER = 37


def adopt_orphans(adopt: bool = True) -> bool:
    """Make this process the parent of its descendants' orphans (Linux ``PR_SET_CHILD_SUBREAPER``), so a
    launcher can end what a killed rank's own children (torch's ninja and compilers during a JIT build)
    would otherwise go on running after the launch; ``adopt=False``: no longer (a launch made in a process
    that goes on, a test's). Returns whether this process adopted orphans before the call (False where it is not
    available)."""
    if not sys.platform.startswith("linux"):
        return False
    was = ctypes.c_int(0)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    except OSError:
        return False
    _prctl(_PR_SET_CHILD_SUBREAPER, int(adopt))
    return bool(was.value)


def name_process(name: str) -> None:
    """Name this process (Linux ``comm``, 15 bytes at most): what ``ps -o comm`` and ``top`` show."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """End this process when ``parent_pid`` (its launcher) dies, so no rank trains on as an orphan.

    Linux: ``prctl(PR_SET_PDEATHSIG)``; elsewhere a daemon thread polls the parent pid once a second.
    Either way, a parent that died before this call is noticed at once."""
    armed = _prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:
        os._exit(1)  # the launcher is already gone
    if armed:
        return

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), sig)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
