"""The run directory: `run.json` names the MLflow run, the job and its resolved config, so that
`trainer.resume=<run dir>|latest` finds the run and builds the same job (issue 16).

`trainer.resume` restores the last checkpoint (runner/train/checkpoint.py) into the job as
built, and goes on in the same MLflow run from the step after it: no step the checkpoint holds
is run again, and no (metric, step) pair the run already has is logged again. Everything here
is read without TensorFlow, so the command line checks a resume before TensorFlow loads.
"""

import contextlib
import json
import os
import re
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ResumeError
from runner.core.lock import FolderLock, check_free
from runner.core.secrets import redact, redact_obj, strip_userinfo

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
SIZES = "sizes.json"  # in checkpoints/: each checkpoint's files and their sizes, as written
# Overrides that do not change the job trained.
NOT_THE_JOB = ("trainer.resume", "sweep.resume", "hydra.")
# ...and those that say only where it is stored or how it reports: left out of its name.
NOT_IN_THE_NAME = (*NOT_THE_JOB, "mlflow.", "trainer.progress")


def hydra_overrides() -> list[str]:
    """The command-line overrides of this job (empty when called outside Hydra)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def hydra_run_dir(run_id: str) -> Path:
    """Hydra's output folder for this job, or outputs/runs/<run id> outside Hydra."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / "runs" / run_id


def job_key(overrides: list[str]) -> str:
    """The job a command line describes: its overrides, sorted, less those that do not change
    what is trained (trainer.resume, hydra.*)."""
    kept = sorted(o for o in overrides if not o.lstrip("+~").startswith(NOT_THE_JOB))
    return redact(" ".join(kept)) or "default"  # a tag and run.json's: no login in it


def run_name(overrides: list[str]) -> str:
    """A run's name in MLflow and its pictures' titles: the overrides as typed, less those that
    say where the run is stored or how it reports (mlflow.*, trainer.progress, hydra.*)."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(NOT_IN_THE_NAME)]
    return redact(" ".join(kept)) or "default"


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


def run_lock(point: ResumePoint | None, resume: str | None, hydra_dir: str | None):
    """This process's hold on its run directory for the whole run (runner/core/lock.py): a
    resume's, so that a second resume changes nothing; a new run's Hydra folder (Hydra gives
    two runs started in the same second the same one). Outside Hydra a new run's folder is
    named by its new MLflow run: no one else's."""
    if point is not None:
        return FolderLock(point.run_dir, f"trainer.resume={resume}")
    if hydra_dir is not None:
        return FolderLock(Path(hydra_dir), f"run directory {hydra_dir}")
    return contextlib.nullcontext()


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


def _files(folder: Path, name: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.glob(f"{name}.*") if p.is_file()}


def record_sizes(run_dir: Path, names: list[str]) -> None:
    """Note the sizes of the files of the checkpoints `names` as written (SIZES), so that a
    damaged one is seen without TensorFlow (_checkpointed_step)."""
    folder = run_dir / CHECKPOINTS
    (folder / SIZES).write_text(json.dumps({n: _files(folder, n) for n in names}, indent=1))


def _checkpointed_step(run_dir: Path) -> int | None:
    """The optimizer step of the run's last whole checkpoint, from the manager's index
    (`all_model_checkpoint_paths: "ckpt-<step>"`), read without TensorFlow. One whose files no
    longer have the sizes they were written with (a truncated copy) is passed over: its resume
    goes on from the one before (issue 27)."""
    folder = run_dir / CHECKPOINTS
    index = (folder / "checkpoint").read_text()
    names = re.findall(r'^all_model_checkpoint_paths: ".*?(ckpt-\d+)"', index, re.MULTILINE)
    names = names or re.findall(r'^model_checkpoint_path: ".*?(ckpt-\d+)"', index, re.MULTILINE)
    try:
        sizes = json.loads((folder / SIZES).read_text())
    except (OSError, ValueError):
        sizes = {}  # written before sizes were kept: the index is trusted
    whole = [n for n in names if n not in sizes or sizes[n] == _files(folder, n)]
    return int(whole[-1].removeprefix("ckpt-")) if whole else None


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
    check_free(run_dir, f"trainer.resume={resume}")  # BusyError: another process has it
    path = run_dir / RUN_FILE
    if not path.is_file() or not _has_checkpoint(run_dir):
        raise ResumeError(f"trainer.resume={resume}: {_not_resumable(run_dir)}")
    record = json.loads(path.read_text())
    if job != "default" and job != record["job"]:
        raise ResumeError(
            f"trainer.resume={resume}: that run trained the job '{record['job']}', not '{job}'"
            " (give only trainer.resume=<run dir> to continue it as it was)"
        )
    config = OmegaConf.create(record["config"])
    uri = _store_uri(record["tracking_uri"], overrides)
    done, total = _checkpointed_step(run_dir), config.trainer.max_steps
    if total is not None and done is not None and done >= total:
        raise ResumeError(
            f"trainer.resume={resume}: that run finished all its {total} optimizer steps; "
            "nothing is left to resume"
        )
    if "mlflow" in config:  # the resumed job logs with this command's login
        config.mlflow.tracking_uri = uri
    if "data" in config and "module" not in config.data:  # saved before data.module was a key
        config.data.module = f"runner.data.{config.data.name}"
    return ResumePoint(run_dir, record["run_id"], uri, record["job"], config)


def _not_resumable(run_dir: Path) -> str:
    """Why a folder without a checkpoint cannot be resumed: it was never a run directory, or
    its run stopped before its first checkpoint (its MLflow run, left RUNNING by a process
    that is gone, is marked KILLED) and must run again, with the overrides it was given."""
    hydra = run_dir / ".hydra"  # Hydra writes it before run.json, with the overrides in order
    given = None
    if (hydra / "overrides.yaml").is_file():
        given = [str(o) for o in OmegaConf.load(hydra / "overrides.yaml")]
    if (run_dir / RUN_FILE).is_file():
        record = json.loads((run_dir / RUN_FILE).read_text())
        uri, run_id = record["tracking_uri"], record["run_id"]
        given = given if given is not None else record["job"].split()
    elif given is None:
        return f"no {RUN_FILE} there; expected a run directory"
    elif resumed := [o for o in given if o.startswith("trainer.resume=")]:
        return f"no {RUN_FILE} there: it is the folder of a resume; give {resumed[-1]}"
    else:
        uri, run_id = OmegaConf.load(hydra / "config.yaml").mlflow.tracking_uri, None
    given = [o for o in given if not o.lstrip("+~").startswith(NOT_THE_JOB)]
    # MLflow only here: importing it starts threads, and runner.launch checks a command line
    # before it moves into a namespace of its own, which needs a single-threaded process.
    from runner.track.lifecycle import close_lost_run

    status = close_lost_run(uri, run_id, run_dir)
    if status == "FINISHED":
        return "the run there finished and wrote no checkpoint; nothing is left to resume"
    how = "failed" if status == "FAILED" else "was stopped"
    again = shlex.join(["python", "run.py", *(o for o in given if o != "default")])
    return (
        f"the run there {how} before its first checkpoint (it wrote no checkpoint): there is "
        f"nothing to go on from; run it again with: {again}"
    )
