"""The run directory: `run.json` names the MLflow run, the job and its resolved config, so that
`trainer.resume=<run dir>|latest` finds the run and builds the same job (issue 16).

`trainer.resume` restores the last checkpoint (runner/train/checkpoint.py) into the job as
built, and goes on in the same MLflow run from the step after it: no step the checkpoint holds
is run again, and no (metric, step) pair the run already has is logged again. Everything here
is read without TensorFlow, so the command line checks a resume before TensorFlow loads.
"""

import json
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ResumeError
from runner.core.secrets import redact, redact_obj, strip_userinfo

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
# Overrides that do not change the job trained.
NOT_THE_JOB = ("trainer.resume", "sweep.resume", "hydra.")


def job_key(overrides: list[str]) -> str:
    """The job a command line describes: its overrides, sorted, less those that do not change
    what is trained (trainer.resume, hydra.*)."""
    kept = sorted(o for o in overrides if not o.lstrip("+~").startswith(NOT_THE_JOB))
    return redact(" ".join(kept)) or "default"  # a tag and run.json's: no login in it


@dataclass
class ResumePoint:
    run_dir: Path
    run_id: str
    tracking_uri: str
    job: str
    config: DictConfig  # the resolved config the run was started with


def write_run_file(run_dir: Path, run_id: str, cfg: DictConfig, overrides: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "run_id": run_id,
        "tracking_uri": cfg.mlflow.tracking_uri,
        "job": job_key(overrides),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    # The store's URI without its login: a resume takes the login again (_store_uri).
    (run_dir / RUN_FILE).write_text(json.dumps(redact_obj(record), indent=2))


def _store_uri(saved: str, overrides: list[str]) -> str:
    """The URI of the store a resumed run logged to (run.json's, without a login), with the
    login of this command's own URI (an override, else MLFLOW_TRACKING_URI) if that points
    at the same store; otherwise MLflow's client takes MLFLOW_TRACKING_USERNAME/PASSWORD."""
    given = [o.partition("=")[2] for o in overrides if o.startswith("mlflow.tracking_uri=")]
    for uri in [*given, os.environ.get("MLFLOW_TRACKING_URI", "")]:
        if uri and strip_userinfo(uri) == saved:
            return uri
    return saved


def _has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINTS / "checkpoint").is_file()


def newest_folder(root: Path, name: str, wanted: Callable[[dict, Path], bool]) -> Path | None:
    """The folder under `root` whose JSON file `name` is newest among those `wanted(record,
    folder)` accepts; unreadable files are passed over."""
    found = []
    for path in root.glob(f"**/{name}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if wanted(record, path.parent):
            found.append((path.stat().st_mtime, path.parent))
    return max(found)[1] if found else None


def latest_run_dir(job: str, root: Path = Path("outputs")) -> Path | None:
    """The newest run directory under `root` of the job `job` that holds a checkpoint."""
    return newest_folder(
        root, RUN_FILE, lambda record, folder: record.get("job") == job and _has_checkpoint(folder)
    )


def _checkpointed_step(run_dir: Path) -> int | None:
    """The optimizer step of the run's last checkpoint, from the manager's index
    (`model_checkpoint_path: "ckpt-<step>"`), read without TensorFlow."""
    index = (run_dir / CHECKPOINTS / "checkpoint").read_text()
    match = re.search(r'^model_checkpoint_path: ".*ckpt-(\d+)"', index, re.MULTILINE)
    return int(match.group(1)) if match else None


def locate(resume: str, overrides: list[str]) -> ResumePoint:
    """The run `trainer.resume=<resume>` continues: a run directory, or `latest` (the newest
    one of this job). Checked before TensorFlow is imported."""
    job = job_key(overrides)
    if resume == "latest":
        run_dir = latest_run_dir(job)
        if run_dir is None:
            raise ResumeError(
                f"trainer.resume=latest: no run directory of the job '{job}' under outputs/ "
                "holds a checkpoint (set trainer.checkpoint_every, or stop a run with SIGTERM)"
            )
    else:
        run_dir = Path(resume)
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise ResumeError(f"trainer.resume={resume}: no {RUN_FILE} there; expected a run directory")
    if not _has_checkpoint(run_dir):
        raise ResumeError(f"trainer.resume={resume}: the run there wrote no checkpoint")
    record = json.loads(path.read_text())
    if job != "default" and job != record["job"]:
        raise ResumeError(
            f"trainer.resume={resume}: that run trained the job '{record['job']}', not '{job}'"
            " (give only trainer.resume=<run dir> to continue it as it was)"
        )
    config = OmegaConf.create(record["config"])
    uri = config.mlflow.tracking_uri = _store_uri(record["tracking_uri"], overrides)
    done, total = _checkpointed_step(run_dir), config.trainer.max_steps
    if total is not None and done is not None and done >= total:
        raise ResumeError(
            f"trainer.resume={resume}: that run finished all its {total} optimizer steps; "
            "nothing is left to resume"
        )
    return ResumePoint(run_dir, record["run_id"], uri, record["job"], config)
