"""The hang watchdog (``runtime/heartbeat.py``) allows a curriculum stage's switch and first step
``dist.first_step_timeout_s`` (the rotary measurement and compiling the stage take longer than any other step),
and every other point ``dist.hang_timeout_s``; the report names the limit that passed. Each case is a small
process (the watchdog ends its process with exit status 76)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from roformer_dist.config import load_config
from roformer_dist.errors import EXIT_HANG, ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _watch(tmp_path, body: str) -> tuple[int, str, float]:
    script = textwrap.dedent(f"""
        import time
        from roformer_dist.runtime.heartbeat import Heartbeat
        from roformer_dist.runtime.process_group import DistEnv
        hb = Heartbeat.armed({str(tmp_path)!r}, DistEnv(0, 1, 0), 1.0, lambda: None)
        """) + textwrap.dedent(body) + "\nhb.stop()\nprint('finished')\n"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def test_a_stages_first_step_may_take_its_allowance(tmp_path):
    code, out, _ = _watch(tmp_path, """
        hb.beat("stage.switch", 0, allow_s=6.0, setting="dist.first_step_timeout_s")
        time.sleep(2.5)            # 2.5 x hang_timeout_s: allowed
        hb.beat("step.end", 1)
        time.sleep(0.3)
        """)
    assert code == 0 and "finished" in out, out


def test_past_the_allowance_the_report_names_it_and_after_the_first_step_the_timeout_is_back(tmp_path):
    code, out, took = _watch(tmp_path / "a", """
        hb.beat("step", 0, allow_s=2.0, setting="dist.first_step_timeout_s, a stage's first step")
        time.sleep(30)
        """)
    assert code == EXIT_HANG and 2.0 < took < 20, (code, took, out)
    assert "hang: no progress for 2 s (dist.first_step_timeout_s, a stage's first step)" in out
    code, out, took = _watch(tmp_path / "b", """
        hb.beat("step", 0, allow_s=30.0, setting="dist.first_step_timeout_s")
        hb.beat("step.end", 1)     # an ordinary point: hang_timeout_s (1 s) again
        time.sleep(30)
        """)
    assert code == EXIT_HANG and took < 20 and "hang: no progress for 1 s (dist.hang_timeout_s)" in out, out


def test_the_allowance_must_stay_below_the_collective_timeout():
    assert load_config(overrides=["model.vocab_size=100"]).dist.first_step_timeout_s == 1200
    with pytest.raises(ConfigError, match=r"dist.first_step_timeout_s: 1800 must be .* below dist.timeout_s \(1800\)"):
        load_config(overrides=["model.vocab_size=100", "dist.first_step_timeout_s=1800"])
