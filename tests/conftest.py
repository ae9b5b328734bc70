"""Shared fixtures: the real conf/ composed with Hydra's compose API, shrunk to tiny sizes."""

import os
import random

# The suite's sizes and bands were measured under oneDNN's CPU kernels, the default on CPUs with
# AVX512_VNNI or AMX; without them TensorFlow's own convolution kernels take im2col buffers of up
# to 30 MiB (runner/estimate/conv_scratch.py) and its float32 results differ in the last bits.
# Pinned before TensorFlow loads, here and in every process a test starts, so the suite
# measures the same kernels on every CPU; tests/test_conv_scratch.py pins the other ones.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from omegaconf import DictConfig

from runner.config import compose_config
from runner.core.machine import CACHE_ENV

REPO = Path(__file__).resolve().parent.parent

# Tiny sizes per model family: a few seconds a run on a 2-core CPU.
TINY = {
    "transformer": [
        # Without XLA: on a CPU, compiling a tiny step with XLA took 2-3x the rest of the run
        # (measured in-process: 54 s against 27 s under load); tests of the XLA path say so.
        "trainer.jit_compile=false",
        "model=transformer",
        "model.h=16",
        "model.layers=1",
        "model.heads=2",
        "data.seq_len=8",
        "data.vocab_size=16",
    ],
    "mobilenet": ["model=mobilenet", "model.alpha=0.35", "data.image_size=32"],
    "efficientnet": ["model=efficientnet", "data.image_size=32"],
}
TINY_DATA = ["data.batch_size=4", "data.train_samples=32", "data.val_samples=8"]
# Keeping the model costs ~1 s in a fresh process (0.8-1.1 s measured; MLflow checks its pip
# requirements against the installed packages): tiny runs keep none; tests/test_keep.py and
# the pruned-model tests turn it on.
NO_MODEL = ["trainer.save_model=false"]
TINY_TRAINER = ["trainer.max_steps=3", "trainer.progress=false", *NO_MODEL]


# A transformer whose peak grows by about 0.6 MiB per example (128 tokens; measured without a
# limit: 9.6 MiB at micro-batch 16, 37.2 at 64; 256 asks for about 145 MiB), so that under a
# CPU BFC limit of 48 or 64 MB (TF_CPU_BFC_MEM_LIMIT_IN_MB) small micro-batches fit, 256 runs
# out of memory, and the micro-batch that fits best is tens of examples.
MEMORY_BOUND = [
    "trainer.jit_compile=false",  # XLA's compilation was most of each probe's time
    "model.h=32",
    "model.layers=1",
    "model.heads=2",
    "data.seq_len=128",
    "data.vocab_size=64",
    "data.train_samples=512",
    "data.val_samples=8",
    "trainer.progress=false",
    *NO_MODEL,
]


def tiny_overrides(model: str = "transformer", store: str | None = None) -> list[str]:
    extra = [f"mlflow.tracking_uri={store}"] if store else []
    return TINY[model] + TINY_DATA + TINY_TRAINER + extra


@pytest.fixture
def store(tmp_path) -> str:
    """A fresh SQLite MLflow store in a temp dir: runner.track.client.scratch_store's copy of
    one store MLflow created and migrated once in this test process (~2 s of migrations)."""
    from runner.track.client import scratch_store

    return scratch_store(tmp_path)


@pytest.fixture
def tiny_cfg(store):
    def make(model: str = "transformer", *extra: str) -> DictConfig:
        return compose_config(tiny_overrides(model, store) + list(extra))

    return make


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600):
    """`python run.py ARGS` as a user types it, from another directory."""
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# The executor's inter-op threads (TF_NUM_INTEROP_THREADS, read when TensorFlow starts): with one,
# independent operations run in one order, so a test of which tensors a rule keeps alive reads
# one figure (with two, a step's order, and its peak, can change from one call to the next).
# The order also follows Python's hash seed (the graph's operations are listed in an order that
# depends on it): the GELU/LayerNorm stack of test_memory_limited read 21.33sbh a block with
# seeds 0, 1, 2, 4 and 5 and 19.33 with seed 3 (one [b, s, 4h] bfloat16 tensor more at the
# 6-block step's peak), and two CI runs 23.33. So the seed is pinned too.
ONE_THREAD = {"TF_NUM_INTEROP_THREADS": "1", "PYTHONHASHSEED": "0"}


def fresh_result(
    script: str, *args: str, env: dict | None = None, cwd: Path = REPO, timeout: int = 600
) -> dict:
    """Run `script` (python -c) in a fresh process (its allocator's pool in a known state, its
    kernels chosen by `env` over this one's) and return the JSON it printed on its line
    starting "RESULT "."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=full_env, cwd=cwd, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def onednn_off_result(script: str, *args: str, cwd: Path = REPO, timeout: int = 600) -> dict:
    """fresh_result with oneDNN's operations off, so that the CPU takes TensorFlow's own
    kernels whatever its features."""
    return fresh_result(script, *args, env={"TF_ENABLE_ONEDNN_OPTS": "0"}, cwd=cwd, timeout=timeout)


def run_launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m runner.launch ARGS` from the repository, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "runner.launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(folder: Path, port: int, admin_password: str | None = None):
    """A real `mlflow server` on 127.0.0.1:port over a SQLite store in `folder`, answering.

    admin_password: run MLflow's basic-auth app (`--app-name basic-auth`, user `admin`); it
    keeps its users in basic_auth.db in its cwd (`folder`) and refuses to start without a
    Flask secret key and an admin password (MLflow ships no default one)."""
    auth = ["--app-name", "basic-auth"] if admin_password else []
    auth_env = {
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "tfmemlab-test-key",
        "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{folder}/server.db",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--workers",
            "1",
            *auth,
        ],
        cwd=folder if admin_password else None,  # where basic-auth keeps its users
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: `mlflow server` starts uvicorn under it
        # Without MLflow's job runner (GenAI jobs): 8 more processes of ~235 MB each.
        env={
            **os.environ,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            **(auth_env if admin_password else {}),
        },
    )
    for _ in range(120):  # bounded wait for the server to answer
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return server
        except OSError:
            time.sleep(0.5)
    stop_mlflow_server(server, signal.SIGKILL)
    pytest.fail("mlflow server did not start")


def stop_mlflow_server(server: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the server's whole process group (the CLI and the uvicorn workers under it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, sig)
    server.wait(timeout=30)


@pytest.fixture
def mlflow_server(tmp_path):
    """The URI of a real `mlflow server` on 127.0.0.1 with a temp SQLite store."""
    port = free_port()
    server = start_mlflow_server(tmp_path, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_mlflow_server(server)


_XLA_CACHE = pytest.StashKey[str]()
ESTIMATE_SEED = "TFMEMLAB_ESTIMATE_SEED"


def pytest_configure(config):
    """One XLA compilation cache for the whole session, its workers and every process they
    start: most tests compile the same tiny step, and XLA's persistent cache turns the
    compile of a tiny run (about 15 s on 2 cores) into a load from disk. Likewise one cache
    of the CPU's calibrated peak FLOP/s and bandwidth (runner.measure.cpu_peak.cache_dir):
    without it each job started in a fresh folder calibrates again (1-2 CPU-seconds a
    dtype). Set once by the first process (xdist's controller), inherited by the workers and
    their subprocesses."""
    if "TFMEMLAB_TEST_XLA_CACHE" not in os.environ:
        folder = tempfile.mkdtemp(prefix="tfmemlab-xla-cache-")
        os.environ["TFMEMLAB_TEST_XLA_CACHE"] = folder
        flags = os.environ.get("TF_XLA_FLAGS", "")
        os.environ["TF_XLA_FLAGS"] = f"{flags} --tf_xla_persistent_cache_directory={folder}".strip()
        os.environ[CACHE_ENV] = str(Path(folder) / "calibration")
        config.stash[_XLA_CACHE] = folder  # this process made it: it removes it at the end
    _estimate_seed()


def _estimate_seed() -> None:
    """The randomized estimate test's seed (tests/test_estimate_draws.py): a new one each run
    unless TFMEMLAB_ESTIMATE_SEED gives it, chosen once by the first process (xdist's
    controller) and inherited by its workers, so that the header names the jobs they draw."""
    if not os.environ.get(ESTIMATE_SEED):
        os.environ[ESTIMATE_SEED] = str(random.SystemRandom().randrange(10**6))


def pytest_report_header(config):
    """The seed at the top of the run's output, whatever the tests print."""
    seed = os.environ.get(ESTIMATE_SEED)
    return f"estimate draws: seed {seed} (TFMEMLAB_ESTIMATE_SEED={seed} draws them again)"


def pytest_unconfigure(config):
    if _XLA_CACHE in config.stash:
        shutil.rmtree(config.stash[_XLA_CACHE], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group into the test id
def pytest_collection_modifyitems(items):
    """Slow tests first (in their own order, then the rest): with `-n 2` the long ones are
    then shared out between the two processes early, instead of one of them running the last
    long test alone while the other waits.

    A test that uses a module-scoped fixture (a shared run or sweep that several tests only
    read) is put in its module's xdist group, so that under `--dist loadgroup` the fixture is
    built once, on one worker, not once on each."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        shared = defs and any(
            d.scope == "module" and d.baseid.startswith("tests")
            for fixture_defs in defs.name2fixturedefs.values()
            for d in fixture_defs
        )
        if shared and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
