"""The rank entry point: ``run_rank(run)`` runs this process as one rank of a training job.

``run``: the :class:`~roformer_dist.launch.resolved.ResolvedRun` its launcher resolved (``roformer-train``'s
spawner, which holds the run lock), or this rank's ``Config`` (torchrun, the SLURM launcher): then global rank
0 takes the run lock and resolves, and the other ranks read what it resolved
(:func:`~roformer_dist.launch.resolved.hand_down`).

The torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) must be set
by whoever started it (``roformer-train``'s spawner, torchrun, or the SLURM launcher). It returns
``EXIT_DONE`` when the curriculum is finished or ``trainer.stop_at_step`` is reached, ``EXIT_REQUEUE``
after a stop signal (a complete checkpoint was saved, or the signal came while DeepSpeed's ops were
loaded or built; run again to continue), ``EXIT_NONFINITE`` after
too many consecutive non-finite losses, and raises the errors of :mod:`roformer_dist.errors` (config,
data, checkpoint, lock, storage) for its caller to report.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from roformer_dist.checkpoint.store import check_writable
from roformer_dist.config import Config
from roformer_dist.errors import EXIT_DONE, EXIT_REQUEUE
from roformer_dist.launch.build import build_trainer
from roformer_dist.launch.logs import setup_logging
from roformer_dist.launch.resolved import ResolvedRun, hand_down, resolve_run
from roformer_dist.loop.callbacks.heartbeat import last_barrier_watch
from roformer_dist.parallel.engine import SHM_COMM, load_op
from roformer_dist.runtime.deepspeed_import import import_deepspeed
from roformer_dist.runtime.faults import Faults
from roformer_dist.runtime.jit_builds import use_environment_extensions_dir, wait_for_build_locks
from roformer_dist.runtime.process_group import DistEnv, TorchComm, init_process_group
from roformer_dist.runtime.runlock import RunLock
from roformer_dist.runtime.stop import StopFlag, ignore_late_stop_signals

__all__ = ["run_rank", "init_distributed"]

log = logging.getLogger(__name__)


def init_distributed(cfg: Config, env: DistEnv, stop: Optional[StopFlag] = None) -> bool:
    """The process group (the project's one bootstrap), then DeepSpeed's communication on top of it.

    DeepSpeed loads (on first use JIT-builds) an op here (on CPU); a lock left by a killed build is removed
    first and a live build waited for (``runtime.jit_builds``), then the op is built through
    ``parallel.engine.load_op``: a build that fails raises ``EnvironmentSetupError`` (one line) on every rank.
    False: ``stop`` was requested during that wait, or during the build or load, which the same signal failed
    (torch runs ninja in this process group); DeepSpeed is then not initialised."""
    backend = init_process_group(env, cfg.dist.backend, cfg.dist.timeout_s)
    use_environment_extensions_dir()
    if not wait_for_build_locks(should_stop=lambda: stop is not None and stop.requested):
        return False
    deepspeed = import_deepspeed()  # heavy: only a training rank needs it

    try:
        load_op(SHM_COMM, env.local_rank)  # here, so that a failing build is one line, not DeepSpeed's traceback
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    except Exception:
        if stop is not None and stop.requested:
            return False  # torch runs ninja in this process group to load the op: the stop signal ended it too
        raise
    return True


def _resolve_as_rank(cfg: Config, env: DistEnv, stop: StopFlag) -> tuple[ResolvedRun, Optional[RunLock]]:
    """torchrun / SLURM: global rank 0 resolves the run (taking the run lock once the data checked out) and checks
    that the checkpoint directory is writable; every rank gets it or the same error (collective). Returns the run and the lock (rank 0)."""
    held: list[RunLock] = []

    def resolve() -> ResolvedRun:
        run = resolve_run(cfg, env.world_size,
                          take_lock=lambda: held.append(RunLock(cfg.run_dir, mode=cfg.run_dir_mode).acquire()))
        check_writable(run.run_dir.checkpoints, "the checkpoint directory")  # made here: after the data's checks
        return run

    try:
        run = hand_down(cfg, env.rank, env.world_size, TorchComm(), resolve)
    except BaseException:
        for lock in held:
            lock.release()
        raise
    lock = held[0] if held else None
    if lock is not None:
        stop.on_abort(lock.release)
    return run, lock


def run_rank(run: Union[ResolvedRun, Config], *, stop: Optional[StopFlag] = None, faults: Optional[Faults] = None,
             on_hang: Callable[[], None] = lambda: None) -> int:
    """Run this process as one rank of the job ``run`` (resolved, or this rank's config); see the module docstring.

    ``stop``: the stop flag the caller installed (``roformer-train`` does it first thing, in its launcher
    and in each rank it spawns, and under torchrun or srun); None installs it here (the submitit job of
    ``roformer-submit``, a direct call). ``faults``: None reads the test fault
    variables of the environment, once. ``on_hang``: what the hang watchdog calls before it ends this process
    (exit 76; the SLURM job requeues itself there)."""
    cfg = run.cfg if isinstance(run, ResolvedRun) else run
    env = DistEnv.from_environ()
    if stop is None:
        stop = StopFlag.install()
    if faults is None:
        faults = Faults.from_environ()
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one machine share its cores; oversubscribed threads make every rank slower
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    own_group = not dist.is_initialized()
    if not init_distributed(cfg, env, stop):
        log.warning("stopped (%s) while DeepSpeed's ops were being loaded or built: nothing was trained in this "
                    "launch; the newest complete checkpoint stays latest", stop.name)
        if own_group:
            dist.destroy_process_group()
        return EXIT_REQUEUE
    lock = None
    if not isinstance(run, ResolvedRun):
        run, lock = _resolve_as_rank(cfg, env, stop)
    try:
        setup_logging(run.run_dir.logs, run.cfg.logging.level, env.rank)
        trainer = build_trainer(run, env, stop=stop, faults=faults, on_hang=on_hang)
        try:
            code = trainer.fit()
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.release()
    if code == EXIT_DONE:
        ignore_late_stop_signals()
    if own_group and dist.is_initialized():
        watch = last_barrier_watch(trainer.callbacks)  # armed again for the job's last barrier: a rank stopped there hangs it too
        if watch is not None:
            watch.start()
        try:
            dist.barrier()
            dist.destroy_process_group()
        finally:
            if watch is not None:
                watch.stop()
    return code
