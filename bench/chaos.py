"""A fault campaign: randomised faults against real `roformer-train` runs, each run checked afterwards
against an uninterrupted run of the same config.

The job: the debug model on 2 ranks, the three-stage debug curriculum, a two-source mixture (People's
Daily news 0.7, product reviews 0.3), eval every 4 steps, a checkpoint every 2 steps (the newest 2
kept), in four layouts taken in turn: ZeRO-1 with synchronous saves, ZeRO-2 and ZeRO-3 with
asynchronous saves, and pipeline x 2 (ZeRO-1, asynchronous saves). Each *episode* runs one layout from
scratch to its last step; before or during its launches a seeded schedule injects faults:

- at a random wall time: SIGKILL of one rank, of the launcher, of the whole process group; SIGTERM,
  SIGINT or SIGUSR2 to the group; SIGSTOP of one rank (``stop-rank``, once the launch trains: a hang);
  ``slow-rank``: one rank process (not the launcher) stopped and continued in turn, stopped 85 % of each
  5-15 ms period, from the launch's first step after that time until the launch ends (then always left
  continued): a straggler;
- at a random point inside the code (``ROFORMER_FAULT_AT``, ``roformer_dist/runtime/faults.py``: before
  or after each file of a save, before COMPLETE, before and after the rename of ``latest``, while the
  loader's position is captured, inside a stage switch, inside eval, after a resume's load, after a
  step), one of the actions there (die, crash, kill the launcher or the group, signal the group);
- between launches: a file of the newest checkpoint truncated or deleted; a stale lock record of a
  dead process; a full disk (the run directories live on a tmpfs that is shrunk for one launch;
  skipped, with the reason, when no tmpfs can be mounted);
- a second fault while the next launch recovers from the first (early in its start-up or right after
  its checkpoint is loaded);
- now and then, SIGKILL to the group while DeepSpeed JIT-builds its op (the episode's own
  ``TORCH_EXTENSIONS_DIR`` from then on, its built op deleted first): torch's build lock is left behind.

After each fault the same command is launched again, as a user or SLURM would, until the run exits 0.
Watched while it runs: ``latest`` never names a checkpoint without COMPLETE (read every 20 ms), no
process of a launch outlives it, no traceback, no hang. Of the launch that received the fault: a stop signal
is obeyed, a full disk named (exit 74), a stopped rank ends the launch through the hang watchdog (exit 76)
within ``dist.hang_timeout_s`` (15 s) + 30 s, a checkpoint with a flipped bit never resumed from, and a slowed
rank is not taken for a hang and is named by the straggler warning ("step N: rank R (host H) is a straggler",
``observe/stragglers.py``; the runs log every 2 steps with ``dist.straggler_log_steps=1``) at one of the log
steps after its slowing began (with ZeRO-3, whose forwards wait for each other in their all-gathers, by its
data wait); a launch that ended before 4 such log steps without naming it counts the fault as not reached.
In the pipeline layout the two ranks are stages, which the straggler check compares by data wait alone (all
zero there): a slowed stage is drawn as well, but not expected to be named (counted apart). Checked at the
end of each episode against the uninterrupted run: every step's loss in ``metrics.jsonl`` once and
bit-equal, the final weights equal (a slowed rank changes no number), TensorBoard's scalars with the same
steps (and, outside ``perf/``, the same values), no temporary file, marker or lock record left in the run
directory, no incomplete checkpoint, no JIT build lock left.

The spike variant (``--spike skip|rollback``; off by default): every episode and the uninterrupted runs with
``trainer.spike=POLICY``, ``trainer.spike_window=8`` (spikes looked for once 8 kept losses up to the last log
step exist: from step 9) and a loss spike injected at steps 10 and 15 (``ROFORMER_INJECT_SPIKE_AT=10,15``, x50);
its uninterrupted runs are made and kept apart (``reference-<layout>-spike-<policy>``; with ``skip`` one that
did not mark the injected steps ``"spike": true`` ends the campaign). Checked as above, the records' ``spike``
marks too, and with ``skip`` the injected steps marked ``"spike": true`` in the episode's metrics.jsonl; with
``rollback`` (the records rewound after a rollback) the equality with the uninterrupted run alone. Pipeline
layouts refuse ``trainer.spike`` (config validation): the variant leaves them out. The SLURM variants
(``--slurm``) run without it.

    python bench/chaos.py --faults 200          # the campaign (30-40 minutes on 2 cores)
    python bench/chaos.py --faults 30 --spike rollback  # the spike variant (three layouts: no pipeline)
    python bench/chaos.py --tiny                # 9 faults on one layout, one of each kind (TINY_FIRST;
                                                # a full disk where a tmpfs can be mounted; 2-3 minutes)

Prints a table (faults by kind, relaunches, slowed ranks and how many were named, steps re-done, violations)
and one JSON line; exits 1 when there was a violation, each described in ``<out>/violations.txt`` with its
episode, fault and seed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

os.environ.setdefault("TQDM_DISABLE", "1")  # the oracle's checkpoint reads draw no progress bars

import _common as C  # noqa: E402  (puts the checkout on sys.path)
from _chaos_faults import Disk, Schedule, damage, flip, stale_lock  # noqa: E402
from _chaos_launch import (LAYOUTS, PIPELINE_LAYOUTS, SPIKE_AT, TOTAL_STEPS, Fault, command, launch,  # noqa: E402
                           make_data, metrics, reference, spike_env)
from _chaos_oracle import expectations, oracle  # noqa: E402
from _chaos_slurm import SLURM_VARIANTS, slurm_ready, slurm_variant  # noqa: E402

from roformer_dist.errors import EXIT_DONE  # noqa: E402
from roformer_dist.testing import copy_built_op  # noqa: E402

TINY_FIRST = ("point", "recovery", "flip", "signal:stop-rank", "damage", "signal:slow-rank", "stale-lock", "jit-build",
              "disk-full")
"""The tiny campaign's faults, one of each kind (``Schedule.first``), made first; it goes on until each was made."""


# ----------------------------------------------------------------------------------------- the campaign

@dataclass
class Tally:
    faults: Counter = field(default_factory=Counter)
    undelivered: int = 0
    launches: int = 0
    relaunches: int = 0
    redone: Counter = field(default_factory=Counter)
    exits: Counter = field(default_factory=Counter)
    violations: list = field(default_factory=list)
    slowed: int = 0
    """slow-rank faults delivered (slowed for long enough, or named)."""
    named: int = 0
    """... whose rank a straggler warning named."""
    slowed_pipeline: int = 0
    """... in a pipeline layout (where no warning is expected)."""



def episode(idx: int, layout: str, budget: int, data: Path, out: Path, disk: Disk, schedule: Schedule,
            tally: Tally, args, log) -> int:
    """One run of ``layout`` from scratch to its last step with up to ``budget`` faults; returns the faults delivered."""
    ref, _, _ = reference(data, out, layout, args.spike)
    run = disk.path / f"episode{idx:03d}-{layout}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = command(data, run, layout, args.spike)
    extensions = out / "extensions"
    shutil.rmtree(extensions / run.name, ignore_errors=True)
    extra_env: dict = spike_env(args.spike)
    """The spike variant's injected spikes; TORCH_EXTENSIONS_DIR from the episode's first JIT-build fault on: its
    own (where build locks are left)."""
    delivered, launches, recovering = 0, 0, None
    reached_before: Optional[int] = None
    while True:
        fault: Optional[Fault] = None
        before: Optional[Fault] = None
        """A fault made before the launch (a damaged file, a stale lock, a full disk)."""
        if recovering is not None:
            fault, recovering = recovering, None
        elif delivered < budget:
            fault = schedule.draw(run, tally.launches)
        if fault is not None and fault.kind == "jit-build":
            op = extensions / run.name / "deepspeed_shm_comm"
            for built in op.glob("*"):
                if built.name != "lock":  # (one a kill before left stays: the launch must clear it first)
                    built.unlink()
            extra_env["TORCH_EXTENSIONS_DIR"] = str(op.parent)
            fault.build_lock = op / "lock"
        elif fault is not None and fault.at_s is None and not fault.env:
            before, fault = fault, None
            if before.kind == "flip":
                detail, before.flipped_step = flip(run, schedule.rng)
            else:
                detail = (damage(run, schedule.rng) if before.kind == "damage" else
                          stale_lock(run) if before.kind == "stale-lock" else disk.fill())
            before.detail += ": " + detail
            before.delivered = True
            if before.kind != "disk-full" and delivered + 1 < budget:  # and one while it runs
                fault = schedule.draw(run, tally.launches, runtime_only=True)
        if fault is not None and fault.signal_kind == "slow-rank":
            fault.expect_named = layout not in PIPELINE_LAYOUTS  # (stages: compared by data wait alone)
        result = launch(cmd, run, before, fault, args.launch_timeout, log, extra_env)
        if args.tiny and fault is not None and fault.kind == "jit-build":
            # the next launch clears the lock the kill left and loads this environment's build of the op
            # (compiling it again is the full campaign's: ~30 s a time)
            copy_built_op("deepspeed_shm_comm", extensions / run.name)
        if before is not None and before.kind == "disk-full":
            disk.restore()
        launches += 1
        tally.launches += 1
        schedule.observe(result, run)
        tally.exits[result.rc] += 1
        if reached_before is not None and result.resumed_from is not None:
            tally.redone[max(0, reached_before - result.resumed_from)] += 1
        if result.resumed_from is not None:  # a launch that ended before resuming left the record as it was
            reached_before = len(metrics(run))
        problems = list(result.problems)
        for f in (before, fault):
            if f is not None and f.delivered:
                delivered += 1
                tally.faults[f.kind] += 1
                problems += expectations(f, result)
                if f.slowing is not None:
                    tally.slowed += 1
                    tally.named += f.named
                    tally.slowed_pipeline += not f.expect_named
            elif f is not None:
                tally.undelivered += 1
        if fault is not None and fault.delivered and not fault.kind.startswith("recovery") \
                and result.rc != EXIT_DONE and schedule.second_fault(args.recovery_share):
            recovering = schedule.recovery(run, tally.launches)
        what = " + ".join(f.detail + ("" if f.delivered else " (not reached)") for f in (before, fault) if f) or "no fault"
        for p in problems:
            tally.violations.append(f"episode {idx} ({layout}), launch {launches}, fault {what}: {p}")
        status = "ok" if not problems else f"{len(problems)} VIOLATION(S)"
        print(f"  [{layout} #{idx}] launch {launches}: {what} -> exit {result.rc}, "
              f"{len(metrics(run))}/{TOTAL_STEPS} steps, {result.wall_s:.1f} s, {status}", flush=True)
        if result.rc == EXIT_DONE:
            break
        if launches > 3 * budget + 8:
            tally.violations.append(f"episode {idx} ({layout}): not complete after {launches} launches")
            break
    tally.relaunches += launches - 1
    found = oracle(run, ref, args.spike)
    found += [f"a JIT build lock left: {lock}" for lock in (extensions / run.name).glob("*/lock")]
    shutil.rmtree(extensions / run.name, ignore_errors=True)
    tally.violations += [f"episode {idx} ({layout}), at the end: {p}" for p in found]
    if found or args.keep:
        kept = out / "kept" / run.name
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(run, kept, symlinks=True)
        print(f"  [{layout} #{idx}] kept in {kept}", flush=True)
    shutil.rmtree(run, ignore_errors=True)
    print(f"  [{layout} #{idx}] {delivered} fault(s), {launches} launch(es); oracle: "
          f"{'ok' if not found else '; '.join(found)[:600]}", flush=True)
    return delivered


def report(tally: Tally, args, wall_s: float, disk: Disk, out: Path, slurm_rows: list[dict]) -> None:
    total = sum(tally.faults.values())
    print(f"\nFault campaign: seed {args.seed}, layouts {', '.join(args.layouts)}, {total} faults, "
          f"{tally.launches} launches, {wall_s / 60:.1f} min (load average {C.load_average()})")
    if not disk.mounted:
        print(f"full-disk faults skipped: {disk.reason}")
    C.print_table(["fault", "injected"], [[k, v] for k, v in sorted(tally.faults.items())] + [["total", total]])
    redone = sorted(tally.redone.items())
    print(f"relaunches: {tally.relaunches}; drawn but not reached (the launch ended first): {tally.undelivered}")
    apart = f" ({tally.slowed_pipeline} in the pipeline layout, where none is expected)" if tally.slowed_pipeline else ""
    print(f"slowed ranks: {tally.slowed}, named as stragglers: {tally.named}{apart}")
    if args.spike:
        print(f"spike variant: trainer.spike={args.spike}, loss spikes injected at steps "
              f"{', '.join(map(str, SPIKE_AT))} of every episode and of the uninterrupted runs")
    print("steps re-done after a launch (steps it recorded that the next one did again), launches: "
          + ", ".join(f"{k}: {v}" for k, v in redone))
    print("exit statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.exits.items(), key=str)))
    if slurm_rows:
        print("\nUnder SLURM (the local cluster):")
        C.print_table(["variant", "fault", "submissions", "SLURM attempts", "violations"],
                    [[r["variant"], r["fault"], r["submissions"], r["attempts"], r["violations"]] for r in slurm_rows])
    print(f"violations: {len(tally.violations)}")
    if tally.violations:
        (out / "violations.txt").write_text("\n\n".join(tally.violations) + "\n")
        for v in tally.violations[:20]:
            print(f"  VIOLATION {v[:1200]}")
        print(f"  (all in {out / 'violations.txt'})")
    values = [k for k, v in redone for _ in range(v)]
    C.result("chaos", seed=args.seed, faults=total, by_kind=dict(sorted(tally.faults.items())),
             launches=tally.launches, relaunches=tally.relaunches, not_reached=tally.undelivered,
             slow_rank={"slowed": tally.slowed, "named": tally.named, "pipeline": tally.slowed_pipeline},
             spike=args.spike,
             steps_redone={str(k): v for k, v in redone},
             steps_redone_median=sorted(values)[len(values) // 2] if values else 0,
             steps_redone_max=max(values, default=0), violations=len(tally.violations), disk_faults=disk.mounted,
             wall_s=round(wall_s, 1), layouts=args.layouts, slurm=slurm_rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--faults", type=int, default=200, help="faults to inject in all (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults-per-run", type=int, default=8, help="faults per episode (one run from scratch to the end)")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                   help=f"comma-separated, taken in turn (default {','.join(LAYOUTS)})")
    p.add_argument("--recovery-share", type=float, default=0.25,
                   help="share of faults followed by a second one while the run recovers (default 0.25)")
    p.add_argument("--launch-timeout", type=float, default=240, help="seconds before a launch counts as hung")
    p.add_argument("--out", type=Path, default=C.REPO / "runs" / "bench" / "chaos")
    p.add_argument("--keep", action="store_true", help="keep every episode's run directory (under OUT/kept)")
    p.add_argument("--slurm", default="", type=lambda s: [x for x in s.split(",") if x],
                   help=f"also run these SLURM variants on the local cluster (comma-separated, 'all' for "
                        f"{','.join(SLURM_VARIANTS)}): one job each, its fault, resubmitted until it completes")
    p.add_argument("--spike", choices=("skip", "rollback"), default=None,
                   help="the spike variant: episodes and uninterrupted runs with trainer.spike=POLICY and loss "
                        f"spikes injected at steps {','.join(map(str, SPIKE_AT))} (pipeline layouts left out: they "
                        "refuse trainer.spike; the SLURM variants run without it)")
    C.tiny_defaults(p, argv, faults=len(TINY_FIRST), faults_per_run=5, layouts=["zero2-async"], out=C.tiny_dir)
    args = p.parse_args(argv)
    if args.slurm == ["all"]:
        args.slurm = list(SLURM_VARIANTS)
    wrong = [x for x in args.slurm if x not in SLURM_VARIANTS]
    if wrong:
        p.error(f"--slurm: unknown {wrong}; expected 'all' or some of {', '.join(SLURM_VARIANTS)}")
    unknown = [x for x in args.layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")
    if args.spike and set(args.layouts) & PIPELINE_LAYOUTS:
        args.layouts = [x for x in args.layouts if x not in PIPELINE_LAYOUTS]
        if not args.layouts:
            p.error("--spike: pipeline layouts refuse trainer.spike; name another layout")
        print(f"--spike: the pipeline layout(s) {', '.join(sorted(PIPELINE_LAYOUTS))} left out "
              f"(trainer.spike is refused with parallel.pipeline > 1)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out / "data")
    disk = Disk(args.out / "disk")
    t0 = time.monotonic()
    tally = Tally()
    try:
        for layout in args.layouts:
            reference(data, args.out, layout, args.spike)
        _, startup, step = reference(data, args.out, args.layouts[0], args.spike)
        first = TINY_FIRST if args.tiny and not args.spike else ()  # (the spike variant: its own --faults)
        schedule = Schedule(args.seed, disk.mounted, startup, step, first=first)
        with open(args.out / "launches.log", "w", encoding="utf-8") as log:
            idx = 0
            # (--faults 0: the SLURM variants alone; --tiny: on until one of each kind was made)
            while sum(tally.faults.values()) < args.faults or schedule.first:
                if idx >= 4 * len(TINY_FIRST):  # (not reached: a stop 6 steps in readies every kind)
                    tally.violations.append(f"no fault of kind(s) {', '.join(schedule.first)} after {idx} episodes")
                    break
                layout = args.layouts[idx % len(args.layouts)]
                left = args.faults - sum(tally.faults.values())
                budget = args.faults_per_run if schedule.first else min(args.faults_per_run, left)
                episode(idx, layout, budget, data, args.out, disk, schedule, tally, args, log)
                idx += 1
        rows = []
        if args.slurm:
            why = slurm_ready(2 if "node-loss" in args.slurm else 1)
            if why:
                print(f"SLURM variants skipped: {why}", flush=True)
            with open(args.out / "slurm.log", "w", encoding="utf-8") as log:
                for variant in ([] if why else args.slurm):
                    bad, row = slurm_variant(variant, data, args.out, schedule.rng, log)
                    tally.violations += bad
                    rows.append(row)
    finally:
        disk.close()
    report(tally, args, time.monotonic() - t0, disk, args.out, rows)
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
