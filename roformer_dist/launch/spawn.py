"""Start a training job's ranks on this machine and wait for them (``roformer-train`` without torchrun).

:class:`LocalRanks` starts the ranks as soon as the launcher has read the config, before it resolves the run.
On Linux one process (``python -m roformer_dist.launch.spawn 0,1,...``) imports torch, dynamo and, on CPU,
DeepSpeed and the trainer once, forks one rank per rank and exits: the ranks are the launcher's children from
then on (it adopts orphans, ``PR_SET_CHILD_SUBREAPER``), each named ``roformer-rank<r>`` (``ps -o comm``).
Elsewhere each rank is a process of its own. While the launcher checks the data and the checkpoints, the ranks
finish their start-up and wait on stdin. :meth:`LocalRanks.run` hands them the resolved run, in a file written
before they read it (a launcher killed at any moment leaves no rank reading half its arguments), with the caller
holding the run lock; a launch refused while resolving ends its ranks unused (:meth:`LocalRanks.cancel`). gloo on
CPU, nccl on GPUs (nothing before the fork touches CUDA: ``launch/preload.py``). Stop signals reaching the
launcher go on to the ranks; the ranks die with it (SIGKILL included); a failing rank stops the others and its
status is the job's. Our errors' messages are printed once, not once per rank. The ranks are handed the run the
launcher resolved (:class:`~roformer_dist.launch.resolved.ResolvedRun`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from roformer_dist.errors import EXIT_BUG, EXIT_HANG, EXIT_REQUEUE, exit_status
from roformer_dist.runtime.heartbeat import REPORT
from roformer_dist.runtime.ports import free_port
from roformer_dist.runtime.stop import STOP_SIGNALS, StopFlag, adopt_orphans, blocked_stop_signals, children, \
    die_with_parent, exit_now, kill_tree, name_process

if TYPE_CHECKING:
    from roformer_dist.launch.resolved import ResolvedRun

__all__ = ["LocalRanks"]

PEER_LOSS_GRACE_S = 10.0
"""How long a rank whose collective failed because another rank died waits for the launcher to end it."""


def _rank_main(rank: int, world_size: int, port: int, launcher_pid: int, job_dir: str) -> None:
    """A rank started by :class:`LocalRanks` (the run in ``JOB_DIR/run.json``; this rank's exit status goes to
    ``JOB_DIR/status<rank>``, an error's message to ``JOB_DIR/rank<rank>``)."""
    die_with_parent(launcher_pid)
    with blocked_stop_signals():  # this rank's resource tracker (its DataLoader workers'): deaf to group signals
        pass
    stop = StopFlag.install(quiet_abort=True)  # the launcher says it once
    # while the launcher resolves the run: what every rank imports (imported already where the ranks were forked)
    import roformer_dist.launch.preload  # noqa: F401
    from roformer_dist.launch.entry import run_rank
    from roformer_dist.launch.resolved import ResolvedRun
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    from roformer_dist.runtime.process_group import peer_lost

    import_deepspeed()
    if os.read(0, len(GO)) != GO:  # (the ranks may share one stdin: each takes its own line, no more)
        exit_now(0)  # the launch was refused while resolving (or its launcher is gone): nothing was started
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        where = os.path.join(job_dir, RUN_FILE)
        run = ResolvedRun.from_json(json.loads(Path(where).read_text(encoding="utf-8")), where)
        code = run_rank(run, stop=stop)
        Path(job_dir, f"status{rank}").write_text(str(code), encoding="utf-8")
    except Exception as e:
        code = exit_status(e)
        if code is None and peer_lost(e):
            # another rank died: the launcher reports that and ends this rank; the traceback only if it does not
            time.sleep(PEER_LOSS_GRACE_S)
        if code is None:
            raise  # a bug: Python prints the traceback, the rank exits 1
        # the launcher prints each distinct message once (every rank may raise the same one)
        Path(job_dir, f"rank{rank}").write_text(f"{code}\n{e}", encoding="utf-8")
    exit_now(code)


def _fork_ranks(ranks: list[int], world_size: int, port: int, launcher_pid: int, job_dir: str) -> None:
    """``python -m roformer_dist.launch.spawn 0,1,... WORLD_SIZE PORT LAUNCHER_PID JOB_DIR``: import what a rank
    imports once, fork the ranks, write their pids (``JOB_DIR/pids``) and exit, which makes them the launcher's
    children. Stop signals stay blocked from here until each rank's handlers are in place (a stop sent to the
    group meanwhile waits for them); an error while importing is left to the ranks, which raise it again where
    its message is reported."""
    die_with_parent(launcher_pid)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        import roformer_dist.launch.preload  # noqa: F401
    except Exception:  # noqa: BLE001 (see the docstring)
        pass
    pids, forker = [], os.getpid()
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            name_process(f"{RANK_NAME}{rank}")
            while os.getppid() == forker:  # until it has exited: then the launcher's child (or an orphan that ends)
                time.sleep(0.002)
            _rank_main(rank, world_size, port, launcher_pid, job_dir)
        pids.append(pid)
    tmp = Path(job_dir, f"{PIDS_FILE}.tmp")
    tmp.write_text(" ".join(map(str, pids)), encoding="utf-8")
    tmp.replace(Path(job_dir, PIDS_FILE))
    os._exit(0)


RUN_FILE = "run.json"
"""The resolved run the ranks read, in the job's temporary directory."""
GO = b"go\n"
"""What the launcher writes to each rank's stdin once the run file is complete."""
RANK_NAME = "roformer-rank"
"""A forked rank's process name is this and its rank (``roformer_dist.testing.rank_processes`` finds them by it)."""
PIDS_FILE = "pids"
"""The forked ranks' pids, in rank order, written by the process that forked them before it exits."""
FORKS = sys.platform.startswith("linux")
"""Whether the ranks are forked from one process that imported torch once (it needs ``PR_SET_CHILD_SUBREAPER``)."""


def _status(job_dir: str, rank: int) -> Optional[int]:
    """The exit status rank ``rank`` returned, None: it ended without one (yet)."""
    try:
        return int(Path(job_dir, f"status{rank}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _rank_messages(job_dir: str) -> list[tuple[int, int, str]]:
    out = []
    for p in sorted(Path(job_dir).glob("rank*")):
        code, _, msg = p.read_text(encoding="utf-8").partition("\n")
        out.append((int(p.name[4:]), int(code), msg))
    return out


class _Forked:
    """A forked rank, this launcher's child once the process that forked it has exited: what a launch asks of
    a ``Popen`` (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not this process's child after all: gone, its status unknown
                pid, status = self.pid, 1 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


class LocalRanks:
    """The rank processes of a local launch; see the module docstring."""

    def __init__(self, world_size: int, stop: StopFlag):
        self.world, self.stop = world_size, stop
        self.port = free_port()
        self.procs: list = []
        """The ranks (``Popen`` or :class:`_Forked`, in rank order), once :meth:`run` knows them."""
        stop.forward_to(self._forward)
        self.adopted = adopt_orphans()  # whether this process was a subreaper already (given back at the end)
        self.job_dir = tempfile.mkdtemp(prefix="roformer-train-")
        groups = [list(range(world_size))] if FORKS else [[r] for r in range(world_size)]
        with blocked_stop_signals():  # the ranks unblock once their own handlers are in place
            self.own = set(children(os.getpid()))
            """This process's children before the ranks (its resource tracker; in a test, a fork server): not
            orphans the ranks left, kept when those are ended."""
            self.starters = [subprocess.Popen(
                [sys.executable, "-m", __name__, ",".join(map(str, g)), str(world_size), str(self.port),
                 str(os.getpid()), self.job_dir], stdin=subprocess.PIPE) for g in groups]
            """The processes started: the one that forks the ranks, or each rank."""

    def _forward(self, signum: int) -> None:
        sig = signal.SIGTERM if signum == signal.SIGINT else signum
        for p in self.procs:
            if p.returncode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def cancel(self) -> None:
        """End the ranks unused (the launch was refused, or stopped, before they were handed a run)."""
        for p in self.starters + self.procs:
            kill_tree(p.pid)
        for p in self.starters:
            with contextlib.suppress(OSError):
                p.stdin.close()
            p.wait()
        _end_adopted(keep=self.own)  # the forked ranks
        adopt_orphans(self.adopted)
        shutil.rmtree(self.job_dir, ignore_errors=True)

    def _started(self) -> Optional[str]:
        """Know the ranks (``procs``); returns why they could not be started, or None."""
        if not FORKS:
            self.procs = list(self.starters)
            return None
        forker = self.starters[0]
        code = forker.wait()
        with contextlib.suppress(OSError, ValueError):
            self.procs = [_Forked(int(pid)) for pid in
                          Path(self.job_dir, PIDS_FILE).read_text(encoding="utf-8").split()]
        if len(self.procs) == self.world:
            return None
        why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"the process that starts the ranks ({__name__}) {why} before it started them all"

    def run(self, run: ResolvedRun) -> int:
        """Hand the ranks ``run`` and wait; returns the job's exit status. The caller holds the run lock.

        If a rank fails, the others are stopped and the status of the first failure is returned; our errors'
        messages are printed once."""
        if run.world_size != self.world:
            self.cancel()
            raise RuntimeError(f"the run was resolved for {run.world_size} rank(s), {self.world} were started")
        failed = None if self.stop.requested else self._started()
        if self.stop.requested or failed:  # a signal during start-up: nothing was started, nothing is lost
            self.cancel()
            print(f"roformer-train: {failed}" if failed else
                  f"roformer-train: stopped by {self.stop.name} before training started", file=sys.stderr)
            return EXIT_BUG if failed else EXIT_REQUEUE
        try:
            return self._run(run)
        finally:
            shutil.rmtree(self.job_dir, ignore_errors=True)

    def _run(self, run: ResolvedRun) -> int:
        job_dir, procs, world = self.job_dir, self.procs, self.world
        Path(job_dir, RUN_FILE).write_text(json.dumps(run.to_json()), encoding="utf-8")
        for p in self.starters:  # (the forked ranks share their stdin: a line each)
            with contextlib.suppress(OSError):  # a rank that died already: the loop below reports it
                p.stdin.write(GO * (world // len(self.starters)))
                p.stdin.close()
        failed = None
        while any(p.poll() is None for p in procs):
            # a rank that ends without a result (an error, a crash, a kill) stops the job
            dead = [(r, p.returncode) for r, p in enumerate(procs)
                    if p.poll() is not None and _status(job_dir, r) is None]
            if dead:
                failed = dead[0]
                time.sleep(0.5)  # the others may be about to fail with the same error: let them say so
                for p in procs:
                    if p.poll() is None:
                        kill_tree(p.pid)
                break
            time.sleep(0.1)
        for p in procs:
            p.wait()
        _end_adopted(keep=self.own | {p.pid for p in procs})
        adopt_orphans(self.adopted)
        if failed is None:  # all ended in the same instant
            failed = next(((r, p.returncode) for r, p in enumerate(procs) if _status(job_dir, r) is None), None)
        messages = _rank_messages(job_dir)
        codes = [_status(job_dir, r) for r in range(world)]
        seen = set()
        for rank, code, msg in messages:
            if msg not in seen:
                seen.add(msg)
                print(f"roformer-train: {msg}" if len(messages) == world else f"roformer-train: rank {rank}: {msg}",
                      file=sys.stderr, flush=True)
        if failed:
            rank, code = failed
            own = [c for r, c, _ in messages if r == rank]
            report = run.run_dir.hang / REPORT
            if code == EXIT_HANG and report.exists():  # the watchdog's report: which rank, where, its stacks
                print(f"roformer-train: {report.read_text(encoding='utf-8', errors='replace')}", end="",
                      file=sys.stderr, flush=True)
                return EXIT_HANG
            if not own:
                why = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
                       f"exited with status {code}" if code else "exited without a result")
                print(f"roformer-train: rank {rank} {why}; the other ranks were stopped", file=sys.stderr, flush=True)
            return own[0] if own else (code if code > 0 else EXIT_BUG)
        bad = [c for c in codes if c != 0]
        return bad[0] if bad else 0


def _end_adopted(keep: set[int]) -> None:
    """End what the ranks' children left running (adopted by this launcher, ``adopt_orphans``): a rank
    killed while DeepSpeed JIT-built its op leaves torch's ninja and the compilers under it, which would
    outlive the launch and write into the build directory the next launch builds in."""
    for pid in children(os.getpid()):
        if pid not in keep:
            kill_tree(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":  # the ranks of LocalRanks (RANKS WORLD_SIZE PORT LAUNCHER_PID JOB_DIR)
    _ranks, _world, _port, _launcher, _job_dir = sys.argv[1:]
    if FORKS:
        _fork_ranks([int(r) for r in _ranks.split(",")], int(_world), int(_port), int(_launcher), _job_dir)
    else:
        _rank_main(int(_ranks), int(_world), int(_port), int(_launcher), _job_dir)
