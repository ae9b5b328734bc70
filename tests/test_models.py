"""Model builders at tiny sizes: shapes, dtypes under each precision policy, pinned counts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from models.efficientnet import build_efficientnet  # noqa: E402
from models.mobilenet import build_mobilenet  # noqa: E402
from models.spec import DataSpec  # noqa: E402
from models.transformer import TransformerBlock, build_transformer  # noqa: E402

VOCAB, SEQ = 50, 16
LM = DataSpec("tokens", (SEQ,), VOCAB, per_token=True, vocab_size=VOCAB)
CLS = DataSpec("tokens", (SEQ,), 3, per_token=False, vocab_size=VOCAB)
TINY_IMAGE = DataSpec("image", (32, 32, 3), 10)
IMAGENET = DataSpec("image", (224, 224, 3), 1000)

TINY_BUILDERS = {
    "transformer_lm": (lambda: build_transformer(LM, h=32, layers=2), LM, (2, SEQ, VOCAB)),
    "transformer_cls": (lambda: build_transformer(CLS, h=32, layers=2), CLS, (2, 3)),
    "mobilenet_v2": (lambda: build_mobilenet(TINY_IMAGE, alpha=0.35), TINY_IMAGE, (2, 10)),
    "mobilenet_v3_small": (
        lambda: build_mobilenet(TINY_IMAGE, version="v3_small"),
        TINY_IMAGE,
        (2, 10),
    ),
    "efficientnet_b0": (lambda: build_efficientnet(TINY_IMAGE), TINY_IMAGE, (2, 10)),
}


def block_params(h):
    return 12 * h * h + 13 * h


def batch(spec, n=2):
    if spec.kind == "tokens":
        return np.random.default_rng(0).integers(0, spec.vocab_size, (n, *spec.input_shape))
    return np.random.default_rng(0).uniform(0, 255, (n, *spec.input_shape)).astype("float32")


@pytest.fixture(autouse=True)
def fresh_session():
    keras.backend.clear_session()
    yield


@pytest.fixture(params=["float32", "mixed_float16", "mixed_bfloat16"])
def policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    try:
        yield keras.DTypePolicy(request.param)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("name", TINY_BUILDERS)
def test_output_shape_and_dtypes_under_policy(name, policy):
    build, spec, shape = TINY_BUILDERS[name]
    model = build()
    out = model(batch(spec), training=False)
    assert tuple(out.shape) == shape
    assert out.dtype == "float32" and model.output.dtype == "float32"
    # The bulk of the model computes in the policy's dtype and keeps float32 variables.
    dense = [layer for layer in model.layers if layer.weights and layer.name != "logits"]
    assert dense and all(layer.compute_dtype == policy.compute_dtype for layer in dense)
    assert {v.dtype for v in model.trainable_variables} == {"float32"}


def test_transformer_block_count_and_causality():
    model = build_transformer(LM, h=32, layers=2)
    blocks = [model.get_layer(f"block_{i}") for i in range(2)]
    assert all(isinstance(b, TransformerBlock) and b.causal for b in blocks)
    assert all(b.count_params() == block_params(32) for b in blocks)
    assert not build_transformer(CLS, h=32).get_layer("block_0").causal
    # Causal: changing the last token must not change the logits of earlier positions.
    x = batch(LM)
    y = x.copy()
    y[:, -1] = (y[:, -1] + 1) % VOCAB
    diff = np.abs(np.asarray(model(x)) - np.asarray(model(y))).max(axis=-1)
    assert diff[:, :-1].max() < 1e-5 and diff[:, -1].max() > 0


@pytest.mark.parametrize("h", [32, 256])
def test_transformer_block_pinned_count(h):
    block = TransformerBlock(h, heads=4)
    block.build((None, SEQ, h))
    assert block.count_params() == block_params(h)
    if h == 256:
        assert block.count_params() == 789_760


@pytest.mark.parametrize("spec", [LM, CLS], ids=["lm", "cls"])
def test_transformer_total_equals_formula(spec):
    h, layers = 32, 3
    model = build_transformer(spec, h=h, layers=layers)
    embeddings = VOCAB * h + SEQ * h
    head = h * spec.num_classes + spec.num_classes
    assert model.count_params() == embeddings + layers * block_params(h) + 2 * h + head


def test_mobilenet_v2_pinned_count():
    model = build_mobilenet(IMAGENET)
    assert model.count_params() == 3_538_984
    # Flat functional graph: the application's layers are top-level, not a nested sub-model.
    assert not any(isinstance(layer, keras.Model) for layer in model.layers)
    assert model.get_layer("block_1_project_BN") is not None
    assert model.layers[-1].name == "logits_float32"


def test_efficientnet_b0_pinned_count():
    assert build_efficientnet(IMAGENET).count_params() == 5_330_571


def test_weights_round_trip(tmp_path):
    path = str(tmp_path / "tiny.weights.h5")
    model = build_transformer(CLS, h=32, layers=1)
    model.save_weights(path)
    keras.backend.clear_session()
    again = build_transformer(CLS, h=32, layers=1, weights=path)
    x = batch(CLS)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(again(x)), atol=1e-6)


ERRORS = {
    "variant": (lambda: build_efficientnet(TINY_IMAGE, variant="B9"), "model.variant"),
    "version": (lambda: build_mobilenet(TINY_IMAGE, version="v4"), "model.version"),
    "h_heads": (lambda: build_transformer(LM, h=30, heads=4), "model.h=30.*model.heads=4"),
    "kind_transformer": (lambda: build_transformer(TINY_IMAGE), "model=transformer needs token"),
    "kind_mobilenet": (lambda: build_mobilenet(LM), "model=mobilenet needs image data"),
    "kind_efficientnet": (lambda: build_efficientnet(LM), "model=efficientnet needs image data"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_key(case):
    build, match = ERRORS[case]
    with pytest.raises(ValueError, match=match):
        build()


def test_missing_weights_file_names_the_path():
    with pytest.raises(FileNotFoundError, match="/no/such.weights.h5"):
        build_transformer(LM, h=32, weights="/no/such.weights.h5")
