"""bench/linear_attention.py's growth and ratio columns: a peak that measures 0 MiB (a tiny step stays within the
pages resident before it) prints "-" instead of ending the bench with a ZeroDivisionError. The whole bench runs
in tests/test_benches.py (``--tiny``)."""

from __future__ import annotations

import pytest

from bench_scripts import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("linear_attention") as module:
        yield module


def test_growth_per_doubling_of_the_length(bench):
    assert bench.per_doubling([256, 512, 2048], [2.0, 8.0, 128.0]) == ["-", "4.00x", "4.00x"]


def test_a_zero_measurement_prints_a_dash_not_a_division_error(bench):
    assert bench.per_doubling([256, 512, 1024], [0.0, 3.0, 6.0]) == ["-", "-", "2.00x"]
    assert bench.over(9.0, 0.0) is None and bench.as_factor(bench.over(9.0, 0.0)) == "-"
    assert bench.as_factor(bench.over(9.0, 3.0)) == "3.00x"
