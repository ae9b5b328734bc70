"""tf.data sources: shapes, targets and determinism of each data option."""

import numpy as np
import pytest

from models.spec import RAW_PIXELS, SIGNED_UNIT
from runner.train.data import _token_table, build_data
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
