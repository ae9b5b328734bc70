"""Image models get the pixel range their keras.applications preprocessing expects (issue 13).

A ramp of all 256 pixel levels goes through the real pipeline (a PNG folder read by
data=image_folder) and then through each model's input stage, under every precision policy.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from models.spec import EFFICIENTNET_VARIANTS, MOBILENET_VERSIONS, input_range  # noqa: E402
from runner.feed.pipelines import build_data  # noqa: E402
from runner.train.job import build_model  # noqa: E402
from tests.conftest import compose_config  # noqa: E402

SIZE = 32
# Every 8-bit level, 4 pixels each, the same in R, G and B: a 32x32 image.
RAMP = np.repeat(np.arange(256, dtype=np.uint8), 4).reshape(SIZE, SIZE, 1).repeat(3, axis=-1)
APPS = keras.applications
MODELS = {
    "mobilenet_v2": (["model=mobilenet", "model.version=v2"], APPS.mobilenet_v2),
    "mobilenet_v3_small": (["model=mobilenet", "model.version=v3_small"], APPS.mobilenet_v3),
    "mobilenet_v3_large": (["model=mobilenet", "model.version=v3_large"], APPS.mobilenet_v3),
    "efficientnet_b0": (["model=efficientnet", "model.variant=B0"], APPS.efficientnet),
}
# Every option -> the keras.applications module whose preprocess_input defines its range.
PREPROCESS = {("mobilenet", v): APPS.mobilenet_v3 for v in MOBILENET_VERSIONS}
PREPROCESS["mobilenet", "v2"] = APPS.mobilenet_v2
PREPROCESS.update(
    {
        ("efficientnet", v): APPS.efficientnet_v2 if v.startswith("V2") else APPS.efficientnet
        for v in EFFICIENTNET_VARIANTS
    }
)
MIN_LEVELS = 200  # of 256; the bar for "the image survives the input stage"


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """name -> (the ramp as the image_folder pipeline feeds that model, its config)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("ramp")
    for cls in ("a", "b"):
        (folder / cls).mkdir()
        for i in range(5):
            Image.fromarray(RAMP).save(folder / cls / f"{i}.png")
    cache = {}

    def feed(name):
        if name not in cache:
            overrides, _ = MODELS[name]
            alpha = ["model.alpha=0.35"] if "mobilenet" in name else []
            cfg = compose_config(
                [*overrides, *alpha, "data=image_folder", f"data.path={folder}"]
                + [f"data.image_size={SIZE}", "data.batch_size=1", "data.val_fraction=0.2"]
            )
            data = build_data(cfg, image_model=True)
            cache[name] = (next(iter(data.train))[0].numpy(), cfg, data.spec)
        return cache[name]

    return feed


@pytest.fixture(params=["float32", "mixed_float16", "mixed_bfloat16"])
def policy(request):
    previous = keras.config.dtype_policy()
    keras.backend.clear_session()  # resets the global policy too: set it after
    keras.config.set_dtype_policy(request.param)
    try:
        yield request.param
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize(("model", "option"), PREPROCESS)
def test_input_range_is_what_keras_preprocessing_makes_of_raw_pixels(model, option):
    ends = PREPROCESS[model, option].preprocess_input(np.array([0.0, 255.0], np.float32))
    version = option if model == "mobilenet" else "v2"  # EfficientNets have no version
    np.testing.assert_allclose(input_range(model, version), ends)


def test_input_range_refuses_a_token_model():
    with pytest.raises(ValueError, match="model=transformer takes no images"):
        input_range("transformer")


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_feeds_what_keras_preprocessing_expects(name, fed):
    x, _, _ = fed(name)
    # preprocess_input defines each model's range from raw [0, 255] pixels (a copy: V2's
    # works in place on numpy arrays).
    expected = MODELS[name][1].preprocess_input(RAMP[None].astype(np.float32).copy())
    np.testing.assert_allclose(x, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_input_stage_keeps_the_ramp_under_each_policy(name, fed, policy):
    x, cfg, spec = fed(name)
    model = build_model(cfg.model, spec)
    conv = next(layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D))
    assert conv.compute_dtype == keras.DTypePolicy(policy).compute_dtype
    # Everything before the first conv (in-model rescaling, normalisation, padding), then the
    # cast to the dtype the conv computes in: what the first conv sees of the image.
    stage = keras.Model(model.input, conv.input)
    seen = np.asarray(keras.ops.cast(stage(x), conv.compute_dtype), dtype=np.float32)
    levels = min(len(np.unique(seen[..., c])) for c in range(3))
    assert levels >= MIN_LEVELS, f"{name} under {policy}: {levels} of 256 levels left"
