"""A tracking server with a login (issue 27): tfmemlab asks for the login in one line, and a
password given in the URI or the environment appears in nothing it writes, logs or prints.

One real `mlflow server --app-name basic-auth` on 127.0.0.1 serves the module; its admin
password is the secret searched for.
"""

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.core.errors import TrackingError
from runner.track import rundir
from runner.track.server import check_reachable
from tests.conftest import REPO, free_port, start_mlflow_server, stop_mlflow_server, tiny_overrides

SECRET = f"tfm-{secrets.token_hex(8)}"  # the admin's password: a fresh one each session
# What a leak looks like: the password, or what is left of a login whose password was masked
# as a secret variable's value (`admin:***@127.0.0.1`; Hydra escapes a sweep's `:` as `\\:`).
LEAKS = (SECRET, "@127.0.0.1")
LOGIN_ENV = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": SECRET}
NO_LOGIN_ENV = {"MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""}
# Without XLA: compiling the tiny jobs' step is not what is tested here.
TINY = [*tiny_overrides(), "trainer.jit_compile=false"]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[str, Path]:
    """(the URI without a login, the folder of its store and artifacts) of a real basic-auth
    MLflow server."""
    port, folder = free_port(), tmp_path_factory.mktemp("auth-server")
    proc = start_mlflow_server(folder, port, SECRET)
    try:
        yield f"http://127.0.0.1:{port}", folder
    finally:
        stop_mlflow_server(proc)


@pytest.fixture
def server(served) -> str:
    return served[0]


def with_login(uri: str, password: str = SECRET) -> str:
    return uri.replace("http://", f"http://admin:{password}@")


def start_cli(args: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    """`python run.py ARGS` from `cwd`, not waited for (run_cli's, started in the background)."""
    cwd.mkdir()
    return subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def admin_client(uri: str, monkeypatch) -> MlflowClient:
    for key, value in LOGIN_ENV.items():
        monkeypatch.setenv(key, value)
    return MlflowClient(tracking_uri=uri)


def _address(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:  # a machine whose name does not resolve
        return None


def test_a_server_that_wants_a_login_is_one_line(server, tmp_path, monkeypatch):
    cli = start_cli(
        [*tiny_overrides(), "mlflow.experiment=no-login"],
        tmp_path / "cli",
        {**NO_LOGIN_ENV, "MLFLOW_TRACKING_URI": server},
    )
    # A wrong password is refused in the same words, and says a login was given.
    with pytest.raises(TrackingError) as refused:
        check_reachable(with_login(server, "not-the-password"))
    assert str(refused.value) == (
        f"mlflow.tracking_uri={server}: the server requires login (HTTP 401); set "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (the login given was refused)"
    )
    # MLflow's security middleware refuses a host name it was not told (--allowed-hosts):
    # here this machine's name, where it resolves to the server's 127.0.0.1.
    host, port = socket.gethostname(), server.rpartition(":")[2]
    if _address(host) == "127.0.0.1" and host != "localhost":
        with pytest.raises(TrackingError) as refused:
            check_reachable(f"http://{host}:{port}")
        assert str(refused.value) == (
            f"mlflow.tracking_uri=http://{host}:{port}: the server refuses requests addressed to"
            f" '{host}' (HTTP 403: Invalid Host header); start it with --allowed-hosts naming "
            f"{host}:{port}"
        )
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 1, out + err
    assert err.strip() == (
        f"error: mlflow.tracking_uri={server}: the server requires login (HTTP 401); set "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
    )
    assert admin_client(server, monkeypatch).get_experiment_by_name("no-login") is None


def _leaks(folder: Path) -> list[str]:
    """Files under `folder` whose bytes hold the password or a login (LEAKS)."""
    return [
        str(p)
        for p in folder.rglob("*")
        if p.is_file() and _leaky(p.read_bytes().decode("latin-1"))
    ]


def _leaky(text: str) -> bool:
    return any(leak in text for leak in LEAKS)


def _mlflow_leaks(client: MlflowClient, experiment: str) -> tuple[list, list[str]]:
    """(the experiment's runs, every field of them that holds the secret)."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    found = []
    for run in runs:
        fields = {
            "run name": run.info.run_name,
            **{f"param {k}": f"{k}={v}" for k, v in run.data.params.items()},
            **{f"tag {k}": f"{k}={v}" for k, v in run.data.tags.items()},
            **{f"metric {k}": k for k in run.data.metrics},
        }
        found += [f"{run.info.run_id} {name}" for name, v in fields.items() if _leaky(v)]
    return runs, found


def test_no_password_in_what_a_sweep_and_its_run_leave(served, tmp_path, monkeypatch):
    """A sweep (its parent run, sweep.json, one job run in its process) given the login in
    its tracking URI on the command line, the password also in MLFLOW_TRACKING_PASSWORD: the
    password is not in its folders (Hydra's files included), its MLflow runs (every field,
    and the artifacts as the server stores them), or its output. (A URI given in
    MLFLOW_TRACKING_URI reaches the same places through the resolved config; only a command
    line reaches Hydra's files and the run names. One sweep is what the time allows.)"""
    server, server_folder = served
    sweep = start_cli(
        ["-m", *TINY, "mlflow.experiment=secret-sweep", "sweep.isolate=false"]
        + [f"mlflow.tracking_uri={with_login(server)}"],
        tmp_path / "sweep",
        LOGIN_ENV,
    )
    out, err = sweep.communicate(timeout=400)
    assert sweep.returncode == 0, out + err
    assert not _leaky(out + err), out + err
    assert _leaks(tmp_path / "sweep") == []
    # The server's own files: its store (every field of every run) and the artifacts as
    # stored (read here: each download through basic-auth costs a password hash).
    assert _leaks(server_folder) == []
    assert len(list((server_folder / "artifacts").rglob("overrides.txt"))) == 1
    client = admin_client(server, monkeypatch)
    runs, found = _mlflow_leaks(client, "secret-sweep")
    assert sorted(r.data.tags.get("sweep", "job") for r in runs) == ["job", "parent"]
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"] and found == []
    # run.json keeps the store's address, without its login, for trainer.resume.
    (run_file,) = (tmp_path / "sweep").rglob(rundir.RUN_FILE)
    assert f'"tracking_uri": "{server}"' in run_file.read_text()


def test_a_resume_takes_the_login_of_this_command(tmp_path, monkeypatch):
    """run.json holds the URI without its login; trainer.resume gets the login back from the
    command's own URI when it names the same store, else leaves it to MLflow's variables."""
    plain = "http://127.0.0.1:5999"
    given = [f"mlflow.tracking_uri={with_login(plain)}"]
    run_dir = tmp_path / "run"
    rundir.write_run_file(run_dir, "abc", compose_config(tiny_overrides() + given), given)
    (run_dir / rundir.CHECKPOINTS).mkdir()
    (run_dir / rundir.CHECKPOINTS / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    assert SECRET not in (run_dir / rundir.RUN_FILE).read_text()

    point = rundir.locate(str(run_dir), given)  # the same URI as an override
    assert point.tracking_uri == point.config.mlflow.tracking_uri == with_login(plain)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", with_login(plain, "other"))
    assert rundir.locate(str(run_dir), []).tracking_uri == with_login(plain, "other")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", with_login("http://elsewhere:5000"))
    assert rundir.locate(str(run_dir), []).tracking_uri == plain
