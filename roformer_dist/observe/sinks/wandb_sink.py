"""Weights & Biases: scalars and text in one W&B run, offline by default, under ``<dir>/wandb``.

    roformer-train ... logging.sinks=[tensorboard,wandb] logging.wandb.project=roformer
    wandb sync <run_dir>/wandb          # afterwards, from a machine that can reach W&B

Settings: ``logging.wandb.mode`` (``offline``; ``online`` streams as it goes, see the limits; ``disabled``),
``.project`` (``roformer-dist``) and ``.entity``; each one left empty takes W&B's own environment variable
(``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_ENTITY``) and then the default in brackets. The run is
named after the run directory; every scalar row carries ``trainer/step``, the x-axis of every chart
(``define_metric``), so W&B's own ``_step`` (a row counter) never matters. Text (the resolved config, the
mixture) becomes ``text/<tag>.md`` among the run's files.

**One run across launches.** Its id is kept in ``<dir>/wandb_run.json``; every launch of the run directory
(a requeue, a resume) logs into that id (``resume="allow"``).

**Segments, because W&B buffers.** W&B's transaction log (``run-<id>.wandb``) is written in 32 KiB blocks
and the last, partial block reaches the file only when the run finishes: a process killed after
``run.log`` leaves nothing of the last block on disk, and W&B has no call that writes it out. So
:meth:`flush` finishes the W&B run, and the next event opens it again (same id) in a new directory,
``<dir>/wandb/offline-run-<time>-<id>[-n]``: a *segment*. ``wandb_run.json`` lists the finished segments in
order with the last step each holds; a segment enters the list only once finished. A finish and a start
take ~0.01 s and ~0.1 s (checkpoints are minutes apart); ``wandb sync`` uploads the segments of one run id
one after the other in the order they started, as that run. W&B's terminal lines are silenced for the
process (``wandb.setup``): each segment would print its banner.

**No step twice.** A launch resumed from step ``resume_step`` sets aside, before it logs anything:
the listed segments holding steps after ``resume_step`` (a launch killed between a checkpoint's flush and
its commit, an older checkpoint chosen over a damaged newer one), and every segment of the run not in the
list (one a killed launch left open or unfinished). Setting aside renames ``run-<id>.wandb`` to
``run-<id>.wandb.dropped``: ``wandb sync`` and :meth:`read` skip it; nothing is deleted. What a set-aside,
finished segment holds up to ``resume_step`` is read back (:meth:`read`) and logged again into a new first
segment, finished before the list is switched to it. So the listed segments hold each step once and in
increasing order: what they show equals an uninterrupted run's, and so does what ``wandb sync`` uploads.
A fresh start (``resume_step`` 0) sets everything aside.

Limits: what is logged after the last flush of a launch that ends hard (SIGKILL, a crash) never reaches
W&B: steps after its newest checkpoint, which a resume drops anyway (a step's eval comes before its save),
but which a run that is not resumed then lacks in W&B (TensorBoard's writer may have them). Segments
already uploaded (``wandb sync`` while the run trains, or ``WANDB_MODE=online``, which streams as it goes)
cannot be taken back: on W&B's server a resume after a hard kill may then show the steps after the
checkpoint twice. W&B's service process (``wandb-core``, in a session of its own: a terminal's Ctrl-C does
not reach it) ignores SIGUSR2 but ends at once on SIGTERM or SIGINT (SLURM sends SIGTERM to every process
of a job step at the time limit, or at a preemption without ``--signal``): the open segment is lost, the
steps since the last checkpoint are missing from W&B (never doubled) and this sink stops for the launch;
the stop protocol's SIGUSR2 comes first. Console output is not captured (each rank's log is in
``<run_dir>/logs``); system metrics are.

:meth:`read` reads the listed segments with W&B's own transaction-log reader (``wandb leet inspect``, which
prints the records as protobuf text when its output is not a terminal; about a second per segment).

The events are a view of the run: a failure after the sink is open is logged once and this sink stops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import string
import subprocess
import sys
from pathlib import Path

from data_pipeline.atomic import atomic_write_text
from roformer_dist.runtime.rundir import RunDir

log = logging.getLogger(__name__)

STEP_KEY = "trainer/step"
"""The history key holding the optimizer step of a row (the charts' x-axis)."""

DROPPED = ".dropped"
"""Suffix of the transaction log of a segment set aside."""

DEFAULT_PROJECT = "roformer-dist"

READ_TIMEOUT_S = 120


def _load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _log_file(wandb_dir: Path, segment: str, run_id: str) -> Path:
    return wandb_dir / segment / f"run-{run_id}.wandb"


class WandbSink:
    package = "wandb"
    extra = "wandb"

    def __init__(self, ctx):
        import wandb

        self._wandb = wandb
        self.dir = Path(ctx.dir)
        self.settings = ctx.logging.wandb
        self.dir.mkdir(parents=True, exist_ok=True)
        self.wandb_dir = RunDir(self.dir).wandb
        self.state_path = RunDir(self.dir).wandb_run
        state = _load_state(self.state_path)
        alphabet = string.ascii_lowercase + string.digits
        self.run_id = state.get("run_id") or "".join(secrets.choice(alphabet) for _ in range(8))
        self.segments: list[dict] = []
        self.run = None  # the open segment's W&B run
        self._last = 0  # the highest step logged into the open segment
        self._texts: dict[str, int] = {}  # tag -> step, of the open segment
        self._failed = False
        self._call(self._resume, state, ctx.resume_step)

    def _resume(self, state: dict, r: int) -> None:
        """Set aside what holds steps after ``r`` (everything when 0), carrying its steps <= ``r`` over."""
        kept = [s for s in state.get("segments", []) if r and s["last"] <= r]
        carried: dict[str, list] = {}
        texts: dict[str, tuple[int, str]] = {}
        for seg in state.get("segments", []):
            if seg in kept or not r:
                continue
            try:  # what a set-aside segment holds up to resume_step goes into the new first segment
                for tag, events in _read_segment(_log_file(self.wandb_dir, seg["dir"], self.run_id)).items():
                    carried.setdefault(tag, []).extend(e for e in events if e[0] <= r)
                files = self.wandb_dir / seg["dir"] / "files"
                for tag, step in seg.get("texts", {}).items():
                    if step <= r:
                        texts[tag] = (step, (files / _text_name(tag)).read_text("utf-8"))
            except Exception as e:  # noqa: BLE001 - a view: what cannot be read back is not carried
                log.warning("W&B: steps <= %d of segment %s are not carried into the resumed run: %s", r, seg["dir"], e)
        self.segments = kept
        if carried or texts:
            rows: dict[int, dict] = {}
            for tag, events in carried.items():
                for step, value in events:
                    rows.setdefault(step, {})[tag] = value
            for step in sorted(rows):
                self.log_scalars(step, rows[step])
            for tag, (step, text) in texts.items():
                self.log_text(tag, text, step)
            self.flush()  # the list switches to the carried segment only once it is finished
        self._save()
        self._set_aside_unlisted()

    # ------------------------------------------------------------------ segments
    def _save(self) -> None:
        state = {"run_id": self.run_id, "segments": self.segments}
        atomic_write_text(self.state_path, json.dumps(state, indent=1) + "\n")

    def _set_aside_unlisted(self) -> None:
        listed = {s["dir"] for s in self.segments}
        for path in self.wandb_dir.glob(f"*/run-{self.run_id}.wandb"):
            if path.parent.name not in listed and not path.parent.is_symlink():  # W&B's latest-run link
                path.rename(path.with_name(path.name + DROPPED))

    def _open_segment(self):
        if self.run is None:
            wandb = self._wandb
            # W&B's terminal lines are set per process: without this, every segment prints its banner and that
            # `resume` is ignored offline (it is recorded in the segment, for ``wandb sync``)
            wandb.setup(settings=wandb.Settings(silent=True))
            self.run = wandb.init(
                dir=str(self.dir), id=self.run_id, resume="allow", name=self.dir.resolve().name,
                project=self.settings.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                entity=self.settings.entity or os.environ.get("WANDB_ENTITY") or None,
                mode=self.settings.mode or os.environ.get("WANDB_MODE") or "offline",
                settings=wandb.Settings(console="off", silent=True, use_dot_wandb=False))
            self.run.define_metric(STEP_KEY)
            self.run.define_metric("*", step_metric=STEP_KEY)
            self._last, self._texts = 0, {}
        return self.run

    def _call(self, fn, *args) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the W&B run is a view of metrics.jsonl; never fatal
            log.warning("W&B events stop here: %s", e)
            self._failed = True

    def _log(self, step: int, values: dict) -> None:
        run = self._open_segment()
        run.log({STEP_KEY: step, **values})
        self._last = max(self._last, step)

    def _text(self, tag: str, text: str, step: int) -> None:
        run = self._open_segment()
        path = Path(run.dir) / _text_name(tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        run.save(str(path), base_path=run.dir, policy="now")
        self._texts[tag] = step
        self._last = max(self._last, step)

    def _finish(self) -> None:
        run, self.run = self.run, None
        run.finish()
        self.segments.append({"dir": Path(run.settings.sync_dir).name, "last": self._last, "texts": self._texts})
        self._save()

    # ------------------------------------------------------------------ the Sink protocol
    def log_record(self, record: dict) -> None:
        pass

    def log_scalars(self, step: int, values: dict) -> None:
        if values:
            self._call(self._log, step, values)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        self._call(self._text, tag, text, step)

    def flush(self) -> None:
        if self.run is not None:
            self._call(self._finish)

    def close(self) -> None:
        self.flush()

    @staticmethod
    def read(directory) -> dict[str, list[tuple[int, float]]]:
        """tag -> [(step, value)] in step order, from the listed segments, as W&B's reader gives them."""
        directory = Path(directory)
        state = _load_state(RunDir(directory).wandb_run)
        out: dict[str, list] = {}
        for seg in state.get("segments", []):
            for tag, events in _read_segment(_log_file(RunDir(directory).wandb, seg["dir"], state["run_id"])).items():
                out.setdefault(tag, []).extend(events)
        return {tag: sorted(events, key=lambda e: e[0]) for tag, events in out.items()}


def _text_name(tag: str) -> str:
    return "text/" + re.sub(r"[^\w.-]", "_", tag) + ".md"


def _read_segment(path: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of one finished segment's transaction log, read by ``wandb leet inspect``."""
    from google.protobuf import text_format
    from wandb.proto import wandb_internal_pb2

    if not path.is_file():
        raise FileNotFoundError(f"no W&B transaction log {path}")
    # an unfinished log makes the reader wait for more (it follows live runs): only finished segments come here
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(path)], capture_output=True,
                          text=True, timeout=READ_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {path} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    out: dict[str, list] = {}
    for chunk in re.split(r"(?m)^# record \d+: [^\n]*\n", proc.stdout):
        if not chunk.strip():
            continue
        record = text_format.Parse(chunk, wandb_internal_pb2.Record())
        if not record.HasField("history"):
            continue
        row = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        step = row.pop(STEP_KEY, None)
        if step is None:
            continue
        for tag, value in row.items():
            if not tag.startswith("_"):
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                out.setdefault(tag, []).append((int(step), float(value) if number else value))
    return out
