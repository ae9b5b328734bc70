"""MLflow tracking: one run per job, written through an explicit MlflowClient.

The embedded default is a SQLite file (`sqlite:///outputs/mlflow.db`, no server); any other
URI (`MLFLOW_TRACKING_URI` or `mlflow.tracking_uri`) works the same. MLflow leaves a run
RUNNING when the process dies and only marks FINISHED at interpreter exit (mlflow#10510),
so the runner sets the status itself: FINISHED, or FAILED with the error as a tag.

Nothing is lost to the store (issue 16):
- a SQLite store is created under a lock beside it: MLflow's migrations, run by several
  processes at once on a fresh file, failed all of them and left the store broken;
- a tracking server that does not answer at start is a one-line error within seconds
  (MLflow's own client retried silently for minutes);
- a server that stops answering mid-run no longer stops the run: what the run would have
  sent is kept in its run directory (PENDING) and `python -m runner.track.upload <run dir>`
  sends it later.
"""

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from runner.track.server import REPAIR, TrackingError, check_reachable, remote, sqlite_path

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
        with open(self.pending_path, "a") as out:
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
        self._send(
            {"artifact": str(path), "artifact_path": artifact_path},
            lambda: self.client.log_artifact(self.run_id, str(path), artifact_path),
        )

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


def experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    db = sqlite_path(uri)
    # Keep a local store's artifacts beside its database, not in ./mlruns of whatever cwd.
    location = (db.parent.resolve() / "mlartifacts").as_uri() if db else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        # A run started at the same moment created it first.
        return client.get_experiment_by_name(name).experiment_id


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


@contextlib.contextmanager
def _store_lock(db: Path):
    """Hold an exclusive lock on <db>.lock: MLflow creates and migrates a fresh SQLite store
    on first use, and three processes doing so at once all failed (`table _alembic_tmp_tags
    already exists`) and left the store broken for every later run (issue 16)."""
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _broken_store(db: Path, err: Exception) -> TrackingError:
    return TrackingError(
        f"mlflow.tracking_uri=sqlite:///{db}: the store cannot be opened "
        f"({type(err).__name__}: {str(err).splitlines()[0][:160]}); `{REPAIR} {db}` backs it "
        "up and finishes its schema (no run is deleted)"
    )


def client_for(uri: str) -> MlflowClient:
    """A client of the store at `uri`; a SQLite store is created (or opened) under a lock, so
    runs started together on a fresh store all get it."""
    if remote(uri):
        # MLflow retries a failed request 7 times with backoff and waits 120 s for each: a
        # server lost mid-run would stall training for minutes at every call. These bounds
        # leave a slow server time to answer; the user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    with _store_lock(db):
        try:
            return MlflowClient(tracking_uri=uri)  # creates and migrates the store if need be
        except Exception as err:
            raise _broken_store(db, err) from err


PARENT_ENV = "TFMEMLAB_PARENT_RUN_ID"  # set by runner.track.sweep for the jobs of a sweep
JOB_ENV = "TFMEMLAB_JOB_NUM"  # set by run.py for a sweep job it runs in a fresh process


def failure_kind(err: BaseException) -> str:
    """oom | nan | error: what made a job fail, as the `failure` tag (issue 7)."""
    if type(err).__name__ == "ResourceExhaustedError":  # tf.errors, without importing TF
        return "oom"
    if isinstance(err, FloatingPointError):  # raised by runner/loop.py on a non-finite loss
        return "nan"
    return "error"


def sweep_of_job() -> dict | None:
    """The sweep this job belongs to ({"parent_run_id", "tracking_uri"}), or None.

    runner.track.sweep sets the parent in the environment, which the jobs' processes inherit
    (joblib, submitit, a Ray instance the sweep starts; sbatch passes it on); the job's own
    config then names the store (tracking_uri None). The workers of a Ray cluster started
    apart (`ray start`, hydra.launcher.ray.init.address) have neither the sweep's environment
    nor its MLFLOW_TRACKING_URI: they read both from the sweep folder's sweep.json.
    """
    if os.environ.get(PARENT_ENV):
        return {"parent_run_id": os.environ[PARENT_ENV], "tracking_uri": None}
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    from runner.sweep_resume import SWEEP_FILE

    # The job's folder is sweep.dir/subdir. Not sweep.dir itself: its ${now:...} would be
    # resolved again in the worker, at another time.
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    for folder in [job_dir, *job_dir.parents][:4]:
        try:
            record = json.loads((folder / SWEEP_FILE).read_text())
            return {k: record[k] for k in ("parent_run_id", "tracking_uri")}
        except (OSError, ValueError, KeyError):
            continue
    return None


def _sweep_tags() -> dict[str, str]:
    """Tags that make a sweep's job a child of the sweep's parent run, with its job number."""
    sweep = sweep_of_job()
    if sweep is None:
        return {}
    parent = sweep["parent_run_id"]
    from hydra.core.hydra_config import HydraConfig

    tags = {"mlflow.parentRunId": parent, "sweep_id": parent}
    if JOB_ENV in os.environ:  # a job run in a process of its own (run.py, sweep.isolate)
        tags["job_num"] = os.environ[JOB_ENV]
    elif HydraConfig.initialized():
        tags["job_num"] = str(HydraConfig.get().job.num)
    return tags


def _logged_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
    """The last step each metric of the run was logged at."""
    keys = client.get_run(run_id).data.metrics
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def close_lost_runs(client: MlflowClient, experiment: str, job: str, resuming: str | None) -> None:
    """Report, and mark KILLED, the runs of this job on this host left RUNNING by a process
    that is gone (SIGKILL, a crash of the machine's OOM killer): MLflow never cleans them up
    (mlflow#10510). The run `resuming` goes on instead."""
    host = socket.gethostname()
    for run in client.search_runs([experiment], "attributes.status = 'RUNNING'", max_results=200):
        tags = run.data.tags
        if tags.get("job") != job or tags.get("host") != host or "pid" not in tags:
            continue
        if run.info.run_id == resuming or pid_alive(int(tags["pid"])):
            continue
        run_dir = Path(tags.get("run_dir", "?"))
        has_checkpoint = (run_dir / "checkpoints" / "checkpoint").is_file()
        how = (
            f"go on from its last checkpoint with: python run.py trainer.resume={run_dir}"
            if has_checkpoint
            else "it wrote no checkpoint (trainer.checkpoint_every)"
        )
        client.set_tag(run.info.run_id, "lost", f"process {tags['pid']} on {host} gone")
        client.set_terminated(run.info.run_id, status="KILLED")
        print(
            f"tfmemlab: run {run.info.run_id} of this job was left RUNNING by process "
            f"{tags['pid']}, which is gone (killed): marked KILLED; {how}",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def mlflow_run(
    cfg: DictConfig,
    run_name: str,
    run_dir: Callable[[str], Path] | None = None,
    resume_run_id: str | None = None,
    job: str | None = None,
):
    """Open a run (or reopen `resume_run_id`), yield a Tracker, and close the run FINISHED,
    FAILED, or KILLED when a signal or Ctrl-C stopped it (then re-raise).

    run_dir(run_id): the run's directory, where a remote run keeps what a lost server did
    not get (Tracker). A reopened run logs no metric at a step it already has."""
    uri = cfg.mlflow.tracking_uri
    check_reachable(uri)
    client = client_for(uri)
    if resume_run_id is None:
        experiment = experiment_id(client, cfg.mlflow.experiment, uri)
    else:
        experiment = client.get_run(resume_run_id).info.experiment_id
    if job is not None:
        close_lost_runs(client, experiment, job, resume_run_id)
    process = {"host": socket.gethostname(), "pid": str(os.getpid())}  # close_lost_runs reads
    if resume_run_id is None:
        run = client.create_run(
            experiment, run_name=run_name, tags={**_sweep_tags(), **process, "job": job or ""}
        )
    else:
        run = client.get_run(resume_run_id)
        run_name = run.info.run_name
        client.update_run(resume_run_id, status="RUNNING")
        client.log_batch(resume_run_id, tags=[RunTag(k, v) for k, v in process.items()])
    pending = run_dir(run.info.run_id) / PENDING if run_dir is not None else None
    tracker = Tracker(client, run.info.run_id, experiment, run_name, pending)
    if run_dir is not None:
        tracker.set_tags({"run_dir": str(run_dir(run.info.run_id).resolve())})
    if resume_run_id is not None:
        tracker.logged = _logged_steps(client, resume_run_id)
    monitor = _system_metrics(cfg, run.info.run_id)
    try:
        yield tracker
    except BaseException as err:
        with contextlib.suppress(Exception):  # never let logging hide the real error
            tracker.flush()
            if type(err).__name__ != "Interrupted":
                tracker.set_tags(
                    {"error": f"{type(err).__name__}: {err}"[:5000], "failure": failure_kind(err)}
                )
        # A signal (runner.resume.Interrupted) or Ctrl-C is not the job's failure.
        stopped = isinstance(err, KeyboardInterrupt) or type(err).__name__ == "Interrupted"
        tracker.terminate("KILLED" if stopped else "FAILED")
        raise
    finally:
        if monitor is not None:
            monitor.finish()
    tracker.flush()
    tracker.terminate("FINISHED")


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
