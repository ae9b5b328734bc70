"""What a user's data files say is taken from them (issue 48): an .npz's token length and
image size, the classes of small local TFRecord files; and a text file too short to train on
is said to be so, with its size. Each through the real command (`python run.py`, a fresh
process) or `run(cfg)` in-process where the process is not the point, with a real MLflow
store; a refused command leaves no store and no run folder, and no data file is changed."""

import hashlib

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import TINY, run_cli

# The tiny transformer without its data keys: the length comes from the file.
TRANSFORMER = [o for o in TINY["transformer"] if not o.startswith("data.")]
MOBILENET = [o for o in TINY["mobilenet"] if not o.startswith("data.")]
TOKENS = 16  # the .npz's token length; data.seq_len's default is 64


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _only_run(store: str):
    client = MlflowClient(tracking_uri=store)
    (run_,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    return run_


def _refused(done, tmp_path, line: str) -> None:
    """One line on stderr, a failing exit, and nothing written: no store, no run folder."""
    assert done.returncode != 0
    assert done.stderr.strip() == line, done.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()


# --- text: a file too short for two windows is said to be so ---------------------------------

SHORT_TEXT = [  # (content, what the line says after the path)
    (b"", "; it is empty"),
    (b"abcde", "; it holds 5 bytes"),
]


@pytest.mark.parametrize(("content", "said"), SHORT_TEXT, ids=["empty", "5 bytes"])
def test_a_text_file_too_short_to_train_on_is_said_with_its_size(tmp_path, content, said):
    """It was `data.seq_len=64: not allowed; expected at most -1: ... must hold 2 windows`."""
    path = tmp_path / "book.txt"
    path.write_bytes(content)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["model=transformer", "data=text", f"data.path={path}", f"mlflow.tracking_uri={store}"]
    done = run_cli(args, cwd=tmp_path, timeout=120)
    _refused(
        done,
        tmp_path,
        f"error: data.path={path}: not allowed; expected a text file of at least 2 windows of "
        f"seq_len + 1 bytes (130 bytes at data.seq_len=64){said}",
    )
    assert path.read_bytes() == content
