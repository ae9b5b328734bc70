"""A Hydra sweep as one MLflow experiment: a parent run, a child run per job, a report.

Registered in conf/config.yaml under hydra.callbacks. At multirun start it creates the
store and the parent run once, before any job starts (a fresh SQLite store created by
several processes at once crashes: six processes on a new store failed every time here,
as hydraflow#245 reports), and hands the parent's id to
the jobs through the environment (inherited by joblib's worker processes too). At multirun
end it names each child run by what differs between it and the baseline (the label
runner.track.compare gives it), writes the comparison table (CSV, Markdown) and pictures into the
sweep directory and the parent run, prints the table, and closes the parent run.
"""

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from runner.core.errors import BusyError
from runner.core.lock import FolderLock
from runner.core.secrets import redact, redact_logs, scrub_files
from runner.report.sweep_plots import report_files
from runner.sweep import repeats
from runner.sweep.state import PARENT_ENV, read_sweep_file, resume_command, write_sweep_file
from runner.track import compare, deploy_compare, spread
from runner.track.client import client_for, experiment_id, ui_hint


class SweepCallback(Callback):
    lock: FolderLock | None = None

    def __getstate__(self) -> dict:
        """What a launcher (joblib, submitit, Ray) sends to its workers with each job: the
        sweep folder's lock stays with the process that holds it (it cannot be pickled, and
        only that process releases it at the sweep's end)."""
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        """Hydra has written the command line into the job's folder (and the sweep's): take
        any login out of those files before the job runs (issue 27)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        redact_logs()
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.output_subdir is not None:
            scrub_files(Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            scrub_files(Path(hydra_cfg.sweep.dir), ("multirun.yaml",))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        redact_logs()  # Hydra logs each job's overrides as it launches it
        uri = config.mlflow.tracking_uri
        shown = redact(uri)
        sweep_dir = Path(config.hydra.sweep.dir)
        # The sweep folder is this process's until the sweep ends (runner/core/lock.py): a
        # second sweep.resume, or a sweep started in the same second, changes nothing.
        key = f"sweep.resume={sweep_dir}" if config.sweep.resume else f"hydra.sweep.dir={sweep_dir}"
        self.lock = FolderLock(sweep_dir, key)
        try:
            self.lock.__enter__()
        except BusyError as err:
            raise SystemExit(f"error: {err}") from None
        repeats.order_repeats(config)  # sweep.repeats: A B A B (runner/sweep/repeats.py)
        client = client_for(uri)
        if config.sweep.resume:  # the same parent run, reopened (runner/sweep/resume.py)
            parent_id = read_sweep_file(sweep_dir)["parent_run_id"]
            try:
                parent = client.get_run(parent_id)
            except Exception:
                raise SystemExit(
                    f"error: sweep.resume={sweep_dir}: its parent run {parent_id} is not in "
                    f"{shown}; point MLFLOW_TRACKING_URI at the store the sweep logged to"
                ) from None
            client.update_run(parent_id, status="RUNNING")
            if "stopped" in parent.data.tags:  # by a signal, the last time
                client.delete_tag(parent_id, "stopped")
            client.set_tag(parent_id, "resumed", time.strftime("%Y-%m-%d %H:%M:%S"))
            repeats.mark_stopped(client, sweep_dir, "RUNNING")
            os.environ[PARENT_ENV] = parent_id
            print(f"tfmemlab: resuming sweep {parent_id} in {sweep_dir} -> {shown}", flush=True)
            return
        experiment = experiment_id(client, config.mlflow.experiment, uri)
        overrides = redact(" ".join(config.hydra.overrides.task))
        parent = client.create_run(
            experiment, run_name=f"sweep: {overrides}", tags={"sweep": "parent"}
        )
        os.environ[PARENT_ENV] = parent.info.run_id
        write_sweep_file(
            sweep_dir,
            parent.info.run_id,
            uri,
            config.mlflow.experiment,
            list(config.hydra.overrides.task),
            list(config.hydra.overrides.hydra),
        )
        if config.sweep.repeats > 1:
            repeats.create_job_runs(client, experiment, parent.info.run_id, sweep_dir, config)
        print(
            f"tfmemlab: sweep {parent.info.run_id} -> {shown}, experiment "
            f"'{config.mlflow.experiment}'"
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        try:
            self._report(config)
        finally:
            if self.lock is not None:
                self.lock.__exit__(None, None, None)

    def _report(self, config: DictConfig) -> None:
        parent_id = os.environ.pop(PARENT_ENV, None)
        if parent_id is None:
            return
        client = client_for(config.mlflow.tracking_uri)
        sweep_dir = Path(config.hydra.sweep.dir)
        repeats.aggregate(client, sweep_dir)  # each job's run: its repeats' medians
        runs, rows, deployed = comparison(client, parent_id, config.sweep)
        name_runs(client, runs, rows)
        for run, row in zip(runs, rows, strict=True):  # a job's run says what its repeats found
            if "repeats" in run.data.tags:
                note = spread.job_note(row, compare.RATIOS)
                client.set_tag(run.info.run_id, "mlflow.note.content", note)
                for rep in spread.repeats(client, run):  # named after their job, too
                    name = f"{row['job']} (repeat {rep.data.tags['repeat']})"
                    client.update_run(rep.info.run_id, name=name)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for path in report_files(rows, Path(tmp), deployed):
                client.log_artifact(parent_id, str(path), artifact_path="report")
                (sweep_dir / path.name).write_bytes(path.read_bytes())
        failed = [r["job"] for r in rows if r["status"] != "FINISHED"]
        summary = _summary(config, client, parent_id, rows, failed, sweep_dir, deployed)
        # The parent's page in the MLflow UI says in words what the sweep found.
        client.set_tag(parent_id, "mlflow.note.content", summary)
        client.set_tag(parent_id, "failed_jobs", str(len(failed)))
        client.set_terminated(parent_id, status="FINISHED")
        print(summary)


def comparison(client: MlflowClient, parent_id: str, sweep) -> tuple[list[Run], list, list]:
    """The sweep's jobs, their comparison rows, divided by its `sweep.baseline`, with the
    groups it compares on purpose (`sweep.varies`) not marked unlike, and the comparison's
    deployment part (deploy=litert jobs; [] when no job measured one)."""
    runs = compare.sweep_runs(client, parent_id)
    repeats = spread.finished(client, runs)  # each job's repeats (sweep.repeats)
    rows = compare.rows(runs, sweep.baseline, list(sweep.varies), repeats)
    base = compare.baseline_run(runs, sweep.baseline)
    deployed = deploy_compare.rows(runs, [row["job"] for row in rows], base, repeats)
    return runs, rows, deployed


def stop(uri: str, signum: int) -> None:
    """The sweep's process got SIGTERM or SIGINT during the current job, which has checkpointed
    and stopped: mark the parent run KILLED, say how to go on, and exit with 128 + signum
    (the jobs after it do not start)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    sweep_dir, job_num = Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
    parent_id = os.environ.pop(PARENT_ENV, None)
    if parent_id is not None:
        client = client_for(uri)
        name = signal.Signals(signum).name
        client.set_tag(parent_id, "stopped", f"{name} during job {job_num}")
        client.set_terminated(parent_id, status="KILLED")
        repeats.mark_stopped(client, sweep_dir, "KILLED")
    print(
        f"tfmemlab: sweep stopped by {signal.Signals(signum).name} during job {job_num}; go on "
        f"with: {resume_command(sweep_dir)}",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signum)


def _summary(config, client, parent_id, rows, failed, sweep_dir, deployed) -> str:
    """The comparison table, where the report is, and how to open the comparison in the UI."""
    uri = config.mlflow.tracking_uri
    experiment = client.get_run(parent_id).info.experiment_id
    command, url = ui_hint(uri, experiment)
    lines = [
        compare.text(rows),
        *([deploy_compare.text(deployed, deploy_compare.base_label(rows))] if deployed else []),
        f"tfmemlab: sweep {parent_id}: {len(rows)} jobs, {len(failed)} failed; report in "
        f"{sweep_dir} and in the parent run's artifacts (report/)",
    ]
    if command:
        lines.append(f"  open the UI: {command}")
    lines.append(f"  then: {url} (expand the parent run '{parent_id}' to compare its jobs)")
    return "\n".join(lines)


def name_runs(client: MlflowClient, runs: list[Run], rows: list[dict]) -> None:
    """Rename each child run to its label; its overrides stay in the tag `overrides`."""
    for run, row in zip(runs, rows, strict=True):
        if run.info.run_name == row["job"]:
            continue
        if "overrides" not in run.data.tags:
            client.set_tag(run.info.run_id, "overrides", run.info.run_name)
        client.update_run(run.info.run_id, name=row["job"])
        # The run's description (its end-of-run summary) names the run: say the new name.
        note = run.data.tags.get("mlflow.note.content")
        if note:
            old = f"run '{run.info.run_name}'"
            new = f"run '{row['job']}' (overrides: {run.info.run_name})"
            client.set_tag(run.info.run_id, "mlflow.note.content", note.replace(old, new))
