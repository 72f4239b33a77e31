"""How long `roformer-train` takes from its start to the ranks' first training step (the debug config, 2 ranks).

    python bench/startup.py                      # this checkout, 5 launches
    python bench/startup.py --against a364ee2    # beside another commit (a git worktree), launches alternating
    python bench/startup.py --tiny               # one launch each, tiny shard sets

Each launch is `python -m roformer_dist.cli.train --config configs/experiments/debug.yaml` with
`trainer.stop_at_step=1`, no eval, no save, a fresh run directory, on the debug shard sets (`make debug`'s,
built in a temporary directory when missing). Its start-up is the time from just before the process starts to
the start of step 1 on rank 0: the step's record in metrics.jsonl has when the host finished it (`time`) and
the step's own seconds (`step_time_s`). The figure is the median over the launches; with --against, the other
checkout's launches run alternately with this one's (the same machine, the same load) and the ratio is printed.
The other checkout runs with this environment's packages, its own code first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEBUG_CONFIG, REPO, load_average, parser, peoples_daily_lines, print_table, result, \
    roformer_data, tiny_defaults, tiny_dir, tiny_shards


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--launches", type=int, default=5, help="launches per checkout (the figure is their median)")
    p.add_argument("--against", default="", help="a commit to measure beside this checkout (a git worktree)")
    p.add_argument("--ranks", type=int, default=2, help="dist.world_size")
    p.add_argument("--data", type=Path, default=REPO / "data" / "debug",
                   help="the debug shard sets (train/ and eval/; built here when missing)")
    tiny_defaults(p, argv, launches=1, data=lambda: tiny_dir() / "data")
    return p.parse_args(argv)


def debug_data(out: Path, tiny: bool) -> Path:
    """The debug experiment's train set (People's Daily lines 1-2000, vocabulary 4000), as `make debug` builds it."""
    if tiny:
        return tiny_shards(out)[0]
    train = out / "train"
    if not (train / "manifest.json").exists():
        src = peoples_daily_lines(out / "pd_train.txt", (0, 2000))
        roformer_data("prepare", "--input", str(src), "--vocab-size", "4000", "--out", str(train),
                      "--max-docs-per-shard", "250", "--no-progress")
    return train


def launch(code: Path, shards: Path, ranks: int, work: Path) -> float:
    """One launch of the checkout ``code``; its seconds from the process's start to rank 0's first step."""
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code) + (os.pathsep + os.environ["PYTHONPATH"]
                                                    if os.environ.get("PYTHONPATH") else "")}
    cmd = [sys.executable, "-m", "roformer_dist.cli.train", "--config", str(code / DEBUG_CONFIG.relative_to(REPO)),
           f"data.shards={shards}", "data.eval_shards=", f"run_dir={run}", f"dist.world_size={ranks}",
           "trainer.stop_at_step=1", "trainer.eval_every=0", "trainer.save_every=0", "checkpoint.resume=false"]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"startup: the launch of {code} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return first["time"] - first["step_time_s"] - t0


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    checkouts = {"this checkout": REPO}
    try:
        if a.against:
            other = work / "against"
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), a.against], cwd=REPO, check=True)
            checkouts = {a.against: other, **checkouts}
        shards = debug_data(a.data, a.tiny)
        print(f"roformer-train -> first step, debug config, {a.ranks} ranks, {a.launches} launch(es) per checkout; "
              f"load average {load_average()}", flush=True)
        times: dict[str, list[float]] = {name: [] for name in checkouts}
        for _ in range(a.launches):
            for name, code in checkouts.items():
                times[name].append(launch(code, shards, a.ranks, work))
        rows = [[name, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}", len(t)]
                for name, t in times.items()]
        print_table(["checkout", "median s", "min s", "max s", "launches"], rows)
        ours = statistics.median(times["this checkout"])
        fields = {"seconds": round(ours, 3), "launches": a.launches, "ranks": a.ranks}
        if a.against:
            before = statistics.median(times[a.against])
            print(f"this checkout / {a.against}: {ours / before:.2f}x")
            fields.update(against=a.against, against_seconds=round(before, 3), ratio=round(ours / before, 3))
        result("startup", **fields)
    finally:
        if a.against:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "against")], cwd=REPO,
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
