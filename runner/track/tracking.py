"""MLflow tracking: one run per job, written through an explicit MlflowClient.

The embedded default is a SQLite file (`sqlite:///outputs/mlflow.db`, no server); any other
URI (`MLFLOW_TRACKING_URI` or `mlflow.tracking_uri`) works the same. MLflow leaves a run
RUNNING when the process dies and only marks FINISHED at interpreter exit (mlflow#10510),
so the runner sets the status itself: FINISHED, or FAILED with the error as a tag.
"""

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

_BATCH = 500  # metrics per log_batch call; well under MLflow's 1000 limit


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, the shape of MLflow params."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


class Tracker:
    """Buffers step metrics and writes them in batches: one SQLite write per step is slow."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str = "", name: str = ""):
        self.client, self.run_id = client, run_id
        self.experiment_id, self.run_name = experiment_id, name
        self._pending: list[Metric] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self._pending) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:_BATCH], self._pending[_BATCH:]
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self.client.log_artifact(self.run_id, str(path))


def experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    db = _sqlite_path(uri)
    # Keep a local store's artifacts beside its database, not in ./mlruns of whatever cwd.
    location = (db.parent.resolve() / "mlartifacts").as_uri() if db else None
    return client.create_experiment(name, artifact_location=location)


def ui_hint(uri: str, experiment: str, run_id: str | None = None) -> tuple[str | None, str]:
    """(the command that serves the MLflow UI on this store or None, the page's URL).

    MLflow 3.17's UI opens an experiment on its GenAI overview; `workflowType=machine_learning`
    opens the runs table (shared GUIDE).
    """
    page = f"#/experiments/{experiment}/runs" + (f"/{run_id}" if run_id else "")
    page += "?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return None, f"{uri.rstrip('/')}/{page}"
    return f"mlflow ui --backend-store-uri {uri}", f"http://127.0.0.1:5000/{page}"


def client_for(uri: str) -> MlflowClient:
    db = _sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


PARENT_ENV = "TFMEMLAB_PARENT_RUN_ID"  # set by runner.track.sweep for the jobs of a sweep
JOB_ENV = "TFMEMLAB_JOB_NUM"  # set by run.py for a sweep job it runs in a fresh process


def failure_kind(err: BaseException) -> str:
    """oom | nan | error: what made a job fail, as the `failure` tag (issue 7)."""
    if type(err).__name__ == "ResourceExhaustedError":  # tf.errors, without importing TF
        return "oom"
    if isinstance(err, FloatingPointError):  # raised by runner/loop.py on a non-finite loss
        return "nan"
    return "error"


def _sweep_tags() -> dict[str, str]:
    """Tags that make a sweep's job a child of the sweep's parent run, with its job number."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return {}
    from hydra.core.hydra_config import HydraConfig

    tags = {"mlflow.parentRunId": parent, "sweep_id": parent}
    if JOB_ENV in os.environ:  # a job run in a process of its own (run.py, sweep.isolate)
        tags["job_num"] = os.environ[JOB_ENV]
    elif HydraConfig.initialized():
        tags["job_num"] = str(HydraConfig.get().job.num)
    return tags


@contextlib.contextmanager
def mlflow_run(cfg: DictConfig, run_name: str):
    """Open a run, yield a Tracker, and close the run FINISHED or FAILED (then re-raise)."""
    uri = cfg.mlflow.tracking_uri
    client = client_for(uri)
    experiment = experiment_id(client, cfg.mlflow.experiment, uri)
    run = client.create_run(experiment, run_name=run_name, tags=_sweep_tags())
    tracker = Tracker(client, run.info.run_id, experiment, run_name)
    monitor = _system_metrics(cfg, run.info.run_id)
    try:
        yield tracker
    except BaseException as err:
        with contextlib.suppress(Exception):  # never let logging hide the real error
            tracker.flush()
            tracker.set_tags(
                {"error": f"{type(err).__name__}: {err}"[:5000], "failure": failure_kind(err)}
            )
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        client.set_terminated(run.info.run_id, status=status)
        raise
    finally:
        if monitor is not None:
            monitor.finish()
    tracker.flush()
    client.set_terminated(run.info.run_id, status="FINISHED")


def _system_metrics(cfg: DictConfig, run_id: str):
    """MLflow's CPU/GPU/RAM sampler (mlflow.system_metrics=true), bound to this run's store."""
    if not cfg.mlflow.system_metrics:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=cfg.mlflow.system_metrics_interval_s,
        tracking_uri=cfg.mlflow.tracking_uri,
    )
    monitor.start()
    return monitor


def log_config(tracker: Tracker, cfg: DictConfig, overrides: list[str]) -> None:
    """The resolved config as params and as an artifact, plus the overrides that made it."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    tracker.log_params(flatten(resolved))
    tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
    tracker.log_text("\n".join(overrides) + "\n", "overrides.txt")
