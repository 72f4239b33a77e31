"""tests/tools/lanes.py: its lanes, and its summary (the slowest files with their lane, the wall time, and the CPU left
idle)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))

from lanes import LANES, NICE, cpu_times, idle_share, slowest_files  # noqa: E402


def test_the_idle_share_is_the_idle_ticks_over_all_ticks_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    before = cpu_times(stat)
    assert before == (850, 1000)
    stat.write_text("cpu  400 0 150 1100 150 0 0 0 0 0\n")
    assert idle_share(before, cpu_times(stat)) == "; the CPU 50 % idle"  # (300 + 100) idle of 800 ticks
    assert idle_share(before, None) == "" and idle_share(None, before) == ""
    assert cpu_times(tmp_path / "absent") is None


def test_the_slowest_files_name_their_lane_and_the_wall_time_spans_the_lanes():
    times = {"main": [{"kind": "test", "test": "tests/a.py::t1", "s": 5.0},
                      {"kind": "test", "test": "tests/a.py::t2", "s": 1.0},
                      {"kind": "session", "start": 100.0, "end": 160.0}],
             "side": [{"kind": "test", "test": "tests/b.py::t", "s": 9.0},
                      {"kind": "session", "start": 101.0, "end": 190.0}]}
    out = slowest_files(times, top=2).splitlines()
    assert out[1].split() == ["9.0", "s", "tests/b.py", "(side", "lane)"]
    assert out[2].split() == ["6.0", "s", "tests/a.py", "(main", "lane)"]
    assert out[3] == "the tests' wall time: 90 s (1.5 min; main lane 60 s, side lane 89 s)"


def test_every_test_runs_in_exactly_one_lane_and_none_that_reads_wall_time_runs_niced():
    """Each lane's ``-m`` expression over every combination of the markers it reads (pytest's marker expressions
    are Python's and/or/not over marker names): exactly one lane selects each; a ``wall_clock`` test never lands in
    a lane started at a lower priority."""
    names = ("side", "slurm", "wall_clock")
    for values in itertools.product((False, True), repeat=len(names)):
        marks = dict(zip(names, values))
        chosen = [lane for lane, args in LANES.items()
                  if eval(args[args.index("-m") + 1], {}, dict(marks))]  # noqa: S307 - the lanes' own expressions
        assert len(chosen) == 1, (marks, chosen)
        if marks["wall_clock"]:
            assert NICE.get(chosen[0], 0) == 0, (marks, chosen)
