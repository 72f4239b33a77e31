"""bench/chaos.py's oracle: an episode's run against the uninterrupted run of its layout (every step once and
bit-equal, the final weights, TensorBoard's scalars, nothing left behind; in the spike variant with ``skip``, the
injected spikes marked), and what the launch that received a fault must have done (a slowed rank: named as a
straggler, not taken for a hang)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional

from _chaos_launch import (HANG_TIMEOUT_S, SLOW_LOG_STEPS, SLOW_STOPPED, SPIKE_AT, TOTAL_STEPS, Fault, Launch, metrics,
                           read_latest)

from roformer_dist.errors import EXIT_DONE, EXIT_HANG, EXIT_STORAGE

STOP_SIGNALS = {"term-group", "int-group", "usr2-group"}
LEFTOVER = re.compile(r"^\..+\.tmp\d+-[0-9a-f]{8}$|^\.written\.\d+$|^\.failed\.\d+$|^\.write_probe\.\d+$")
"""Temporary files and markers of the writers (data_pipeline/atomic.py, checkpoint/async_save.py, store.check_writable)."""


def oracle(run_dir: Path, ref_dir: Path, spike: Optional[str] = None) -> list[str]:
    """What differs from the uninterrupted run, or is left behind; [] when nothing. ``spike``: the spike variant's
    policy (its reference run has the same): with ``skip`` each injected step must be marked ``"spike": true``
    (after a rollback the records are rewound: only the comparison with the reference holds)."""
    import torch

    from roformer_dist.checkpoint.store import resolve
    from roformer_dist.checkpoint.weights import load_checkpoint_weights
    from roformer_dist.runtime.events import read_scalars

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # its notes on the purges resumes ask for
    bad = []
    got, want = metrics(run_dir), metrics(ref_dir)
    steps = [r["step"] for r in got]
    if steps != list(range(1, TOTAL_STEPS + 1)):
        bad.append(f"metrics.jsonl: steps {steps}, expected 1..{TOTAL_STEPS} once each")
    for a, b in zip(got, want):
        for key in ("loss", "mlm_acc", "tokens_seen", "seq_len", "stage", "spike"):
            if a.get(key) != b.get(key):
                bad.append(f"metrics.jsonl step {a['step']}: {key} {a.get(key)!r}, uninterrupted {b.get(key)!r}")
                break
    if spike == "skip":
        unmarked = [s for s in SPIKE_AT if not any(r["step"] == s and r.get("spike") is True for r in got)]
        if unmarked:
            bad.append(f"metrics.jsonl: the injected spike(s) at step(s) {unmarked} not marked \"spike\": true")
    try:
        _, sd = load_checkpoint_weights(resolve(run_dir))
        _, ref = load_checkpoint_weights(resolve(ref_dir))
        differ = [k for k in ref if k not in sd or not torch.equal(sd[k], ref[k])]
        if differ or sd.keys() != ref.keys():
            bad.append(f"final weights differ from the uninterrupted run's: {differ[:5]}")
    except Exception as e:  # noqa: BLE001 - any failure to read the final checkpoint is a finding
        bad.append(f"final checkpoint unreadable: {type(e).__name__}: {e}")
    tb, ref_tb = read_scalars(run_dir / "tb"), read_scalars(ref_dir / "tb")
    for tag in sorted(set(tb) | set(ref_tb)):
        a, b = tb.get(tag, []), ref_tb.get(tag, [])
        steps, ref_steps = [s for s, _ in a], [s for s, _ in b]
        if tag.startswith("perf/"):  # measurements of each launch: a stop saves at a step of its own
            if sorted(set(steps)) != steps or not set(ref_steps) <= set(steps):
                bad.append(f"TensorBoard {tag}: steps {steps}, uninterrupted {ref_steps}")
        elif steps != ref_steps:
            bad.append(f"TensorBoard {tag}: steps {steps}, uninterrupted {ref_steps}")
        elif [v for _, v in a] != [v for _, v in b]:
            bad.append(f"TensorBoard {tag}: values differ from the uninterrupted run's")
    for p in run_dir.rglob("*"):
        if LEFTOVER.match(p.name):
            bad.append(f"left behind: {p.relative_to(run_dir)}")
    root = run_dir / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if re.fullmatch(r"step_\d{8}", d.name) and not (d / "COMPLETE").exists():
            bad.append(f"incomplete checkpoint left: {d.name}")
    if (run_dir / "run.lock.json").exists():
        bad.append("the lock record run.lock.json is left after the run completed")
    if read_latest(run_dir) != f"step_{TOTAL_STEPS:08d}":
        bad.append(f"latest names {read_latest(run_dir)}, not the last step")
    return bad


def expectations(fault: Fault, result: Launch) -> list[str]:
    """What the launch that received ``fault`` must have done."""
    bad = []
    # a stop is seen at the step boundary after the signal, and the end of the run wins over a stop: a signal
    # while the last two steps run may end the run with 0
    if fault.signal_kind in STOP_SIGNALS and result.rc == EXIT_DONE \
            and fault.steps_at_signal < TOTAL_STEPS - 2:
        bad.append(f"a stop signal after step {fault.steps_at_signal} was ignored: the run went on to the end")
    if fault.kind == "disk-full" and result.rc not in (EXIT_STORAGE, EXIT_DONE):
        bad.append(f"full disk: exit {result.rc}, expected {EXIT_STORAGE} (a storage error)")
    if fault.kind == "disk-full" and result.rc == EXIT_STORAGE and "No space left on device" not in result.out:
        bad.append("full disk: exit 74 without naming the full disk")
    if fault.stopped_at_s is not None:
        if result.rc != EXIT_HANG:
            bad.append(f"a stopped rank: exit {result.rc}, expected {EXIT_HANG} (the hang watchdog's)")
        elif result.wall_s - fault.stopped_at_s > HANG_TIMEOUT_S + 30:
            bad.append(f"a stopped rank: the launch ended {result.wall_s - fault.stopped_at_s:.0f} s after it, more "
                       f"than dist.hang_timeout_s {HANG_TIMEOUT_S} + 30 s")
    if fault.slowing is not None:  # (delivered: the warning was due, or came)
        if result.rc == EXIT_HANG:
            bad.append(f"a slowed rank (stopped {100 * SLOW_STOPPED:.0f} % of the time, never for long): the hang "
                       f"watchdog ended the launch")
        if fault.expect_named and not fault.named:
            bad.append(f"a slowed rank: no straggler warning named rank {fault.slowed_rank} in "
                       f"{fault.log_steps_slowed} log steps after the slowing began (due after {SLOW_LOG_STEPS})")
    if fault.flipped_step is not None and result.resumed_from == fault.flipped_step:
        bad.append(f"resumed from step {fault.flipped_step}, whose checkpoint had a flipped bit")
    return bad
