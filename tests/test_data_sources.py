"""data=tfrecord, arrays, text and custom: real files written here, trained end to end, their
one-line errors, and the RSS growth of data setup (streamed vs in memory) in fresh processes."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from mlflow.tracking import MlflowClient
from PIL import Image

from models.spec import SIGNED_UNIT
from runner.cli import check_command_line
from runner.config import ConfigError, validate
from runner.feed.pipelines import build_data
from runner.train.pipeline import run
from tests.conftest import REPO, TINY, TINY_TRAINER, compose_config

CLASSES = 3
SEQ = 8  # TINY transformer's data.seq_len


def png(seed: int, size: int = 12) -> bytes:
    """A small PNG whose class (seed % CLASSES) shows in its brightness."""
    rng = np.random.default_rng(seed)
    base = 40 + 80 * (seed % CLASSES)
    pixels = (base + rng.integers(0, 40, size=(size, size, 3))).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _feature(kind: str, values) -> tf.train.Feature:
    if kind == "bytes":
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def write_records(path, examples: list[dict]) -> str:
    """A TFRecord file of tf.train.Example; each example maps name -> (kind, values)."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for ex in examples:
            features = {k: _feature(kind, v) for k, (kind, v) in ex.items()}
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    return str(path)


def image_examples(n: int, start: int = 0, pngs: list[bytes] | None = None) -> list[dict]:
    return [
        {
            "image": ("bytes", [pngs[i % len(pngs)] if pngs else png(i)]),
            "label": ("int64", [i % CLASSES]),
        }
        for i in range(start, start + n)
    ]


def token_examples(n: int, length: int = SEQ + 1, key: str = "tokens") -> list[dict]:
    """Sequences of the rule x[t+1] = x[t] + 1 (mod 16): learnable next tokens."""
    return [{key: ("int64", [(i + t) % 16 for t in range(length)])} for i in range(n)]


def tiny(model: str, store: str, *extra: str) -> list[str]:
    batch = ["data.batch_size=4"]
    return [*TINY[model][:-1 if model == "transformer" else None], *batch, *TINY_TRAINER,
            f"mlflow.tracking_uri={store}", *extra]  # fmt: skip


def train(overrides: list[str]) -> dict:
    cfg = compose_config(overrides)
    validate(cfg)
    return run(cfg)


def assert_trained(result: dict, store: str) -> None:
    assert result["steps"] == 3 and np.isfinite(result["train/final_loss"])
    assert 0.0 <= result["val/accuracy"] <= 1.0
    # Measured and logged. In a suite worker that ran other jobs it is any difference: 0 when
    # the source's pages fit in memory the process had freed (a 900-byte text file), -27 MiB
    # once when the worker gave memory back meanwhile; fresh processes below read its size.
    assert isinstance(result["host/data_setup_rss_bytes"], int)
    client = MlflowClient(tracking_uri=store)
    logged = client.get_run(result["run_id"]).data.metrics
    assert logged["host/data_setup_rss_bytes"] == result["host/data_setup_rss_bytes"]


# --- each source trains end to end -----------------------------------------------------------


def test_tfrecord_images_train_mobilenet(tmp_path, store):
    """Two files (a glob), PNG bytes and int64 labels; validation every 5th record."""
    write_records(tmp_path / "a.tfrecord", image_examples(20))
    write_records(tmp_path / "b.tfrecord", image_examples(20, start=20))
    glob = f"data.path={tmp_path}/*.tfrecord"
    overrides = tiny("mobilenet", store, "data=tfrecord", glob, f"data.num_classes={CLASSES}")
    data = build_data(compose_config(overrides), image_model=True)
    assert data.train_size == 40 - 8 and data.spec.num_classes == CLASSES
    xs, ys = next(iter(data.train))
    assert xs.shape == (4, 32, 32, 3) and xs.dtype == tf.float32 and ys.dtype == tf.int32
    low, high = SIGNED_UNIT  # MobileNetV2 takes [-1, 1]
    assert low <= float(tf.reduce_min(xs)) and float(tf.reduce_max(xs)) <= high
    assert sum(int(y.shape[0]) for _, y in data.val) == 8
    assert_trained(train(overrides), store)


def test_tfrecord_tokens_next_token_targets_and_val_files(tmp_path, store):
    write_records(tmp_path / "train.tfrecord", token_examples(40, key="ids"))
    write_records(tmp_path / "val.tfrecord", token_examples(6, key="ids"))
    overrides = tiny(
        "transformer", store, "data=tfrecord", f"data.path={tmp_path}/train.tfrecord",
        f"data.val_path={tmp_path}/val.tfrecord", "data.tokens_key=ids", "data.vocab_size=16",
    )  # fmt: skip
    data = build_data(compose_config(overrides), image_model=False)
    xs, ys = next(iter(data.train))
    assert xs.shape == (4, SEQ) and ys.shape == (4, SEQ) and xs.dtype == tf.int32
    np.testing.assert_array_equal(ys.numpy(), (xs.numpy() + 1) % 16)  # next-token targets
    assert data.train_size == 40 and data.spec.per_token and data.spec.vocab_size == 16
    assert sum(int(y.shape[0]) for _, y in data.val) == 6
    validate(compose_config(overrides))  # the same tiny transformer trains on data=text below


def test_a_short_token_record_further_on_stops_the_run_in_one_line(tmp_path, store):
    """The first record is checked before TensorFlow loads (the table below); a shorter one
    further on is found when the pipeline reaches it, and named with its file and index. All
    but the first are short here, so that the first batch, drawn in data setup before the
    model is built, meets one (which one depends on the shuffle)."""
    examples = token_examples(1, key="ids") + [{"ids": ("int64", [1, 2, 3, 4, 5])}] * 11
    path = write_records(tmp_path / "short.tfrecord", examples)
    overrides = tiny(
        "transformer", store, "data=tfrecord", f"data.path={path}", "data.tokens_key=ids",
        "data.vocab_size=16",
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        train(overrides)
    start = (
        "data.seq_len=8: not allowed; expected at most 4, or records of at least 9 tokens "
        "(seq_len + 1: the inputs and their next-token targets); record "
    )
    message = str(err.value)
    assert message.startswith(start), message
    index, _, rest = message.removeprefix(start).partition(" ")
    assert 1 <= int(index) <= 11 and rest == f"of {path} holds 5 under data.tokens_key=ids"


def write_npz(path, x, y, **more) -> str:
    np.savez(path, x=x, y=y, **more)
    return str(path)


def test_arrays_images_in_the_model_range(tmp_path):
    rng = np.random.default_rng(0)
    y = np.arange(40) % CLASSES
    x = (rng.integers(0, 200, size=(40, 10, 10)) + 20 * y[:, None, None]).astype(np.uint8)
    path = write_npz(tmp_path / "d.npz", x, y)  # grey [N, H, W], made RGB and resized
    data = build_data(compose_config([*TINY["mobilenet"], "data.batch_size=4", "data=arrays",
                                      f"data.path={path}"]), image_model=True)  # fmt: skip
    assert data.train_size == 32 and data.spec.num_classes == CLASSES  # largest label + 1
    # An epoch's batches, not the first one: which images come first depends on the global
    # seed, which an earlier run(cfg) in the same process sets.
    xs = tf.concat([x for x, _ in data.train.take(data.steps_per_epoch)], axis=0)
    assert xs.shape == (32, 32, 32, 3)
    low, high = SIGNED_UNIT  # 20..239 of [0, 255] onto MobileNetV2's [-1, 1]
    assert low < float(tf.reduce_min(xs)) < -0.8 and 0.8 < float(tf.reduce_max(xs)) < high


def test_arrays_tokens_train_transformer_per_token_and_per_example(tmp_path, store):
    x = np.array(token_examples_array(30))
    path = write_npz(tmp_path / "t.npz", x[:, :-1], x[:, 1:], labels=x[:, 0] % 4)
    overrides = tiny("transformer", store, "data=arrays", f"data.path={path}")
    data = build_data(compose_config(overrides), image_model=False)
    xs, ys = next(iter(data.train))
    assert xs.shape == (4, SEQ) and ys.shape == (4, SEQ) and data.spec.per_token
    assert data.spec.vocab_size == 16 and data.spec.num_classes == 16
    np.testing.assert_array_equal(ys.numpy(), (xs.numpy() + 1) % 16)
    assert_trained(train(overrides), store)
    data = build_data(compose_config([*overrides, "data.y_key=labels"]), image_model=False)
    _, ys = next(iter(data.train))
    assert ys.shape == (4,) and not data.spec.per_token and data.spec.num_classes == 4


def token_examples_array(n: int) -> list[list[int]]:
    return [values for ex in token_examples(n) for _, (_, values) in ex.items()]


def test_text_trains_transformer_on_bytes(tmp_path, store):
    path = tmp_path / "book.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 20)  # 900 bytes
    overrides = tiny("transformer", store, "data=text", f"data.path={path}")
    data = build_data(compose_config(overrides), image_model=False)
    windows = 900 // (SEQ + 1)
    assert data.train_size == windows - int(windows * 0.1)
    assert data.spec.vocab_size == 256 and data.spec.per_token
    xs, ys = next(iter(data.train))
    text = path.read_bytes()
    row = bytes(xs.numpy()[0].astype(np.uint8))
    assert row in text and bytes(ys.numpy()[0].astype(np.uint8)) in text
    assert text[text.index(row) + 1 : text.index(row) + 1 + SEQ] == bytes(
        ys.numpy()[0].astype(np.uint8)
    )
    assert sum(int(y.shape[0]) for _, y in data.val) == int(windows * 0.1)
    assert_trained(train(overrides), store)


CUSTOM = """
import tensorflow as tf


def tokens(n=40, seq=8, pair=False):
    x = (tf.range(n)[:, None] + tf.range(seq + 1)[None, :]) % 16
    ds = tf.data.Dataset.from_tensor_slices((x[:, :-1], x[:, 1:]))
    return (ds, ds.take(5)) if pair else ds


def images(n=12):
    x = tf.random.stateless_uniform([n, 16, 16, 3], [1, 2], 0, 255)
    return tf.data.Dataset.from_tensor_slices((x, tf.range(n) % 3))


def fails():
    raise FileNotFoundError("no shard at /data/x-0001")


def not_a_dataset():
    return [1, 2, 3]


def not_pairs():
    return tf.data.Dataset.range(10)
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """tmp_path/userdata.py, importable as it would be from the current directory."""
    (tmp_path / "userdata.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))  # as PYTHONPATH would (the cwd: test below)
    yield "userdata"
    sys.modules.pop("userdata", None)


def test_custom_function_trains_transformer(custom_module, store):
    overrides = tiny(
        "transformer", store, "data=custom", f"data._target_={custom_module}.tokens",
        "data.vocab_size=16",
    )  # fmt: skip
    data = build_data(compose_config(overrides), image_model=False)
    assert data.train_size == 40 - 8  # every 5th element validates
    xs, ys = next(iter(data.train))
    np.testing.assert_array_equal(ys.numpy(), (xs.numpy() + 1) % 16)
    assert_trained(train(overrides), store)
    pair = build_data(compose_config([*overrides, "+data.kwargs.pair=true"]), image_model=False)
    assert pair.train_size == 40 and sum(int(y.shape[0]) for _, y in pair.val) == 5


def test_custom_images_reach_the_model_range(custom_module):
    overrides = [*TINY["mobilenet"], "data.batch_size=4", "data=custom",
                 f"data._target_={custom_module}.images", "data.num_classes=3"]  # fmt: skip
    data = build_data(compose_config(overrides), image_model=True)
    xs, _ = next(iter(data.train))
    assert xs.shape == (4, 32, 32, 3)
    assert -1.0 <= float(tf.reduce_min(xs)) and float(tf.reduce_max(xs)) <= 1.0


def test_a_data_module_that_fails_on_import_is_one_line(custom_module, tmp_path):
    """The same reasons as a model's _target_ (runner/core/targets.py): a module that raises
    when imported is named with its error, not left to a traceback."""
    (tmp_path / "brokendata.py").write_text("raise RuntimeError('no credentials for the bucket')\n")
    cfg = compose_config([*TINY["transformer"][:-1], "data=custom", "data._target_=brokendata.make",
                          "data.vocab_size=16"])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        build_data(cfg, image_model=False)
    assert str(err.value) == (
        "data._target_=brokendata.make: not allowed; expected an importable function "
        "pkg.module.fn: importing brokendata failed: RuntimeError: no credentials for the bucket"
    )


# --- bad input: one line naming the key, the bad value and what is allowed -------------------


@pytest.fixture
def files(tmp_path, custom_module):
    """One file of each kind, and the current directory where userdata.py is."""
    write_records(tmp_path / "img.tfrecord", image_examples(4))
    no_label = [{"image": ("bytes", [png(1)])}]
    write_records(tmp_path / "nolabel.tfrecord", image_examples(1) + no_label)
    below = [{"image": ("bytes", [png(1)]), "label": ("int64", [-1])}]
    write_records(tmp_path / "below.tfrecord", image_examples(2) + below)
    write_records(tmp_path / "tok.tfrecord", token_examples(4))
    write_npz(tmp_path / "a.npz", np.zeros((4, SEQ), np.int32), np.zeros(4, np.int32))
    (tmp_path / "t.txt").write_text("text " * 10)
    return tmp_path


MOBILENET = ["model=mobilenet", "data.image_size=32"]
CHECKED = [  # (overrides, the start of the line, what it says is allowed)
    (["data=tfrecord", "data.path={d}/none-*.tfrecord"], "data.path={d}/none-*.tfrecord",
     "it matches no file"),
    (["data=tfrecord", "data.path={d}/tok.tfrecord", "data.val_path={d}/v*.tfrecord"],
     "data.val_path={d}/v*.tfrecord", "it matches no file"),
    ([*MOBILENET, "data=tfrecord", "data.path={d}/img.tfrecord", "data.image_key=png",
      "data.num_classes=3"], "data.image_key=png", "they hold image (bytes), label (int64)"),
    ([*MOBILENET, "data=tfrecord", "data.path={d}/img.tfrecord", "data.num_classes=1"],
     "data.num_classes=1", "the number of label classes (>= 2)"),
    ([*MOBILENET, "data=tfrecord", "data.path={d}/nolabel.tfrecord"], "data.label_key=label",
     "one class in every record; record 1 of {d}/nolabel.tfrecord holds no int64 value"),
    ([*MOBILENET, "data=tfrecord", "data.path={d}/below.tfrecord"], "data.label_key=label",
     "the labels of {d}/below.tfrecord reach -1"),
    (["data=tfrecord", "data.path={d}/img.tfrecord"], "data.tokens_key=tokens",
     "they hold image (bytes), label (int64)"),
    (["data=tfrecord", "data.path={d}/tok.tfrecord", "data.seq_len=9"], "data.seq_len=9",
     "at most 8"),
    (["data=arrays", "data.path={d}/a.npz", "data.x_key=pixels"], "data.x_key=pixels",
     "an array of {d}/a.npz: x, y"),
    (["data=arrays", "data.path={d}/a.npz", "data.seq_len=64"], "data.seq_len=64",
     "8, the length of"),
    ([*MOBILENET, "data=arrays", "data.path={d}/a.npz"], "data.x_key=x",
     "images [N, H, W] or [N, H, W, 1|3]; it is [4, 8]"),
    ([*MOBILENET, "data=text", "data.path={d}/t.txt"], "data=text", "model=transformer"),
    (["data=text", "data.path={d}/t.txt", "data.seq_len=40"], "data.seq_len=40", "2 windows"),
    (["data=custom", "data._target_=nosuchmodule.make"], "data._target_=nosuchmodule.make",
     "pkg.module.fn: no module named 'nosuchmodule' in the current directory or on PYTHONPATH"),
    (["data=custom", "data._target_=userdata.token"], "data._target_=userdata.token",
     "module 'userdata' ({d}/userdata.py) has no 'token'; did you mean tokens?"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "start", "allowed"), CHECKED, ids=[c[1] for c in CHECKED])
def test_bad_data_input_is_one_line_before_tensorflow(files, overrides, start, allowed):
    """runner.cli's check, before TensorFlow and Hydra's app start (run.py prints it)."""
    argv = [o.format(d=files) for o in overrides]
    with pytest.raises(SystemExit) as exit_:
        check_command_line(argv)
    line = str(exit_.value.code)
    assert "\n" not in line
    assert line.startswith(f"error: {start.format(d=files)}: not allowed; expected"), line
    assert allowed.format(d=files) in line, line


def test_custom_target_is_found_in_the_current_directory(files, monkeypatch):
    monkeypatch.chdir(files)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(files)])
    validate(compose_config(["data=custom", "data._target_=userdata.tokens"]))


BUILT = [  # what only the function can tell: found when the data is built
    ("nosuch", "data._target_=userdata.nosuch", "pkg.module.fn: module 'userdata' has no 'nosuch'"),
    ("fails", "data._target_=userdata.fails",
     "; it raised FileNotFoundError: no shard at /data/x-0001"),
    ("not_a_dataset", "data._target_=userdata.not_a_dataset", "; it returned list"),
    ("not_pairs", "data._target_=userdata.not_pairs", "; its training elements are TensorSpec("),
    ("images", "data._target_=userdata.images", "with inputs integer tokens [seq_len]; they are"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "start", "allowed"), BUILT, ids=[b[0] for b in BUILT])
def test_custom_function_errors_are_one_line(custom_module, fn, start, allowed):
    cfg = compose_config([*TINY["transformer"][:-1], "data=custom",
                          f"data._target_={custom_module}.{fn}", "data.vocab_size=16"])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        build_data(cfg, image_model=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{start}: not allowed; expected"), line
    assert allowed in line, line


# --- host memory: streamed vs in memory, each measured in a fresh process ---------------------

# A fresh process builds the data (after TensorFlow and tf.data have started, as in a run) and
# prints build_data's RSS growth over the setup and its first batch.
_MEASURE = """
import json, sys
import runner  # the environment TensorFlow needs, before it loads
import tensorflow as tf
from runner.config import compose_config
from runner.feed.pipelines import build_data
next(iter(tf.data.Dataset.range(8).map(lambda x: x + 1).batch(4)))
print(build_data(compose_config(json.loads(sys.argv[1])), True, measure=True).setup_rss_bytes)
"""
RSS_IMAGES = 4096  # 32x32x3 bytes each: 12 MiB of pixels at 1x, 48 MiB at 4x


def _setup_rss(overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _MEASURE, json.dumps(overrides)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # four fresh processes, each starting TensorFlow: about 30-60 s
def test_tfrecord_setup_rss_stays_flat_as_the_file_grows_arrays_grow(tmp_path):
    """Host memory of data setup at 1x and 4x the examples: TFRecord streams (its growth is
    its buffers', <= 1.2x from 1x to 4x), arrays are held in memory (growth follows the file)."""
    rng = np.random.default_rng(0)
    pngs = [png(i, size=32) for i in range(64)]
    common = ["model=mobilenet", "data.image_size=32", "data.batch_size=32",
              "data.shuffle_buffer=256", "data.val_fraction=0.1"]  # fmt: skip
    jobs = {}
    for scale in (1, 4):
        n = RSS_IMAGES * scale
        records = write_records(tmp_path / f"{scale}.tfrecord", image_examples(n, pngs=pngs))
        x = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        npz = write_npz(tmp_path / f"{scale}.npz", x, np.arange(n) % CLASSES)
        tfrecord = ["data=tfrecord", f"data.path={records}", f"data.num_classes={CLASSES}"]
        jobs[("tfrecord", scale)] = _setup_rss([*common, *tfrecord])
        jobs[("arrays", scale)] = _setup_rss([*common, "data=arrays", f"data.path={npz}"])
    rss = {}
    for key, proc in jobs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        rss[key] = int(out.split()[-1])
    shown = {f"{source} {scale}x": round(v / 2**20, 1) for (source, scale), v in rss.items()}
    print("data setup RSS growth (MiB):", shown)
    assert rss[("tfrecord", 4)] <= 1.2 * rss[("tfrecord", 1)]
    # Arrays: the 3x more pixels show, one copy of them (runner/data/arrays.py).
    assert rss[("arrays", 4)] - rss[("arrays", 1)] >= 0.8 * 3 * RSS_IMAGES * 3072


def test_every_kth_split_is_disjoint_and_complete():
    from runner.data.examples import every_kth, split_every_kth

    train, val = split_every_kth(tf.data.Dataset.range(12), 5)
    assert list(val.as_numpy_iterator()) == [0, 5, 10]
    assert list(train.as_numpy_iterator()) == [1, 2, 3, 4, 6, 7, 8, 9, 11]
    assert every_kth(12, 0.2) == (5, 3) and every_kth(40, 0.3) == (3, 14)
