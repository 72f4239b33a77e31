"""``roformer-train --config FILE [key=value ...]``

On this machine it starts ``dist.world_size`` rank processes itself (gloo on CPU, nccl on GPUs) and
holds the run directory's lock while they run. When the environment already carries a rank (torchrun,
SLURM through the launcher: RANK and WORLD_SIZE set), it runs as that one rank (global rank 0 holds
the lock).

Signals: SIGTERM, SIGUSR2 and a first Ctrl-C (SIGINT) ask every rank to save at the next step
boundary and exit 75, whether they reach the whole process group or this process alone (it passes
the request on); a second Ctrl-C aborts at once (130). The ranks die with this process (SIGKILL
included). Exit statuses: see :mod:`roformer_dist.errors` and ``--help``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from roformer_dist.config import Config, load_config
from roformer_dist.errors import EXIT_BUG, EXIT_REQUEUE, EXIT_STATUS_HELP, ConfigError, exit_status
from roformer_dist.stop import StopFlag, blocked_stop_signals, die_with_parent, exit_now, kill_tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(error: BaseException, status: int, prefix: str = "roformer-train") -> int:
    print(f"{prefix}: {error}", file=sys.stderr, flush=True)
    return status


def _rank_main(rank: int, world_size: int, port: int, cfg: Config, status, launcher_pid: int, errors_dir: str) -> None:
    """Entry point of a rank started by :func:`spawn_local`."""
    die_with_parent(launcher_pid)
    stop = StopFlag.install(quiet_abort=True)  # the launcher says it once
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from roformer_dist.trainer import run_rank

    try:
        code = status[rank] = run_rank(cfg, stop=stop, hold_lock=False)
    except Exception as e:
        code = exit_status(e)
        if code is None:
            raise  # a bug: multiprocessing prints the traceback, the rank exits 1
        # the launcher prints each distinct message once (every rank may raise the same one)
        Path(errors_dir, f"rank{rank}").write_text(f"{code}\n{e}", encoding="utf-8")
    exit_now(code)


def _rank_messages(errors_dir: str) -> list[tuple[int, int, str]]:
    out = []
    for p in sorted(Path(errors_dir).glob("rank*")):
        code, _, msg = p.read_text(encoding="utf-8").partition("\n")
        out.append((int(p.name[4:]), int(code), msg))
    return out


def spawn_local(cfg: Config, stop: StopFlag) -> int:
    """Start dist.world_size ranks on this machine and wait; returns the job's exit status.

    Stop signals reaching this process go on to the ranks (a Ctrl-C as SIGTERM, so that a rank that
    got the group's SIGINT too does not count a second one). If a rank fails, the others are stopped
    and the status of the first failure is returned; our errors' messages are printed once."""
    import torch.multiprocessing as mp

    world = cfg.dist.world_size
    port = _free_port()
    ctx = mp.get_context("spawn")
    status = ctx.Array("i", [-1] * world, lock=False)
    procs = []

    def forward(signum: int) -> None:
        sig = signal.SIGTERM if signum == signal.SIGINT else signum
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    stop.forward_to(forward)
    if stop.requested:  # a signal during start-up: nothing was started, nothing is lost
        print(f"roformer-train: stopped by {stop.name} before training started", file=sys.stderr)
        return EXIT_REQUEUE

    with tempfile.TemporaryDirectory(prefix="roformer-train-") as errors_dir:
        with blocked_stop_signals():  # the ranks unblock once their own handlers are in place
            procs.extend(ctx.Process(target=_rank_main, args=(r, world, port, cfg, status, os.getpid(), errors_dir))
                         for r in range(world))
            for p in procs:
                p.start()
        failed = None
        while any(p.is_alive() for p in procs):
            # a rank that ends without a result (an error, a crash, a kill) stops the job
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive() and status[r] == -1]
            if dead:
                failed = dead[0]
                time.sleep(0.5)  # the others may be about to fail with the same error: let them say so
                for p in procs:
                    if p.is_alive():
                        kill_tree(p.pid)
                break
            procs[0].join(timeout=0.2)
        for p in procs:
            p.join()
        if failed is None:  # all ended in the same instant
            failed = next(((r, p.exitcode) for r, p in enumerate(procs) if status[r] == -1), None)
        messages = _rank_messages(errors_dir)
    seen = set()
    for rank, code, msg in messages:
        if msg not in seen:
            seen.add(msg)
            print(f"roformer-train: {msg}" if len(messages) == world else f"roformer-train: rank {rank}: {msg}",
                  file=sys.stderr, flush=True)
    if failed:
        rank, code = failed
        own = [c for r, c, _ in messages if r == rank]
        if not own:
            why = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
                   f"exited with status {code}" if code else "exited without a result")
            print(f"roformer-train: rank {rank} {why}; the other ranks were stopped", file=sys.stderr, flush=True)
        return own[0] if own else (code if code > 0 else EXIT_BUG)
    codes = [status[r] for r in range(world)]
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


def _check_resume(cfg: Config, manifest: dict) -> None:
    """The checkpoint the ranks will resume from, checked here first: a damaged one is marked and
    skipped, one written for another model or layout is refused (CheckpointError) before any rank
    starts. The ranks check again (the same functions; under torchrun or SLURM only they do)."""
    if not cfg.checkpoint.resume:
        return
    from roformer_dist import checkpoint as ckpt
    from roformer_dist.resume_check import check_compatible

    found = ckpt.choose_resume(Path(cfg.run_dir) / "checkpoints", 0, 1)
    if found is not None:
        check_compatible(found, ckpt.read_trainer_state(found.dir, 0), cfg, cfg.dist.world_size, manifest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="roformer-train",
        description="Pretrain RoFormer on this machine: starts dist.world_size ranks (or runs as one rank when "
                    "RANK/WORLD_SIZE are set by torchrun or SLURM). Resumes from <run_dir>/checkpoints/latest. "
                    "SIGTERM, SIGUSR2 or Ctrl-C: save at the next step and exit 75; Ctrl-C twice: abort.",
        epilog="examples:\n  roformer-train --config configs/experiments/debug.yaml\n"
               "  roformer-train --config configs/experiments/demo.yaml deepspeed.zero_stage=3 trainer.stop_at_step=50\n"
               + "\n" + EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment YAML (configs/experiments/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def _load(path: str, overrides: list[str]) -> Config:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config: {path} is a directory; expected an experiment YAML file "
                          "(e.g. configs/experiments/debug.yaml)")
    if not p.exists():
        raise ConfigError(f"--config: {path}: no such file")
    try:
        return load_config(p, overrides)
    except OSError as e:  # unreadable (permissions, I/O)
        raise ConfigError(f"--config: cannot read {path}: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> int:
    """The command. Called without ``argv`` (the console script), it ends the process itself once done
    (see ``stop.exit_now``); with ``argv`` it returns the exit status."""
    # First thing: from here on a signal is a stop request, never a KeyboardInterrupt traceback.
    stop = StopFlag.install()
    try:
        code = _main(argv, stop)
    finally:
        if argv is not None:
            stop.restore()  # called as a function: leave the caller's handlers as they were
    if argv is None:
        exit_now(code)
    return code


def _main(argv: list[str] | None, stop: StopFlag) -> int:
    as_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    args = build_parser().parse_args(argv)
    try:
        cfg = _load(args.config, args.overrides)
        if args.print_config:
            from roformer_dist.config import dump_yaml

            print(dump_yaml(cfg), end="")
            return 0
        from roformer_dist.trainer import resolve_data, run_rank

        resolved, manifest = resolve_data(cfg, None)  # manifest vs model config, before any process starts
        if as_rank:
            return run_rank(cfg, stop=stop)
        from roformer_dist.checkpoint import check_writable
        from roformer_dist.runlock import RunLock

        with RunLock(cfg.run_dir) as lock:
            stop.on_abort(lock.release)
            check_writable(Path(cfg.run_dir) / "checkpoints", "the checkpoint directory")
            _check_resume(resolved, manifest)
            return spawn_local(cfg, stop)
    except Exception as e:
        code = exit_status(e)
        if code is None:
            raise  # a bug: the traceback is shown, exit status 1
        return _report(e, code)


if __name__ == "__main__":
    sys.exit(main())

