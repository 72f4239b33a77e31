"""``roformer-train --config FILE [key=value ...]``

On this machine it starts ``dist.world_size`` rank processes itself (gloo on
CPU, nccl on GPUs). When the environment already carries a rank (torchrun,
SLURM through the launcher: RANK and WORLD_SIZE set), it runs as that one rank.
The exit status is the trainer's: 0 done, 75 stopped by a signal with a
checkpoint (run again to continue), 3 too many non-finite losses, 2 bad config.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from roformer_dist.config import Config, load_config

EXIT_BAD_CONFIG = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, cfg: Config, status) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from roformer_dist.trainer import run_rank

    try:
        status[rank] = run_rank(cfg)
    except ValueError as e:  # a config/data mismatch found once the shards are read
        print(f"roformer-train: rank {rank}: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)


def spawn_local(cfg: Config) -> int:
    """Start dist.world_size ranks on this machine and wait; returns the job's exit status.

    SIGUSR2 / SIGTERM sent to this process are passed on to the ranks (they save and stop together).
    If a rank dies, the others are stopped."""
    import signal

    import torch.multiprocessing as mp

    world = cfg.dist.world_size
    port = _free_port()
    ctx = mp.get_context("spawn")
    status = ctx.Array("i", [-1] * world)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cfg, status)) for r in range(world)]
    for p in procs:
        p.start()

    def forward(signum, frame):  # noqa: ARG001
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    failed = None
    try:
        while any(p.is_alive() for p in procs):
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            if dead:
                failed = dead[0]
                print(f"roformer-train: rank {failed[0]} exited with status {failed[1]}; stopping the others",
                      file=sys.stderr)
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            procs[0].join(timeout=0.2)
        for p in procs:
            p.join()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if failed:
        return failed[1] if failed[1] > 0 else 1
    codes = [status[r] for r in range(world)]
    bad = [c for c in codes if c != 0]
    return bad[0] if bad else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="roformer-train",
        description="Pretrain RoFormer on this machine: starts dist.world_size ranks (or runs as one rank when "
                    "RANK/WORLD_SIZE are set by torchrun or SLURM). Resumes from <run_dir>/checkpoints/latest.",
        epilog="examples:\n  roformer-train --config configs/experiments/debug.yaml\n"
               "  roformer-train --config configs/experiments/demo.yaml deepspeed.zero_stage=3 trainer.stop_at_step=50\n"
               "exit status: 0 done, 75 stopped by a signal after saving (run again to continue), "
               "3 too many non-finite losses, 2 bad config",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment YAML (configs/experiments/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"roformer-train: config error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.print_config:
        from roformer_dist.config import dump_yaml

        print(dump_yaml(cfg), end="")
        return 0
    from roformer_dist.trainer import resolve_data, run_rank

    try:
        resolve_data(cfg, None)  # manifest vs model config, before any process starts
    except (ValueError, FileNotFoundError) as e:
        print(f"roformer-train: data error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:

        return run_rank(cfg)
    return spawn_local(cfg)


if __name__ == "__main__":
    sys.exit(main())
