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
import sys
from pathlib import Path

from data_pipeline.command_line import CommandParser
from roformer_dist.config import Config, DecayShape, choices, dump_yaml, fork_overrides, load_config
from roformer_dist.errors import EXIT_STATUS_HELP, ConfigError, run_command
from roformer_dist.nn.attention_kinds import check_attention
from roformer_dist.runtime.runlock import RunLock
from roformer_dist.runtime.stop import StopFlag, exit_now


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="roformer-train",
        description="Pretrain RoFormer on this machine: starts dist.world_size ranks (or runs as one rank when "
                    "RANK/WORLD_SIZE are set by torchrun or SLURM). Resumes from the newest complete checkpoint in <run_dir>/checkpoints. "
                    "SIGTERM, SIGUSR2 or Ctrl-C: save at the next step and exit 75; Ctrl-C twice: abort.",
        epilog="examples:\n  roformer-train --config configs/experiments/debug.yaml\n"
               "  roformer-train --config configs/experiments/demo.yaml deepspeed.zero_stage=3 trainer.stop_at_step=50\n"
               "  roformer-train --config configs/experiments/demo.yaml --dry-run --gpu-memory 80GB\n"
               + "\n" + EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="experiment YAML (configs/experiments/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--fork", metavar="PARENT",
                   help="start a new run from the weights of PARENT (a run directory or checkpoint of ours, a Hugging "
                        "Face repository, a weights file): the same as init.from=PARENT; set run_dir to a new "
                        "directory. The parent is evaluated on this run's eval sets before the first step and "
                        "recorded in <run_dir>/parent.json; a restart resumes the fork itself")
    p.add_argument("--decay", metavar="STEPS", type=int,
                   help="with --fork: a decay branch. PARENT is a checkpoint of ours taken at its peak lr (constant, "
                        "or wsd before its decay); this run resumes it whole and decays over STEPS steps "
                        "(init.decay_steps)")
    p.add_argument("--decay-shape", choices=choices(DecayShape),
                   help="with --decay: the decay's shape (optim.decay_shape; default 1-sqrt)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve everything a launch would (data, mixture, stages, warm start, resume decision), "
                        "write nothing, print the plan and each stage's memory per GPU; exit 2 naming the first "
                        "stage that does not fit")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="with --dry-run: the memory of one GPU, e.g. 80GB or 141GiB (default: the visible GPU's)")
    return p


def _load(path: str, overrides: list[str]) -> Config:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config: {path} is a directory; expected an experiment YAML file "
                          "(e.g. configs/experiments/debug.yaml)")
    if not p.exists():
        raise ConfigError(f"--config: {path}: no such file")
    try:
        cfg = load_config(p, overrides)
    except OSError as e:  # unreadable (permissions, I/O)
        raise ConfigError(f"--config: cannot read {path}: {e.strerror or e}") from None
    check_attention(cfg.model.attention, cfg.model.document_attention)  # the kinds' table (no torch)
    return cfg


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
    args = build_parser().parse_args(argv)
    return run_command("roformer-train", lambda: _run(args, stop))


def _run(args, stop: StopFlag) -> int:
    as_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    cfg = _load(args.config, args.overrides + fork_overrides(args.fork, args.decay, args.decay_shape))
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if args.gpu_memory and not args.dry_run:
        raise ConfigError("--gpu-memory: only with --dry-run (the estimate's budget)")
    if args.dry_run:
        from roformer_dist.launch.dry_run import dry_run
        from roformer_dist.launch.memory_estimate import parse_bytes

        gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
        dry_run(cfg, int(os.environ["WORLD_SIZE"]) if as_rank else None, gpu_memory)
        return 0
    # torch and DeepSpeed come in here, after the stop handlers are in place (main's first line)
    if as_rank:
        from roformer_dist.launch.entry import run_rank

        return run_rank(cfg, stop=stop)  # global rank 0 resolves the run (the sinks checked first); the others read it
    from roformer_dist.launch.spawn import LocalRanks

    # the ranks start first and import torch and DeepSpeed while this process resolves the run (a refused run
    # ends them unused)
    ranks = LocalRanks(cfg.dist.world_size, stop)
    handed = False
    locks: list[RunLock] = []

    def take_lock() -> None:  # once the data and the config checked out: a refused run leaves no run directory
        locks.append(RunLock(cfg.run_dir, mode=cfg.run_dir_mode).acquire())
        stop.on_abort(locks[0].release)

    try:
        from roformer_dist.checkpoint.store import check_writable
        from roformer_dist.launch.resolved import resolve_run

        run = resolve_run(cfg, take_lock=take_lock)  # sinks, manifests, mixture, stage plans, resume decision: once
        check_writable(run.run_dir.checkpoints, "the checkpoint directory")
        run.write()
        handed = True
        return ranks.run(run)
    finally:
        if not handed:
            ranks.cancel()
        for lock in locks:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())

