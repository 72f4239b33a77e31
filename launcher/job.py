"""The submitit job: one trainer rank per task; requeue after a stop signal (after a hang: ``hang_requeue.py``).

Stop protocol (docs/guides/checkpoints.md, "Failures and what is guaranteed").
SLURM signals every task: SIGUSR2 before the time
limit (``--signal=USR2@<slurm.signal_delay_s>``), SIGUSR2/SIGTERM on preemption (the local cluster's
``preempt_send_user_signal``), or ``scancel --signal=USR2 --full``. The trainer's own handlers (installed by
``run_rank``, replacing submitit's) only set a flag; at the next step boundary the ranks agree, save one
complete checkpoint together, and ``run_rank`` returns ``EXIT_REQUEUE`` on every rank. Then:

- global rank 0 does what submitit's ``SignalHandler.checkpoint_and_try_requeue`` (submitit 1.5.4) does on a
  signal -- it *is* that method, called after the save instead of from inside the signal: it counts the
  stop as a time-out or a preemption (time-outs spend ``slurm.max_num_timeout``; submitit calls a stop a
  time-out once the attempt has run min(0.8 x limit, limit - 10 min), so with limits of 10 minutes or
  less every stop is one), writes the resubmission pickle, runs ``scontrol requeue
  $SLURM_JOB_ID`` (the local executor: exit 144, its controller restarts the tasks) and exits without a
  result. Past the budget it raises ``UncompletedJobError`` and the job fails with that message.
- the other ranks leave without a result (``SystemExit``: submitit writes no result pickle for it);
  the requeue ends whatever is left of the job anyway.

The requeued job (same job id) runs this callable again from the pickle; ``run_rank`` resumes from
``<run_dir>/checkpoints/latest``, at any world size.

Run lock: global rank 0 holds ``<run_dir>``'s lock inside ``run_rank`` and releases it before the requeue
above; the requeued attempt (same SLURM_JOB_ID, next SLURM_RESTART_COUNT) takes it back even if the old
attempt's file lock lingers. Another job on the same run_dir is refused (``RunLockedError``, naming the
holder) and fails without requeue.

A signal that arrives before the trainer installed its handlers (imports, process-group set-up) reaches
submitit's handler instead, which requeues at once; the job then resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import submitit
from submitit.core.job_environment import SignalHandler
from submitit.core.utils import DelayedSubmission

from launcher import slurm
from launcher.hang_requeue import after_hang
from roformer_dist.config import Config
from roformer_dist.errors import EXIT_DONE, EXIT_REQUEUE
from roformer_dist.runtime.rundir import RunDir


MASTER_PORTS = (20000, 32767)
"""The range MASTER_PORT is drawn from: below Linux's default ephemeral range (32768-60999), where every outgoing
connection of the node takes its local port. A port drawn there was now and then taken at the moment rank 0
listened (EADDRINUSE, seen with a busy node's test suite)."""


def _master_port(job_id: str) -> int:
    # Deterministic per job and attempt, so every task derives the same port without talking; a requeued
    # attempt gets another one than the attempt before it (whose sockets may linger).
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    return random.Random(f"{job_id}-{attempt}").randint(*MASTER_PORTS)


def export_dist_env() -> submitit.JobEnvironment:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT (+ NODE_RANK) from the job environment.

    MASTER_ADDR is the first node of the allocation (SLURM_JOB_NODELIST). CUDA_VISIBLE_DEVICES is left as
    SLURM set it (all GPUs of the node for every task): the trainer picks ``cuda:LOCAL_RANK``.
    """
    env = submitit.JobEnvironment()
    dist_env = submitit.helpers.TorchDistributedEnvironment()
    if env.cluster == "local":
        dist_env.master_addr = "127.0.0.1"  # one machine; its hostname need not resolve
    dist_env.master_port = _master_port(env.job_id)
    dist_env.export(set_cuda_visible_devices=False, overwrite=True)
    os.environ["NODE_RANK"] = str(env.node)
    return env


REQUEUEING = {"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING", "COMPLETING"}
"""Job states in which SLURM is requeueing the job already (and refuses another ``scontrol requeue``)."""

class TrainJob(submitit.helpers.Checkpointable):
    """``executor.submit(TrainJob(cfg))``: every task of the job runs one rank of ``run_rank(cfg)``.

    ``checkpoint`` (inherited) resubmits the same callable: all training state lives in the run directory.
    Returns ``{"run_dir", "rank", "status": "done"}`` on each task when the curriculum (or
    ``trainer.stop_at_step``) is finished.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self) -> dict:
        started = time.time()
        env = export_dist_env()
        print(f"{time.strftime('%H:%M:%S')} roformer-submit job {env.job_id} on {socket.gethostname()}: "
              f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} (node {env.node}/{env.num_nodes}, "
              f"local rank {os.environ['LOCAL_RANK']}), master {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}, restart {os.environ.get('SLURM_RESTART_COUNT', '0')}",
              file=sys.stderr, flush=True)
        from roformer_dist.launch.entry import run_rank  # torch and DeepSpeed: only in the job

        from roformer_dist.runtime.process_group import peer_lost, port_in_use

        try:
            hang = RunDir.of(self.cfg).hang
            code = run_rank(self.cfg, on_hang=lambda: after_hang(
                hang, env.job_id, int(os.environ["WORLD_SIZE"]), self.cfg.slurm.max_hang_requeues,
                grace_s=min(10.0, self.cfg.dist.hang_timeout_s / 2)))
        except Exception as e:
            if port_in_use(e):  # said as what it is, not as a lost peer; the other ranks wait for rank 0 in vain
                print(f"rank {env.global_rank}: MASTER_PORT {os.environ['MASTER_PORT']} on {os.environ['MASTER_ADDR']} "
                      f"is held by another process (EADDRINUSE): the process group of job {env.job_id} cannot form; "
                      "submit the same command again (a new attempt draws another port)", file=sys.stderr, flush=True)
                sys.exit(1)
            if not peer_lost(e):
                raise
            # another task died or was ended (a crash, the hang watchdog, SLURM's requeue): its news, not this
            print(f"rank {env.global_rank}: a collective failed because another rank of job {env.job_id} is gone "
                  f"({str(e).splitlines()[0]}); this task ends (see the job's other logs)", file=sys.stderr, flush=True)
            sys.exit(1)
        if code == EXIT_DONE:
            return {"run_dir": self.cfg.run_dir, "rank": env.global_rank, "status": "done"}
        if code == EXIT_REQUEUE:
            self._requeue(env, started)
        raise RuntimeError(f"the trainer stopped with exit status {code} on rank {env.global_rank} "
                           f"(see {self.cfg.run_dir}/logs/rank{env.global_rank}.log)")

    def _requeue(self, env: submitit.JobEnvironment, started: float) -> None:
        """The trainer saved because of a stop signal: requeue the job (rank 0) and leave without a result."""
        if env.global_rank != 0:
            print("saved after a stop signal; rank 0 requeues the job", file=sys.stderr, flush=True)
            sys.exit(0)
        paths = env.paths
        handler = SignalHandler(env, paths, DelayedSubmission.load(paths.submitted_pickle))
        handler._start_time = started  # its time-out-or-preemption rule measures this attempt's run time
        try:
            handler.checkpoint_and_try_requeue(signal.SIGUSR2)  # requeues and exits; raises past the budget
        except subprocess.CalledProcessError as e:
            # SLURM refuses `scontrol requeue` of a job it is requeueing already: the stop came from an
            # `scontrol requeue` of the job (or a preemption with PreemptMode=REQUEUE), which brings it back
            now = slurm.state(env.job_id)
            if now not in REQUEUEING:
                raise RuntimeError(f"the checkpoint is saved, but requeueing job {env.job_id} failed ({e}; the job "
                                   f"is {now}): submit the same command again to resume") from None
            print(f"saved after a stop signal; job {env.job_id} is being requeued by SLURM already ({now}): its "
                  "next attempt resumes from this checkpoint", file=sys.stderr, flush=True)
            sys.exit(0)
