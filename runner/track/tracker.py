"""The tracker a run logs through: buffered metrics, params, tags and artifacts of one MLflow
run, written through an explicit MlflowClient.

Nothing is lost to a server that stops answering mid-run (issue 16): with a remote store, what
the run would have sent is kept in its run directory (PENDING), training goes on, and
`python -m runner.track.upload <run dir>` sends it later.
"""

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from runner.core.diskfull import disk_full, writing
from runner.track.server import remote

_BATCH = 500  # metrics per log_batch call; well under MLflow's 1000 limit


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, the shape of MLflow params."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


PENDING = "mlflow_pending.jsonl"  # in the run directory: what a lost server did not get


class Tracker:
    """Buffers step metrics and writes them in batches: one SQLite write per step is slow.

    With a remote store and a `pending` path, a call the server does not answer switches the
    tracker to that file: this and every later call are appended to it as JSON lines, to be
    sent by `python -m runner.track.upload`, and training goes on.
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        experiment_id: str = "",
        name: str = "",
        pending: Path | None = None,
    ):
        self.client, self.run_id = client, run_id
        self.experiment_id, self.run_name = experiment_id, name
        self._pending: list[Metric] = []
        self.pending_path = pending if pending is not None and remote(client.tracking_uri) else None
        self.lost: str | None = None  # why the server was given up on, once it was
        self.logged: dict[str, int] = {}  # a resumed run's last logged step per metric

    def _send(self, record: dict, call: Callable[[], Any]) -> None:
        """call() against the store, or `record` appended to the pending file once the
        server has stopped answering."""
        if self.lost is None:
            try:
                call()
                return
            except Exception as err:
                if self.pending_path is None:
                    raise
                self.lost = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                print(
                    f"tfmemlab: warning: the MLflow server at {self.client.tracking_uri} "
                    f"stopped answering ({self.lost}); training goes on, and what this run "
                    f"logs from now is kept in {self.pending_path}",
                    file=sys.stderr,
                    flush=True,
                )
        self.pending_path.parent.mkdir(parents=True, exist_ok=True)
        with writing(self.pending_path), open(self.pending_path, "a") as out:
            out.write(
                json.dumps({"uri": self.client.tracking_uri, "run_id": self.run_id, **record})
                + "\n"
            )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue metrics at `step`; a resumed run skips those it logged before it stopped
        (the steps after its last checkpoint, run again)."""
        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if step > self.logged.get(k, -1)
        ]
        if len(self._pending) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:_BATCH], self._pending[_BATCH:]
            record = {"metrics": [[m.key, m.value, m.timestamp, m.step] for m in chunk]}
            self._send(
                record, lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk)
            )

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            batch = items[i : i + 100]
            self._send(
                {"params": {p.key: p.value for p in batch}},
                lambda batch=batch: self.client.log_batch(self.run_id, params=batch),
            )

    def set_tags(self, tags: dict[str, Any]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        self._send(
            {"tags": tags},
            lambda: self.client.log_batch(
                self.run_id, tags=[RunTag(k, v) for k, v in tags.items()]
            ),
        )

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file the run wrote; while the server is lost, its path is kept instead
        (run-directory files stay where they are)."""
        path = Path(path).resolve()
        try:
            self._send(
                {"artifact": str(path), "artifact_path": artifact_path},
                lambda: self.client.log_artifact(self.run_id, str(path), artifact_path),
            )
        except Exception as err:  # a full disk under a local artifact store names it (issue 27)
            full = disk_full(err, self._artifact_dir(path.name))
            if full is None:
                raise
            raise full from err

    def _artifact_dir(self, name: str) -> str:
        """Where MLflow copies this run's artifact `name` (a local artifact store's path)."""
        try:
            uri = self.client.get_run(self.run_id).info.artifact_uri
        except Exception:
            return f"artifact {name} of run {self.run_id}"
        return f"{uri.removeprefix('file://')}/{name}"

    def log_text(self, text: str, name: str) -> None:
        if self.lost is not None:  # a temporary file would be gone before the upload
            self._send({"text": text, "name": name}, lambda: None)
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self._send(
                {"text": text, "name": name},
                lambda: self.client.log_artifact(self.run_id, str(path)),
            )

    def log_inputs(self, datasets: list) -> None:
        """The run's datasets (mlflow.entities.DatasetInput, runner/track/datasets.py). While
        the server is lost they are dropped (upload does not send them; their digests are
        tags, which it does)."""
        names = [d.dataset.name for d in datasets]
        self._send(
            {"inputs": names}, lambda: self.client.log_inputs(self.run_id, datasets=datasets)
        )

    def log_model(self, log: Callable[[], str]) -> str | None:
        """Log a model with `log()` (runner/track/model.py), which returns its URI; None when
        the server is lost, before or during the call (the model file stays in the run
        directory; upload does not send it)."""
        uri: list[str] = []
        self._send({"model": "in the run directory only"}, lambda: uri.append(log()))
        return uri[0] if uri else None

    def terminate(self, status: str) -> None:
        now = int(time.time() * 1000)
        self._send(
            {"status": status, "end_time": now},
            lambda: self.client.set_terminated(self.run_id, status=status, end_time=now),
        )


class WorkerTracker(Tracker):
    """A multi-worker job's non-chief worker: it logs nothing (issue 18: only the chief logs
    to MLflow); the figures it measures reach the chief's run through the strategy's
    collectives (runner/techniques/distribution.py), and its run directory keeps its own."""

    def __init__(self, name: str):
        super().__init__(client=None, run_id="", name=name)

    def _send(self, record: dict, call: Callable[[], Any]) -> None:
        pass
