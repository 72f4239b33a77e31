"""MLflow: scalars as metrics of one MLflow run, text as artifacts; by default in a SQLite database in the run
directory, ``<dir>/mlflow.db``.

    roformer-train ... logging.sinks=[tensorboard,mlflow]
    mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db        # the full mlflow package

Settings: ``logging.mlflow.tracking_uri`` (``sqlite:///<dir>/mlflow.db``) and ``.experiment``
(``roformer-dist``); each one left empty takes MLflow's own environment variable (``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``) and then the default in brackets. The run is named after the run directory; a
metric's step is the optimizer step. The default is the store MLflow 3 supports: it keeps its file store
(``mlruns/``) in maintenance mode and refuses to open one unless ``MLFLOW_ALLOW_FILE_STORE`` is true. A run
directory that already has a file store (``<dir>/mlruns``, this sink's default before) keeps using it: this
sink then sets ``MLFLOW_ALLOW_FILE_STORE`` for its process (unless it is set already), and ``mlflow
migrate-filestore`` moves the store into a database. A SQLite store needs ``sqlalchemy`` and ``alembic``
(the ``mlflow`` extra installs them with ``mlflow-skinny``); MLflow creates its tables on first use (a few
seconds, once per run directory).

**One run across launches.** Its id and tracking URI are kept in ``<dir>/mlflow_run.json``; every launch
of the run directory (a requeue, a resume) logs into that run while the tracking URI is the same (another
URI, or a run deleted from the store, starts a new run). A launch marks it RUNNING, :meth:`close`
FINISHED.

**No step twice.** Every metric is written when it is logged (``log_batch(synchronous=True)``; nothing is
buffered, so :meth:`flush` has nothing to do). A launch resumed from step ``resume_step`` drops what the run
holds after that step (a fresh start, 0, keeps nothing), so ``get_metric_history`` equals an uninterrupted
run's: in a SQLite file the rows of the run's metrics after the step go (table ``metrics``), and each metric's
latest value is taken again from what is left (``latest_metrics``: the highest step, then timestamp, then
value, MLflow's own rule); in a file store each metric's file (``<root>/<experiment id>/<run id>/metrics/<key>``,
one ``timestamp value step`` line per value, the store's layout since MLflow 1) keeps the lines of steps <=
``resume_step``.

Limits: a tracking server or another database keeps what it was sent: there a resume after a hard kill logs
the steps after the checkpoint a second time beside the killed launch's values (a warning says so when a run
resumes). Text is one artifact per tag, ``text/<tag>.md``, replaced when logged again.

The metrics are a view of the run: a failure after the sink is open is logged once and this sink stops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from data_pipeline.atomic import atomic_write_text
from roformer_dist.runtime.rundir import RunDir

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "roformer-dist"


def _uri(directory: Path, configured: str) -> str:
    """``configured``, else the run directory's store: its file store where it has one, else its SQLite file."""
    if configured:
        return configured
    rd = RunDir(directory)
    return rd.mlruns.resolve().as_uri() if rd.mlruns.is_dir() else f"sqlite:///{rd.mlflow_db.resolve()}"


def _sqlite_file(uri: str):
    """The database file of a ``sqlite:///`` URI; None for any other store."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def _local_root(uri: str):
    """The file store's directory for a ``file:`` URI or a plain path; None for a server or database."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    if parsed.scheme == "" or re.fullmatch(r"[a-zA-Z]", parsed.scheme):  # a path (a Windows drive letter)
        return Path(uri)
    return None


def _client(uri: str):
    """An ``MlflowClient`` on ``uri``. MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is
    true (the store is in maintenance mode, not deprecated): a file store chosen here (the default) or in
    ``MLFLOW_TRACKING_URI`` turns it on for this process, unless it was set otherwise."""
    from mlflow.tracking import MlflowClient

    if _local_root(uri) is not None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def _step_of(line: str):
    """The step of a file store's metric line (``timestamp value [step [dataset digest]]``); None for a line
    cut short by a crash."""
    fields = line.split()
    if len(fields) < 2:
        return None
    try:
        return int(fields[2]) if len(fields) > 2 else 0
    except ValueError:
        return None


def _load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _drop_rows_after(database: Path, run_id: str, resume_step: int) -> None:
    """In MLflow's SQLite schema: the run's metric rows after ``resume_step`` deleted (all on a fresh start, 0),
    and each metric's latest value taken again from the rows left, in one transaction."""
    with sqlite3.connect(database) as db:
        db.execute("DELETE FROM metrics WHERE run_uuid = ? AND (? = 0 OR step > ?)", (run_id, resume_step, resume_step))
        db.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (run_id,))
        db.execute("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                   "SELECT key, value, timestamp, step, is_nan, run_uuid FROM ("
                   "  SELECT *, ROW_NUMBER() OVER (PARTITION BY key ORDER BY step DESC, timestamp DESC, value DESC)"
                   "  AS latest FROM metrics WHERE run_uuid = ?) WHERE latest = 1", (run_id,))
    db.close()


class MlflowSink:
    package = "mlflow"
    extra = "mlflow"

    def __init__(self, ctx):
        from mlflow.exceptions import MlflowException

        self.dir = Path(ctx.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = ctx.logging.mlflow
        configured = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        uri = _uri(self.dir, configured)
        self.client = _client(uri)
        state = _load_state(RunDir(self.dir).mlflow_run)
        run_id = state.get("run_id") if state.get("tracking_uri", "") == configured else None
        if run_id is not None:
            try:
                self.client.get_run(run_id)
            except MlflowException:
                log.warning("MLflow run %s is not in %s: a new run is started", run_id, uri)
                run_id = None
        if run_id is None:
            name = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=self.dir.resolve().name).info.run_id
            atomic_write_text(RunDir(self.dir).mlflow_run, json.dumps({"run_id": run_id, "tracking_uri": configured}) + "\n")
            self.run_id = run_id
            return  # a new run holds nothing to drop
        self.run_id = run_id
        self._call(self.client.update_run, run_id, status="RUNNING")
        self._call(self._drop_after, uri, ctx.resume_step)

    def _drop_after(self, uri: str, resume_step: int) -> None:
        """Keep each metric's values of steps <= ``resume_step`` (none on a fresh start): see the module docstring."""
        database = _sqlite_file(uri)
        if database is not None:
            _drop_rows_after(database, self.run_id, resume_step)
            return
        root = _local_root(uri)
        if root is None:
            log.warning("MLflow at %s cannot drop what earlier launches of run %s logged after step %d: if one got "
                        "further, those steps now have two values", uri, self.run_id, resume_step)
            return
        metrics = root / self.client.get_run(self.run_id).info.experiment_id / self.run_id / "metrics"
        if not metrics.is_dir():
            return
        for path in [p for p in metrics.rglob("*") if p.is_file()]:
            keep = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if resume_step and _step_of(line) is not None and _step_of(line) <= resume_step]
            if keep:
                atomic_write_text(path, "".join(line + "\n" for line in keep))
            else:
                path.unlink()  # the store reads a metric's latest value from its last line: no empty files

    def _call(self, fn, *args, **kw) -> None:
        if self.client is None:
            return
        try:
            fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - the MLflow run is a view of metrics.jsonl; never fatal
            log.warning("MLflow metrics stop here: %s", e)
            self.client = None

    def log_record(self, record: dict) -> None:
        pass

    def log_scalars(self, step: int, values: dict) -> None:
        if not values or self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(value), now, step) for tag, value in values.items()]
        self._call(self.client.log_batch, self.run_id, metrics=metrics, synchronous=True)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.client is not None:
            self._call(self.client.log_text, self.run_id, text, "text/" + re.sub(r"[^\w.-]", "_", tag) + ".md")

    def flush(self) -> None:
        pass  # every metric is written when it is logged

    def close(self) -> None:
        if self.client is not None:
            self._call(self.client.set_terminated, self.run_id)
            self.client = None

    @staticmethod
    def read(directory) -> dict[str, list[tuple[int, float]]]:
        """tag -> [(step, value)] in step order, as ``MlflowClient.get_metric_history`` gives them."""
        directory = Path(directory)
        state = _load_state(RunDir(directory).mlflow_run)
        client = _client(_uri(directory, state.get("tracking_uri", "")))
        out = {}
        for key in client.get_run(state["run_id"]).data.metrics:
            history = sorted(client.get_metric_history(state["run_id"], key), key=lambda m: (m.step, m.timestamp))
            out[key] = [(m.step, m.value) for m in history]
        return out
