"""Faults a user meets, each told in one line with what to do, and nothing else changed (issue
48): a NaN loss (the data's, or a diverging step's), a damaged store (and its recovery), a full
disk under the store. Each starts the real command with the fault, except the diverging step,
run in-process (the process is not the point)."""

import hashlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, TINY, TINY_TRAINER, run_cli, tiny_overrides


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(result) -> str:
    """The last line of stderr, after checking the command failed without a traceback."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_a_nan_in_the_data_is_one_line_that_names_the_data(tmp_path, store):
    images = np.random.RandomState(0).randint(0, 255, (48, 32, 32, 3)).astype("float32")
    images[::2, 0, 0, 0] = np.nan  # every other image: every batch holds one
    path = tmp_path / "images.npz"
    np.savez(path, x=images, y=np.arange(48) % 10)
    before = _digest(path)
    args = [
        *TINY["mobilenet"],
        "data=arrays",
        f"data.path={path}",
        "data.batch_size=4",
        *TINY_TRAINER,
    ]
    result = run_cli([*args, f"mlflow.tracking_uri={store}"], tmp_path)
    assert _one_line(result) == (
        "error: train/loss is nan at optimizer step 1, and its input batch held NaN or Inf: the "
        f"data is the cause: clean the values of data=arrays data.path={path}; no checkpoint "
        "was written"
    )
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["failure"] == "nan"
    assert "its input batch held NaN or Inf" in run.data.tags["error"]
    assert _digest(path) == before  # the user's data as it was
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").rglob("run.json")]
    assert not list((run_dir / "checkpoints").glob("ckpt-*"))


def test_a_diverging_step_on_finite_inputs_names_its_levers(tiny_cfg, store, monkeypatch, tmp_path):
    from runner.core.errors import NonFiniteLoss
    from runner.train import run

    monkeypatch.chdir(tmp_path)
    # bf16: float16's loss scaling would skip the overflowing steps instead
    cfg = tiny_cfg("mobilenet", "trainer.optimizer=sgd", "trainer.lr=1e30", "precision=bf16")
    with pytest.raises(NonFiniteLoss) as raised:
        run(cfg)
    assert str(raised.value) == (
        "train/loss is nan at optimizer step 2 with finite inputs: the step diverged; try a "
        "lower trainer.lr (now 1e+30), precision=fp32 (now bf16) or trainer.warmup_steps=100; no "
        "checkpoint was written"
    )
    client = MlflowClient(tracking_uri=store)
    (failed,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    assert failed.info.status == "FAILED" and failed.data.tags["failure"] == "nan"


def _store_with_runs(folder, runs: int = 3) -> tuple[str, dict]:
    """A store of `runs` finished runs, each with 300 metric values and 40 params: several
    hundred KiB, so that its tables' pages lie on both sides of a cut at half its size."""
    from runner.track.client import client_for, experiment_id

    uri = f"sqlite:///{folder}/mlflow.db"
    client = client_for(uri)
    experiment = experiment_id(client, "tfmemlab", uri)
    made = {}
    for r in range(runs):
        run = client.create_run(experiment, run_name=f"run-{r}")
        for step in range(300):
            client.log_metric(run.info.run_id, "train/loss", 1.0 / (step + 1), step=step)
        for p in range(40):
            client.log_param(run.info.run_id, f"p{p}", "x" * 40)
        client.set_terminated(run.info.run_id)
        made[run.info.run_id] = f"run-{r}"
    return uri, made


def test_a_damaged_store_is_one_line_and_repair_recovers_what_is_readable(tmp_path):
    made_in = tmp_path / "made"
    made_in.mkdir()
    _, made = _store_with_runs(made_in)
    # A copy that stopped half-way, at another path: MLflow keeps its connection to the store
    # it made in this process, which would read the old file after the repair.
    db = tmp_path / "mlflow.db"
    whole = (made_in / "mlflow.db").read_bytes()
    db.write_bytes(whole[: len(whole) // 2])
    uri = f"sqlite:///{db}"
    cut = _digest(db)
    checkpoint = tmp_path / "outputs" / "runs" / "earlier" / "checkpoints" / "ckpt-1.index"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"a checkpoint of an earlier run")
    result = run_cli([*tiny_overrides("transformer", uri)], tmp_path)
    assert _one_line(result) == (
        f"error: mlflow.tracking_uri={uri}: the store's file is damaged (database disk image is "
        f"malformed); `python -m runner.track.store repair {db}` recovers what is readable into "
        "a new file and keeps the damaged one beside it; or point mlflow.tracking_uri at a new "
        "store"
    )
    assert "tfmemlab: job" not in result.stdout  # refused before the job (and TensorFlow) began
    assert _digest(db) == cut and [p.name for p in tmp_path.glob("mlflow.db*")] == ["mlflow.db"]

    repair = subprocess.run(
        [sys.executable, "-m", "runner.track.store", "repair", str(db)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert repair.returncode == 0 and "Traceback" not in repair.stderr, repair.stderr[-3000:]
    (kept,) = tmp_path.glob("mlflow.db.damaged-*")
    assert _digest(kept) == cut  # the damaged file, kept as it was
    assert repair.stdout.strip().startswith(f"tfmemlab: {db} recovered into a new file: ")
    assert f"the damaged file is kept as {kept}" in repair.stdout
    client = MlflowClient(tracking_uri=uri)
    recovered = {r.info.run_id: r for e in client.search_experiments() for r in
                 client.search_runs([e.experiment_id])}  # fmt: skip
    assert recovered and set(recovered) <= set(made)  # some runs read, none made up
    for run_id, run in recovered.items():
        assert run.info.run_name == made[run_id] and run.info.status == "FINISHED"
        history = client.get_metric_history(run_id, "train/loss")
        assert all(m.value == 1.0 / (m.step + 1) for m in history)
    assert f"{len(recovered)} run(s)" in repair.stdout
    # The store is usable again: the command-line check passes and a run can be recorded.
    from runner.cli import check_command_line

    check_command_line(tiny_overrides("transformer", uri))
    experiment = client.get_experiment_by_name("tfmemlab") or client.search_experiments()[0]
    client.set_terminated(client.create_run(experiment.experiment_id).info.run_id)
    assert checkpoint.read_bytes() == b"a checkpoint of an earlier run"


def _in_a_small_filesystem(tmp_path, script: str) -> subprocess.CompletedProcess:
    """`script` (sh) with tmp_path/small a tmpfs of 1 MiB, in a user and mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed: no tmpfs without root")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespace here: {probe.stderr.strip()}")
    (tmp_path / "small").mkdir()
    mount = f"mount -t tmpfs -o size=1m tmpfs {tmp_path}/small && "
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount + script], cwd=tmp_path, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip


def test_a_full_disk_under_the_store_says_so_and_where(tmp_path):
    small = tmp_path / "small"
    uri = f"sqlite:///{small}/mlflow.db"
    command = " ".join(
        [sys.executable, str(REPO / "run.py"), *tiny_overrides("transformer", uri)]
        + [f"hydra.run.dir={tmp_path}/run"]
    )
    # The store's filesystem full before the run: MLflow cannot create its tables.
    result = _in_a_small_filesystem(
        tmp_path, f"head -c 1040000 /dev/zero > {small}/filler; {command}"
    )
    line = _one_line(result)
    assert line.startswith(
        f"error: mlflow.tracking_uri={uri}: the disk under the store is full (database or disk "
        "is full; "
    ), line
    assert line.endswith(
        f"MiB left on the filesystem of {small}): free space there, or point "
        "mlflow.tracking_uri at a store on another disk; no run was recorded"
    ), line
    assert "repair" not in line  # the file is not what is wrong
