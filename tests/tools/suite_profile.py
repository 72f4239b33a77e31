"""Where the test suite's time goes: per test file and per fixture, wall seconds; per file, the processes it
started, the rank processes among them and the seconds each rank spent before its first training step.

    python tests/tools/suite_profile.py run --out /tmp/prof [-- PYTEST_ARGS...]   # the suite, probed, then the report
    python tests/tools/suite_profile.py report /tmp/prof                          # the report of a run again

``run`` runs the suite as ``make test`` does (tests/tools/lanes.py: its three lanes) with this folder's
``suite_probe`` first on PYTHONPATH: its ``sitecustomize`` writes one line per Python process of the run
(pytest's, every rank, every CLI and bench; SLURM jobs included, they inherit the environment). The test and
fixture times are the lanes' own (tests/conftest.py). ``pytest --durations`` alone cannot count launches. A *rank* is a process that set up a torch.distributed process group; its
start-up is the seconds from the kernel starting it to its first training step (or to its process group
when it trains no step), split into the imports of torch and DeepSpeed, the process group and the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from lanes import json_lines  # this folder is on sys.path when run as a script

PROBE = Path(__file__).resolve().parent / "suite_probe"
REPO = Path(__file__).resolve().parents[2]


def _file_of(test: str) -> str:
    return test.split("::", 1)[0] if test else "(outside tests)"


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def report(out: Path, top: int = 0) -> str:
    records = [r for p in sorted(out.glob("*.jsonl")) if p.name != "processes.jsonl" for r in json_lines(p)]
    tests = [r for r in records if r.get("kind") == "test"]
    fixtures = [r for r in records if r.get("kind") == "fixture"]
    procs = json_lines(out / "processes.jsonl")
    by_file: dict = defaultdict(lambda: {"s": 0.0, "tests": set(), "procs": 0, "ranks": 0, "startup": []})
    for r in tests:
        f = by_file[_file_of(r["test"])]
        f["s"] += r["s"]
        f["tests"].add(r["test"])
    ranks = []
    for p in procs:
        f = by_file[_file_of(p["test"].rsplit(" ", 1)[0])]
        f["procs"] += 1
        m = p["marks"]
        if "process_group" in m:
            f["ranks"] += 1
            ready = m.get("first_step", m["process_group"])
            f["startup"].append(ready)
            ranks.append(m)
    rows = sorted(by_file.items(), key=lambda kv: -kv[1]["s"])
    total = sum(v["s"] for v in by_file.values())
    lines = [f"{'file':<42} {'wall s':>8} {'share':>6} {'tests':>6} {'procs':>6} {'ranks':>6} "
             f"{'start med s':>11} {'start sum s':>11}"]
    for name, v in rows[:top or None]:
        lines.append(f"{name:<42} {v['s']:>8.1f} {v['s'] / total if total else 0:>6.1%} {len(v['tests']):>6} "
                     f"{v['procs']:>6} {v['ranks']:>6} {_median(v['startup']):>11.2f} {sum(v['startup']):>11.1f}")
    all_startup = [s for v in by_file.values() for s in v["startup"]]
    lines.append(f"{'total':<42} {total:>8.1f} {'':>6} {sum(len(v['tests']) for v in by_file.values()):>6} "
                 f"{len(procs):>6} {len(all_startup):>6} {_median(all_startup):>11.2f} {sum(all_startup):>11.1f}")
    lines.append("(wall s: setup + call + teardown of the file's tests, summed; a session fixture counts where it "
                 "is first built)")
    sessions = [r for r in records if r.get("kind") == "session"]
    if sessions:
        wall = max(r["end"] for r in sessions) - min(r["start"] for r in sessions)
        lines.append(f"the session's wall time: {wall:.1f} s ({len(sessions)} pytest process(es) beside each other)")
    cpu = sum(p.get("cpu_s", 0.0) for p in procs)
    if cpu and sessions:
        lines.append(f"CPU time of the Python processes started: {cpu:.0f} s ({cpu / wall:.2f} cores busy on "
                     "average over the session)")
    if ranks:
        lines.append("")
        lines.append(f"rank start-up, {len(ranks)} ranks, median seconds from the process's start:")
        for key in ("torch", "deepspeed", "process_group", "engine", "first_step"):
            xs = [m[key] for m in ranks if key in m]
            if xs:
                lines.append(f"  {key:<14} {_median(xs):6.2f}  (in {len(xs)} ranks)")
    fx: dict = defaultdict(lambda: [0, 0.0, ""])
    for r in fixtures:
        e = fx[r["name"]]
        e[0] += 1
        e[1] += r["s"]
        e[2] = r["scope"]
    lines.append("")
    lines.append(f"{'fixture':<32} {'scope':<9} {'set-ups':>7} {'total s':>8}")
    for name, (n, s, scope) in sorted(fx.items(), key=lambda kv: -kv[1][1])[:25]:
        if s >= 1.0:
            lines.append(f"{name:<32} {scope:<9} {n:>7} {s:>8.1f}")
    return "\n".join(lines)


def run(out: Path, pytest_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "processes.jsonl").unlink(missing_ok=True)
    env = dict(os.environ, ROFORMER_PROBE_LOG=str(out / "processes.jsonl"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH", "")])))
    code = subprocess.call([sys.executable, str(Path(__file__).with_name("lanes.py")), "--results", str(out), "--",
                            *pytest_args], cwd=REPO, env=env)
    print(report(out))
    return code


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run pytest probed, then print the report")
    r.add_argument("--out", type=Path, required=True, help="folder for the probe's files")
    r.add_argument("pytest_args", nargs="*", help="pytest's arguments (after --)")
    p = sub.add_parser("report", help="the report of an earlier run")
    p.add_argument("out", type=Path)
    p.add_argument("--top", type=int, default=0, help="only the slowest N files")
    a = ap.parse_args(argv)
    if a.command == "run":
        return run(a.out, a.pytest_args)
    print(report(a.out, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
