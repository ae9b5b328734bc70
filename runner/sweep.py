"""A Hydra sweep as one MLflow experiment: a parent run, a child run per job, a report.

Registered in conf/config.yaml under hydra.callbacks. At multirun start it creates the
store and the parent run once, before any job starts (a fresh SQLite store created by
several processes at once crashes: shared GUIDE, hydraflow#245), and hands the parent's id to
the jobs through the environment (inherited by joblib's worker processes too). At multirun
end it writes the comparison table (CSV, Markdown) and plots into the sweep directory and the
parent run, prints the table, and closes the parent run.
"""

import os
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner import compare
from runner.bench import table
from runner.tracking import PARENT_ENV, client_for, experiment_id


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        uri = config.mlflow.tracking_uri
        client = client_for(uri)
        experiment = experiment_id(client, config.mlflow.experiment, uri)
        overrides = " ".join(config.hydra.overrides.task)
        parent = client.create_run(
            experiment, run_name=f"sweep: {overrides}", tags={"sweep": "parent"}
        )
        os.environ[PARENT_ENV] = parent.info.run_id
        print(
            f"tfmemlab: sweep {parent.info.run_id} -> {uri}, experiment "
            f"'{config.mlflow.experiment}'"
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        parent_id = os.environ.pop(PARENT_ENV, None)
        if parent_id is None:
            return
        client = client_for(config.mlflow.tracking_uri)
        rows = compare.rows(compare.sweep_runs(client, parent_id), config.sweep.baseline)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for path in report_files(rows, Path(tmp)):
                client.log_artifact(parent_id, str(path), artifact_path="report")
                (sweep_dir / path.name).write_bytes(path.read_bytes())
        failed = [r["job"] for r in rows if r["status"] != "FINISHED"]
        client.set_tag(parent_id, "failed_jobs", str(len(failed)))
        client.set_terminated(parent_id, status="FINISHED")
        print(table(rows, compare.columns(rows)))
        print(
            f"tfmemlab: sweep {parent_id}: {len(rows)} jobs, {len(failed)} failed; report in "
            f"{sweep_dir} and in the parent run's artifacts (report/)"
        )


def report_files(rows: list[dict], out_dir: Path) -> list[Path]:
    return [
        compare.write_csv(rows, out_dir / "comparison.csv"),
        compare.write_markdown(rows, out_dir / "comparison.md"),
        *compare.plots(rows, out_dir),
    ]
