"""What a user's data files say is taken from them (issue 48): an .npz's token length and
image size, the classes of small local TFRecord files; and a text file too short to train on
is said to be so, with its size. Each through the real command (`python run.py`, a fresh
process) or `run(cfg)` in-process where the process is not the point, with a real MLflow
store; a refused command leaves no store and no run folder, and no data file is changed."""

import hashlib
import struct

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config, validate
from runner.feed.pipelines import build_data
from runner.train.pipeline import run
from tests.conftest import TINY, TINY_TRAINER, run_cli
from tests.test_data_sources import CLASSES, image_examples, write_npz, write_records

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


def _token_npz(tmp_path) -> str:
    x = (np.arange(64)[:, None] + np.arange(TOKENS + 1)[None, :]) % 16  # next token: + 1
    return write_npz(tmp_path / "tokens.npz", x[:, :-1], x[:, 1:])


# --- arrays: the token length and the image size are the file's ------------------------------


def test_arrays_take_the_token_length_from_the_file(tmp_path):
    """`data=arrays data.path=tokens.npz` with no data.seq_len trains at the arrays' length
    (it stopped with `data.seq_len=64: not allowed; expected 16, ...`)."""
    path = _token_npz(tmp_path)
    before, store = _digest(path), f"sqlite:///{tmp_path}/mlflow.db"
    args = [*TRANSFORMER, "data=arrays", f"data.path={path}", "data.batch_size=4", *TINY_TRAINER]
    done = run_cli([*args, f"mlflow.tracking_uri={store}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = _only_run(store)
    assert logged.info.status == "FINISHED"
    assert logged.data.params["data.seq_len"] == str(TOKENS)
    assert _digest(path) == before


def test_arrays_refuse_a_token_length_set_against_the_file(tmp_path):
    path = _token_npz(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    args = [*TRANSFORMER, "data=arrays", f"data.path={path}", "data.seq_len=8"]
    done = run_cli([*args, f"mlflow.tracking_uri={store}"], cwd=tmp_path, timeout=120)
    _refused(
        done,
        tmp_path,
        f"error: data.seq_len=8: not allowed; expected {TOKENS}, the length of the token "
        f"arrays x in {path}, or no value (then it is taken from there)",
    )


def test_arrays_take_the_image_size_from_the_file(tmp_path, store):
    """Images of 36x36 train at 36 (they were resized to data.image_size's 32); images
    smaller than keras.applications take are resized to their smallest, 32."""
    rng = np.random.default_rng(0)
    y = np.arange(40) % CLASSES
    path = write_npz(tmp_path / "images.npz", rng.integers(0, 255, (40, 36, 36), np.uint8), y)
    before = _digest(path)
    cfg = compose_config([*MOBILENET, "data=arrays", f"data.path={path}", "data.batch_size=4",
                          *TINY_TRAINER, f"mlflow.tracking_uri={store}"])  # fmt: skip
    validate(cfg)
    result = run(cfg)
    logged = MlflowClient(tracking_uri=store).get_run(result["run_id"])
    assert logged.info.status == "FINISHED" and result["steps"] == 3
    assert logged.data.params["data.image_size"] == "36"
    assert _digest(path) == before
    small = write_npz(tmp_path / "small.npz", rng.integers(0, 255, (8, 12, 12), np.uint8), y[:8])
    small_cfg = compose_config(
        [*MOBILENET, "data=arrays", f"data.path={small}", "data.batch_size=4"]
    )
    assert build_data(small_cfg, True).spec.input_shape == (32, 32, 3)


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


# --- tfrecord: the classes of small local files are read from their labels --------------------


def test_tfrecord_images_take_their_classes_from_the_labels(tmp_path, store):
    """No data.num_classes: the labels (0, 1, 2) of the files are read once, 3 classes (it
    stopped with `data.num_classes=0: not allowed; expected the number of label classes`)."""
    write_records(tmp_path / "a.tfrecord", image_examples(12))
    write_records(tmp_path / "b.tfrecord", image_examples(12, start=12))
    before = {p.name: _digest(p) for p in tmp_path.glob("*.tfrecord")}
    cfg = compose_config([*MOBILENET, "data.image_size=32", "data=tfrecord",
                          f"data.path={tmp_path}/*.tfrecord", "data.batch_size=4", *TINY_TRAINER,
                          f"mlflow.tracking_uri={store}"])  # fmt: skip
    validate(cfg)
    result = run(cfg)
    logged = MlflowClient(tracking_uri=store).get_run(result["run_id"])
    assert logged.info.status == "FINISHED" and result["steps"] == 3
    assert logged.data.params["data.num_classes"] == str(CLASSES)
    assert {p.name: _digest(p) for p in tmp_path.glob("*.tfrecord")} == before


def _sparse_tfrecord(path, first: bytes, gib: float) -> None:
    """A TFRecord file of `gib` GiB: a real first record, then one record whose data is a
    hole (a sparse file: nothing is written to disk)."""
    with open(path, "wb") as f:
        f.write(first)
        length = int(gib * 2**30)
        f.write(struct.pack("<Q", length) + bytes(4))
        f.truncate(len(first) + 12 + length + 4)


def test_tfrecord_files_over_a_gib_still_need_num_classes(tmp_path):
    """Over 1 GiB the labels are not read: the one line asks for data.num_classes."""
    small = write_records(tmp_path / "one.tfrecord", image_examples(1))
    path = tmp_path / "big.tfrecord"
    _sparse_tfrecord(path, open(small, "rb").read(), 1.2)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    args = [*MOBILENET, "data=tfrecord", f"data.path={path}", f"mlflow.tracking_uri={store}"]
    done = run_cli(args, cwd=tmp_path, timeout=120)
    _refused(
        done,
        tmp_path,
        "error: data.num_classes=None: not allowed; expected the number of label classes "
        f"(>= 2) for a CNN: the labels are read to count them only from files under 1 GiB, "
        f"and {path} holds 1.2 GiB",
    )
