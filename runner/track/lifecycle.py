"""A run's life in MLflow: opened (or reopened to resume), closed FINISHED, FAILED or KILLED.

MLflow leaves a run RUNNING when the process dies and only marks FINISHED at interpreter exit
(mlflow#10510), so tfmemlab sets the status itself: FINISHED, FAILED with the error and its
kind as tags, or KILLED after a signal; runs of the same job left RUNNING by a process that is
gone are marked KILLED at the next start. A tracking server that does not answer at start is a
one-line error within seconds (MLflow's own client retried silently for minutes).
"""

import contextlib
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from runner.core.diskfull import disk_full
from runner.core.errors import Interrupted
from runner.core.process import pid_alive
from runner.core.secrets import redact, redact_obj
from runner.track.client import client_for, experiment_id
from runner.track.server import check_reachable, sqlite_path
from runner.track.tracker import PENDING, Tracker, flatten


def failure_kind(err: BaseException) -> str:
    """oom | nan | disk_full | error: what made a job fail, as the `failure` tag (issues 7,
    27). A full disk first: TensorFlow raises ResourceExhaustedError for it too."""
    if disk_full(err) is not None:
        return "disk_full"
    tf = sys.modules.get("tensorflow")  # loaded by whatever ran out of memory; not imported here
    if tf is not None and isinstance(err, tf.errors.ResourceExhaustedError):
        return "oom"
    if isinstance(err, FloatingPointError):  # raised by the loop on a non-finite loss
        return "nan"
    return "error"


def _logged_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
    """The last step each metric of the run was logged at."""
    keys = client.get_run(run_id).data.metrics
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def close_lost_runs(client: MlflowClient, experiment: str, job: str, resuming: str | None) -> None:
    """Report, and mark KILLED, the runs of this job on this host left RUNNING by a process
    that is gone (SIGKILL, a crash of the machine's OOM killer): MLflow never cleans them up
    (mlflow#10510). The run `resuming` goes on instead."""
    for run in client.search_runs([experiment], "attributes.status = 'RUNNING'", max_results=200):
        tags = run.data.tags
        if tags.get("job") != job or run.info.run_id == resuming or not close_if_lost(client, run):
            continue
        run_dir = Path(tags.get("run_dir", "?"))
        has_checkpoint = (run_dir / "checkpoints" / "checkpoint").is_file()
        how = (
            f"go on from its last checkpoint with: python run.py trainer.resume={run_dir}"
            if has_checkpoint
            else "it wrote no checkpoint (trainer.checkpoint_every)"
        )
        print(
            f"tfmemlab: run {run.info.run_id} of this job was left RUNNING by process "
            f"{tags['pid']}, which is gone (killed): marked KILLED; {how}",
            file=sys.stderr,
            flush=True,
        )


def close_if_lost(client: MlflowClient, run: Run) -> bool:
    """Mark `run` KILLED, with a `lost` tag, if it is RUNNING on this host and its process is
    gone (MLflow never does: mlflow#10510); True if it was."""
    tags, host = run.data.tags, socket.gethostname()
    if run.info.status != "RUNNING" or tags.get("host") != host or "pid" not in tags:
        return False
    if pid_alive(int(tags["pid"])):
        return False
    client.set_tag(run.info.run_id, "lost", f"process {tags['pid']} on {host} gone")
    client.set_terminated(run.info.run_id, status="KILLED")
    return True


def close_lost_run(uri: str, run_id: str | None, run_dir: Path) -> str | None:
    """The status of a run that left no checkpoint, after close_if_lost: the run `run_id`, or
    (its run.json never written) the run whose `run_dir` tag is `run_dir`. None when the store
    is not there, does not answer, or has no such run: the caller's message stands without it."""
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # opening it would create an empty store
        return None
    try:
        check_reachable(uri)
        client = client_for(uri)
        if run_id is not None:
            run = client.get_run(run_id)
        else:
            experiments = [e.experiment_id for e in client.search_experiments()]
            found = client.search_runs(experiments, f"tags.run_dir = '{run_dir.resolve()}'")
            if not found:
                return None
            run = found[0]
        if close_if_lost(client, run):
            return "KILLED"
        return run.info.status
    except Exception:  # noqa: BLE001 - a lookup for a better message must not hide the real one
        return None


@contextlib.contextmanager
def mlflow_run(
    cfg: DictConfig,
    run_name: str,
    run_dir: Callable[[str], Path] | None = None,
    resume_run_id: str | None = None,
    job: str | None = None,
    tags: dict[str, str] | None = None,
):
    """Open a run (or reopen `resume_run_id`), yield a Tracker, and close the run FINISHED,
    FAILED, or KILLED when a signal or Ctrl-C stopped it (then re-raise).

    run_dir(run_id): the run's directory, where a remote run keeps what a lost server did
    not get (Tracker). A reopened run logs no metric at a step it already has. tags: set on a
    new run (a sweep's job: its parent run and job number, from runner/sweep/state.py)."""
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
            experiment, run_name=run_name, tags={**(tags or {}), **process, "job": job or ""}
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
            if not isinstance(err, Interrupted):
                tracker.set_tags(
                    {
                        "error": redact(f"{type(err).__name__}: {err}")[:5000],
                        "failure": failure_kind(err),
                    }
                )
        # A signal (Interrupted) or Ctrl-C is not the job's failure.
        stopped = isinstance(err, KeyboardInterrupt | Interrupted)
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
    """The resolved config as params and as an artifact, plus the overrides that made it; any
    login in them (the tracking URI's, a secret variable's value) redacted."""
    resolved = redact_obj(OmegaConf.to_container(cfg, resolve=True))
    tracker.log_params(flatten(resolved))
    tracker.log_text(OmegaConf.to_yaml(resolved), "config.yaml")
    tracker.log_text(redact("\n".join(overrides) + "\n"), "overrides.txt")


def say_if_lost(tracker, run_dir: Path) -> None:
    """After a run: where its figures are if the tracking server stopped answering during it,
    and the command that sends them once it is back."""
    if tracker.lost is not None:
        print(
            f"tfmemlab: the MLflow server stopped answering during this run "
            f"({redact(str(tracker.lost))}). "
            f"Its figures are in {run_dir / 'metrics.json'}, and what MLflow did not get in "
            f"{tracker.pending_path}; once the server is back, send them with:\n"
            f"  python -m runner.track.upload {run_dir}",
            flush=True,
        )
