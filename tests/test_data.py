"""tf.data sources: shapes, targets and determinism of each data option."""

import numpy as np
import pytest

from models.spec import RAW_PIXELS, SIGNED_UNIT
from runner.data.synthetic import token_table as _token_table
from runner.feed.pipelines import build_data
from tests.conftest import compose_config, tiny_overrides


def _first_batch(cfg, image_model):
    data = build_data(cfg, image_model=image_model)
    xs, ys = next(iter(data.train))
    return data, xs.numpy(), ys.numpy()


def test_synthetic_tokens_follow_the_next_token_rule():
    cfg = compose_config(tiny_overrides("transformer") + ["accum=3"])
    data, xs, ys = _first_batch(cfg, image_model=False)
    assert xs.shape == (4, 8) and ys.shape == (4, 8)  # micro-batches; a step draws accum
    assert xs.dtype == np.int32
    # The target is the input shifted by one: the rule x[t+1] = 5 x[t] + 3 (mod vocab).
    np.testing.assert_array_equal(ys, (5 * xs + 3) % 16)
    assert data.spec.per_token and data.spec.num_classes == 16
    assert data.steps_per_epoch == 32 // (4 * 3)


def _spans(xs, pixel_range, share):
    """xs lies in pixel_range and covers at least `share` of it."""
    low, high = pixel_range
    assert low <= xs.min() and xs.max() <= high
    assert xs.max() - xs.min() >= share * (high - low)


# Model options -> the pixel range its keras.applications preprocessing expects (issue 13).
IMAGE_RANGES = {
    "mobilenet": SIGNED_UNIT,  # v2, the default version
    "mobilenet-v3": RAW_PIXELS,
    "efficientnet": RAW_PIXELS,
}
IMAGE_OVERRIDES = {
    "mobilenet": ["model=mobilenet"],
    "mobilenet-v3": ["model=mobilenet", "model.version=v3_small"],
    "efficientnet": ["model=efficientnet"],
}


@pytest.mark.parametrize("model", IMAGE_RANGES)
def test_synthetic_images_shapes_labels_and_range(model):
    overrides = tiny_overrides(model.split("-")[0]) + IMAGE_OVERRIDES[model]
    cfg = compose_config(overrides + ["accum=2", "data.num_classes=5"])
    data, xs, ys = _first_batch(cfg, image_model=True)
    assert xs.shape == (4, 32, 32, 3) and xs.dtype == np.float32
    assert ys.shape == (4,) and set(np.unique(ys)) <= set(range(5))
    assert data.spec.input_shape == (32, 32, 3) and data.spec.num_classes == 5
    _spans(xs, IMAGE_RANGES[model], 0.9)


def test_same_seed_same_batches_other_seed_other_batches():
    overrides = tiny_overrides("transformer")
    _, a, _ = _first_batch(compose_config(overrides), False)
    _, b, _ = _first_batch(compose_config(overrides), False)
    _, c, _ = _first_batch(compose_config(overrides + ["trainer.seed=1"]), False)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("model", [*IMAGE_RANGES, "transformer"])
def test_digits_real_data(model):
    image_model = model in IMAGE_RANGES
    overrides = IMAGE_OVERRIDES.get(model, [f"model={model}"])
    cfg = compose_config(["data=digits", "data.batch_size=16", *overrides])
    data, xs, ys = _first_batch(cfg, image_model)
    assert data.train_size == 1797 - int(1797 * 0.2)
    if image_model:
        assert xs.shape == (16, 32, 32, 3)
        _spans(xs, IMAGE_RANGES[model], 0.99)  # intensities 0..16, both ends in any batch
    else:
        assert xs.shape == (16, 64) and xs.max() <= 16
    assert ys.shape == (16,) and set(np.unique(ys)) <= set(range(10))
    val_count = sum(int(y.shape[0]) for _, y in data.val)
    assert val_count == int(1797 * 0.2)


@pytest.mark.parametrize("model", ["mobilenet", "efficientnet"])
def test_image_folder_reads_class_subfolders(tmp_path, model):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "owl"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            pixels = rng.integers(0, 255, size=(40, 50, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{i}.png")
    cfg = compose_config(
        [
            *IMAGE_OVERRIDES[model],
            "data=image_folder",
            f"data.path={tmp_path}",
            "data.image_size=32",
            "data.batch_size=4",
            "data.val_fraction=0.2",
        ]
    )
    data, xs, ys = _first_batch(cfg, image_model=True)
    assert data.spec.num_classes == 3 and data.train_size == 24
    assert xs.shape == (4, 32, 32, 3)
    _spans(xs, IMAGE_RANGES[model], 0.95)  # random 8-bit pixels
    assert sum(int(y.shape[0]) for _, y in data.val) == 6


def test_token_table_is_a_permutation_walk():
    table = _token_table(16, 5)
    assert sorted(table[:, 1]) == list(range(16))  # every next token reachable exactly once
    np.testing.assert_array_equal(table[:, 0], np.arange(16))


def _pipeline_memory(overrides: list[str], image_model: bool) -> tuple[int, int, int]:
    """(spec.held_bytes, what TensorFlow's allocator grew by once the training pipeline was
    built and running, one micro-batch's bytes), on a pool grown beforehand as a run grows
    it."""
    import time

    from runner.measure.telemetry import Memory

    memory = Memory("CPU:0")
    memory.grow_pool()
    before = memory.current()
    data = build_data(compose_config(overrides), image_model)
    batches = iter(data.train)
    x, y = next(batches)
    time.sleep(1)  # the prefetch buffer fills
    return data.spec.held_bytes, memory.current() - before, x.numpy().nbytes + y.numpy().nbytes


def test_held_bytes_are_what_the_pipeline_keeps_beside_its_micro_batches(tmp_path):
    # What the estimate's `data` part counts (runner/data/examples.py held_bytes): the synthetic
    # images' templates (20 x 96x96x3 float32, 2.1 MiB), the synthetic tokens' table (1024 x
    # 256 int32, 1 MiB), a folder's decoded images in the shuffle buffer (24 x 64x64x3
    # float32, 1.1 MiB). Each at micro-batch 1, so that the pipeline's 3-5 prefetched
    # micro-batches are small beside it; each in a fresh process, as a run starts.
    from PIL import Image

    from runner.core.process import in_fresh_process

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(15):
            pixels = rng.integers(0, 255, size=(40, 50, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{i}.png")
    one = ["data.batch_size=1", "data.train_samples=64", "data.val_samples=1"]
    cases = [
        ([*IMAGE_OVERRIDES["mobilenet"], *one, "data.image_size=96", "data.num_classes=20"], True),
        ([*tiny_overrides(), *one, "data.vocab_size=1024", "data.seq_len=255"], False),
        (
            [*IMAGE_OVERRIDES["mobilenet"], "data=image_folder", f"data.path={tmp_path}",
             "data.image_size=64", "data.batch_size=1", "data.val_fraction=0.2"],
            True,
        ),
    ]  # fmt: skip
    expected = [20 * 96 * 96 * 3 * 4, 1024 * 256 * 4, 24 * 64 * 64 * 3 * 4]
    for (overrides, image_model), least in zip(cases, expected, strict=True):
        held, grown, micro_batch = in_fresh_process(_pipeline_memory, overrides, image_model)
        assert least <= held <= least + 64 * 1024  # and the shuffle buffer's indices
        # what is held, up to twice (the allocator hands a request a free chunk of up to twice
        # its size), beside the pipeline's prefetched micro-batches and its iterators' own
        # state (the token case in CI: 2,118,144 bytes for a 1,049,088-byte table, 6 of its
        # micro-batches 12,240)
        assert held <= grown <= 2 * held + 6 * micro_batch + 64 * 1024
