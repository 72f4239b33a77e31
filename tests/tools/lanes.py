"""``make test``: the suite in three lanes at once, and at the end the slowest test files and the wall time.

    python tests/tools/lanes.py [--results DIR] [--coverage COV_DIR] [-- PYTEST_ARGS...]

- The main lane (``pytest -m "not side"``: the trainer, faults, commands, docs... one test at a time, as always)
  writes to the terminal.
- The waiting lane (``-m "side and (slurm or wall_clock)"``): the SLURM tests, which mostly wait for the local
  cluster (its scheduling, requeues and time limits), then the tests whose checks read wall time (hang
  timeouts, straggler ratios, signals between steps): the fault campaign's tiny runs, the faults' and the stops'
  tests.
- The bench lane (``-m "side and not slurm and not wall_clock"``): the other benches' tiny runs, each a process
  tree of its own, and the tests that compile on CPU, at a lower CPU priority (``nice`` :data:`NICE`, inherited
  by every process it starts).

Which files go beside the main lane, and to which lane: ``BESIDE_MAIN`` in tests/conftest.py.

On 2 cores, two lanes left the CPU 23 % idle over a run, nearly all of it in the first 12 minutes, while the
SLURM tests waited; after that the CPU was saturated. A third lane at the same priority filled the idle time
but took the cores from the main lane, the critical path, and made the suite slower (22.8 and 24.5 minutes). At
a lower priority the benches take what the other two lanes leave and give it back as soon as they want it.
The other lanes write their output to DIR/<lane>.log, whose end is printed once all are done; each lane writes its
test times to DIR/<lane>.jsonl (tests/conftest.py: ROFORMER_TEST_TIMES), from which the
end of the output lists the ten slowest files, each lane's wall time and how much of the CPU stayed idle
(``/proc/stat``: the share of time the suite waited rather than computed). Exit status: the first failing
lane's (0 when all passed; a lane with no test selected by PYTEST_ARGS counts as passed). ``--coverage``: each
lane under ``coverage run --data-file=COV_DIR/<lane>/cov`` (``make coverage`` combines the main lane's alone
and all lanes').
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LANES = {"main": ["-m", "not side", "--durations=15"],
         "waiting": ["-m", "side and (slurm or wall_clock)", "-p", "no:cacheprovider"],
         "bench": ["-m", "side and not slurm and not wall_clock", "-p", "no:cacheprovider"]}
"""Each lane's pytest selection; the first writes to the terminal, the others to DIR/<lane>.log."""
NICE = {"bench": 5}
"""Lanes started at a lower CPU priority (``os.nice`` increment). At 5 a process gets about a third of what a
normal one gets of a contended core (Linux's weights: 335 against 1024); at 10, a tenth, and a bench's tiny run
could then wait past its timeout while the other lanes keep both cores busy for minutes. No test that reads wall
time (``wall_clock``) runs in such a lane."""
NO_TESTS = 5
"""pytest's exit status when nothing was selected."""


def json_lines(path: Path) -> list[dict]:
    """A file's JSON lines; none where it does not exist, a line cut by a process killed while writing left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_times(results: Path) -> dict[str, list[dict]]:
    """Each lane's JSON lines (tests/conftest.py's records)."""
    return {lane: json_lines(results / f"{lane}.jsonl") for lane in LANES}


def slowest_files(times: dict[str, list[dict]], top: int = 10) -> str:
    """The ``top`` slowest test files (setup + call + teardown of their tests) with their lane, each lane's wall
    time and the suite's."""
    files: dict = defaultdict(float)
    lane_of = {}
    for lane, lines in times.items():
        for r in lines:
            if r.get("kind") == "test":
                name = r["test"].split("::", 1)[0]
                files[name] += r["s"]
                lane_of[name] = lane
    rows = sorted(files.items(), key=lambda kv: -kv[1])[:top]
    out = [f"the {len(rows)} slowest test files:"]
    out += [f"  {s:7.1f} s  {name}  ({lane_of[name]} lane)" for name, s in rows]
    spans = {}
    for lane, lines in times.items():
        sessions = [r for r in lines if r.get("kind") == "session"]
        if sessions:
            spans[lane] = (sessions[-1]["start"], sessions[-1]["end"])
    if spans:
        lanes = ", ".join(f"{lane} lane {end - start:.0f} s" for lane, (start, end) in spans.items())
        total = max(end for _, end in spans.values()) - min(start for start, _ in spans.values())
        out.append(f"the tests' wall time: {total:.0f} s ({total / 60:.1f} min; {lanes})")
    return "\n".join(out)


def cpu_times(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(idle, total) clock ticks of all cores since boot (Linux's /proc/stat; iowait counts as idle), or None."""
    try:
        fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields)


def idle_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """The share of the CPU left idle between two ``cpu_times``: where the suite waits rather than computes."""
    if before is None or after is None or after[1] <= before[1]:
        return ""
    return f"; the CPU {100 * (after[0] - before[0]) / (after[1] - before[1]):.0f} % idle"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=REPO / ".test_results", help="where the lanes' logs and times go")
    ap.add_argument("--coverage", type=Path, default=None,
                    help="run each lane under coverage.py, its data in COVERAGE/<lane>/")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    a = ap.parse_args(argv)
    a.results.mkdir(parents=True, exist_ok=True)
    for lane in LANES:
        (a.results / f"{lane}.jsonl").unlink(missing_ok=True)

    def command(lane: str, basetemp: Path) -> list[str]:
        cov = []
        if a.coverage:
            (a.coverage / lane).mkdir(parents=True, exist_ok=True)
            cov = ["coverage", "run", f"--data-file={a.coverage / lane / 'cov'}", "-m"]
        return [sys.executable, "-m", *cov, "pytest", "-q", *LANES[lane], f"--basetemp={basetemp}", *a.pytest_args]

    def env(lane: str) -> dict:
        return {**os.environ, "ROFORMER_TEST_TIMES": str(a.results / f"{lane}.jsonl")}

    first, *others = LANES
    cpu_at_start = cpu_times()
    with tempfile.TemporaryDirectory(prefix="roformer-tests-") as tmp, contextlib.ExitStack() as logs:
        side = {}
        for lane in others:
            out = logs.enter_context(open(a.results / f"{lane}.log", "w", encoding="utf-8"))
            nice = NICE.get(lane, 0)
            side[lane] = subprocess.Popen(command(lane, Path(tmp) / lane), cwd=REPO, env=env(lane), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=(lambda n=nice: os.nice(n)) if nice else None)
        codes = {first: subprocess.call(command(first, Path(tmp) / first), cwd=REPO, env=env(first))}
        for lane, proc in side.items():
            if proc.poll() is None:
                print(f"\nthe {lane} lane is still running ({a.results / f'{lane}.log'})...", flush=True)
            codes[lane] = proc.wait()
    for lane in others:
        text = (a.results / f"{lane}.log").read_text(encoding="utf-8", errors="replace").splitlines()
        print(f"\n--- the {lane} lane (pytest {' '.join(LANES[lane][:2])}; its whole output: "
              f"{a.results / f'{lane}.log'}) ---")
        print("\n".join(text[-25:]))
    print()
    print(slowest_files(read_times(a.results)) + idle_share(cpu_at_start, cpu_times()), flush=True)
    codes = [0 if c == NO_TESTS else c for c in codes.values()]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
