"""Channel groups read from a functional model's graph, and the model rebuilt without some of
them (runner/channels/): each coupling of layers, with the rebuilt model's outputs against the
large model's with the same channels masked to zero."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from runner.channels.groups import channel_groups
from runner.channels.select import by_position, choose, kept_count, scores
from runner.channels.surgery import carry_optimizer, masked, smaller, zero_removed

L = keras.layers
RNG = np.random.default_rng(5)


def _randomized(model):
    """Biases and BatchNorm's vectors away from their initial zeros and ones, so that a wrong
    slice of them shows in the outputs; kernels as Keras initializes them (their scale keeps
    the outputs near 1, where float32 resolves 1e-5)."""
    for w in model.weights:
        name = w.path.rsplit("/", 1)[-1]
        if name in ("moving_variance", "gamma"):
            w.assign(RNG.uniform(0.5, 2.0, size=w.shape).astype("float32"))
        elif name in ("moving_mean", "beta", "bias"):
            w.assign(RNG.normal(size=w.shape).astype("float32") * 0.1)
    return model


def _half(a) -> dict:
    """Every group that may lose channels keeps a random half of them (of its blocks)."""
    kept = {}
    for g in a.prunable():
        block = a.groups[g].block
        blocks = a.groups[g].size // block
        chosen = RNG.choice(blocks, max(1, blocks // 2), replace=False)
        kept[g] = np.sort((chosen[:, None] * block + np.arange(block)).ravel())
    return kept


def _same(model, kept, a, x, tol=1e-5) -> float:
    """The rebuilt model's outputs against the masked large model's; also that masking changed
    something (the test would hold trivially otherwise). Returns the params' ratio."""
    small, big = smaller(model, a, kept), masked(model, a, kept)
    got, want = small(x, training=False), big(x, training=False)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    assert np.abs(want - model(x, training=False)).max() > 100 * tol
    return small.count_params() / model.count_params()


def _couplings():
    """Residual Add, BatchNorm, a depthwise conv, a Concatenate, a squeeze-and-excitation gate
    (pooling, Reshape, a sigmoid Dense, Multiply), hard-swish as Keras operations, Flatten into
    a Dense."""
    x = keras.Input((12, 12, 3))
    a = L.ReLU()(L.BatchNormalization(name="bn_a")(L.Conv2D(16, 3, padding="same", name="a")(x)))
    b = L.BatchNormalization()(L.Conv2D(16, 3, padding="same", name="b")(a))
    c = L.ReLU()(L.Add()([a, b]))
    d = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same", name="dw")(c)))
    e, f = L.Conv2D(8, 1, name="e")(d), L.Conv2D(6, 1, activation="relu", name="f")(d)
    g = L.Conv2D(12, 1, name="after_concat")(L.BatchNormalization()(L.Concatenate()([e, f])))
    s = L.Dense(4, activation="swish", name="squeeze")(L.GlobalAveragePooling2D()(g))
    s = L.Reshape((1, 1, 12))(L.Dense(12, activation="sigmoid", name="excite")(s))
    h = L.Multiply()([g, s])
    h = h * (L.ReLU(6.0)(h + 3.0) * (1.0 / 6.0))  # hard-swish, as keras.applications writes it
    h = L.Flatten()(L.MaxPooling2D()(L.Conv2D(5, 3, activation="relu", name="last_conv")(h)))
    out = L.Dense(3, name="logits")(L.Dense(10, activation="relu", name="hidden")(h))
    return _randomized(keras.Model(x, out))


def test_each_coupling_is_one_group_and_the_rebuilt_model_equals_the_masked_one():
    model = _couplings()
    a = channel_groups(model)
    by_maker = {name: a.groups[g] for g in a.roots() for name in a.groups[g].made_by}
    assert sorted(by_maker["a"].made_by) == ["a", "b"]  # the residual Add's two producers
    assert sorted(by_maker["after_concat"].made_by) == ["after_concat", "excite"]  # the gate
    assert not a.untouched and a.groups[0].pinned == "the model's input"
    assert by_maker["logits"].pinned == "the model's output"
    assert len(a.prunable()) == 7  # a+b, e, f, after_concat+excite, squeeze, last_conv, hidden
    slots = {(s.layer, s.weight, s.axis): s for s in a.slots}
    # the depthwise kernel (3, 3, C, 1) and BatchNorm's four vectors follow the residual group
    residual = {a.find(int(g)) for g in slots["a", 0, 3].group}
    assert {a.find(int(g)) for g in slots["dw", 0, 2].group} == residual
    assert [{a.find(int(g)) for g in slots["bn_a", i, 0].group} for i in range(4)] == [residual] * 4
    # after the Concatenate, e's 8 channels then f's 6; after Flatten, each spatial place
    concat_rows = slots["after_concat", 0, 2]
    assert len(concat_rows.group) == 14 and len(set(concat_rows.group[:8].tolist())) == 1
    assert len(slots["hidden", 0, 0].group) == 5 * 5 * 5
    x = RNG.normal(size=(2, 12, 12, 3)).astype("float32")
    ratio = _same(model, _half(a), a, x)
    assert ratio < 0.5, ratio
    # keeping every channel rebuilds the same model
    every = {g: np.arange(a.groups[g].size) for g in a.prunable()}
    np.testing.assert_allclose(smaller(model, a, every)(x), model(x), atol=1e-6, rtol=0)


def test_what_the_analysis_cannot_follow_is_left_whole_and_named():
    x = keras.Input((8, 8, 4))
    gate = L.Conv2D(6, 1, activation="sigmoid", name="gate")(x)  # 0.5 where masked
    y = L.Conv2D(6, 3, name="reads_gate")(gate)
    z = L.LayerNormalization(name="ln")(L.Conv2D(6, 1, name="normed")(y))
    shared = L.Conv2D(6, 1, name="shared")
    w = L.Add()([shared(z), shared(z)])
    model = keras.Model(x, L.Conv2D(2, 1, name="out")(L.Conv2D(7, 1, name="free")(w)))
    a = channel_groups(model)
    pinned = {name: a.groups[g].pinned for g in a.roots() for name in a.groups[g].made_by}
    assert pinned["gate"] == "not zero when masked where reads_gate reads it"
    assert pinned["normed"] == "ln normalises across the channels"
    assert a.untouched == {
        "ln": "ln normalises across the channels",
        "shared": "shared is called more than once",
    }
    assert pinned["reads_gate"] == "" and pinned["free"] == ""


@pytest.mark.parametrize(
    "name",
    ["ResNet50", "MobileNetV2", "MobileNetV3Small", "EfficientNetB0", "DenseNet121"],
)
def test_keras_applications_rebuilt_without_half_of_each_group_equal_their_masked_selves(name):
    """Residual streams (ResNet50, MobileNetV2), concatenations (DenseNet121), squeeze-and-
    excitation and hard-swish (MobileNetV3Small, EfficientNetB0), at 32 px."""
    build = getattr(keras.applications, name)
    extra = {"include_preprocessing": False} if name == "MobileNetV3Small" else {}
    model = _randomized(
        build(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None,
              **extra)
    )  # fmt: skip
    a = channel_groups(model)
    assert len(a.prunable()) >= 25
    ratio = _same(model, _half(a), a, RNG.normal(size=(2, 32, 32, 3)).astype("float32"))
    assert ratio < 0.35, ratio


def test_a_transformer_loses_whole_heads_and_mlp_units_and_keeps_its_residual_width():
    """models/transformer.py at h=32, 4 heads, 2 blocks: each block's heads (query, key, value
    and output projections together) and MLP units are groups; the residual width and the
    embeddings stay whole (LayerNorm normalises across them), and nothing is left untouched."""
    from models.spec import DataSpec
    from models.transformer import build_transformer

    spec = DataSpec("tokens", (16,), 11, per_token=True, vocab_size=11)
    model = _randomized(build_transformer(spec, h=32, layers=2, heads=4))
    a = channel_groups(model)
    assert a.untouched == {} and set(a.blocks) == {"block_0", "block_1"}
    sizes = sorted(a.groups[g].size for g in a.prunable())
    assert sizes == [4, 4, 128, 128], sizes
    kept = {g: np.sort(RNG.choice(a.groups[g].size, a.groups[g].size // 2, replace=False))
            for g in a.prunable()}  # fmt: skip
    x = RNG.integers(0, 11, size=(2, 16)).astype("int32")
    ratio = _same(model, kept, a, x)
    small = smaller(model, a, kept)
    block = small.get_layer("block_0")
    assert (block.heads, block.key_dim, block.mlp_units) == (2, 8, 64)
    h, inner, units = 32, 2 * 8, 64  # 2 heads of 8, 64 hidden units left in each block
    block = 3 * (h * inner + inner) + (inner * h + h) + 2 * 2 * h + (h * units + units)
    block += units * h + h
    rest = 11 * h + 16 * h + 2 * h + (h * 11 + 11)  # embeddings, the final norm, the head
    assert small.count_params() == 2 * block + rest
    assert ratio == pytest.approx((2 * block + rest) / (2 * (12 * h * h + 13 * h) + rest))


def test_a_group_norm_loses_whole_groups_of_its_channels():
    """GroupNormalization(4) over 16 channels: its channel group loses aligned blocks of 4, the
    layer keeps as many groups as blocks are left, and the statistics of the others stay."""
    x = keras.Input((8, 8, 3))
    y = L.GroupNormalization(4, name="gn")(L.Conv2D(16, 3, name="conv")(x))
    y = L.Activation("gelu")(y)
    model = _randomized(keras.Model(x, L.Dense(3)(L.GlobalAveragePooling2D()(y))))
    a = channel_groups(model)
    (conv,) = [a.groups[g] for g in a.prunable()]
    assert conv.made_by == ["conv"] and conv.block == 4
    kept = _half(a)
    _same(model, kept, a, RNG.normal(size=(2, 8, 8, 3)).astype("float32"))
    assert smaller(model, a, kept).get_layer("gn").groups == 2


def test_keras_attention_loses_whole_heads():
    """keras.layers.MultiHeadAttention in a user's functional model, self-attention with a
    residual: its heads are a group, its output joins the residual stream's producer."""
    x = keras.Input((10, 6))
    t = L.Dense(16, name="embed")(x)
    attended = L.MultiHeadAttention(4, 8, name="mha")(t, t)
    y = L.Dense(32, activation="gelu", name="up")(L.Add()([t, attended]))
    model = _randomized(keras.Model(x, L.Dense(3, name="head")(L.GlobalAveragePooling1D()(y))))
    a = channel_groups(model)
    by_maker = {name: a.groups[g] for g in a.prunable() for name in a.groups[g].made_by}
    assert sorted(by_maker["embed"].made_by) == ["embed", "mha"] and "up" in by_maker
    assert sorted(a.groups[g].size for g in a.prunable()) == [4, 16, 32]
    kept = _half(a)
    _same(model, kept, a, RNG.normal(size=(2, 10, 6)).astype("float32"))
    small = smaller(model, a, kept).get_layer("mha")
    assert (small.num_heads, small.key_dim) == (2, 8)


def test_training_goes_on_in_the_small_model_as_in_the_masked_large_one():
    """Adam's moments sliced with the weights (carry_optimizer): a step of the small model
    equals a step of the masked large model with its masks applied again after the update
    (what a pruner does), on every kept weight. Without the slots' slicing the moments would
    start again from zero, and the step would differ."""
    model = _couplings()
    a = channel_groups(model)
    kept = _half(a)
    x = RNG.normal(size=(4, 12, 12, 3)).astype("float32")
    y = RNG.integers(0, 3, size=(4,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train(m, opt, steps):
        for _ in range(steps):
            with tf.GradientTape() as tape:
                value = loss(y, m(x, training=False))
            opt.apply(tape.gradient(value, m.trainable_variables), m.trainable_variables)

    big = masked(model, a, kept)
    adam = keras.optimizers.Adam(1e-2)
    for _ in range(3):  # moments to carry; the masks again after each update
        train(big, adam, 1)
        zero_removed(big, a, kept)
    small = smaller(big, a, kept)
    carried = carry_optimizer(adam, big, small, a, kept)
    assert int(carried.iterations) == 3
    train(big, adam, 1)
    zero_removed(big, a, kept)
    train(small, carried, 1)
    np.testing.assert_allclose(small(x), big(x), atol=1e-5, rtol=0)
    fresh = keras.optimizers.Adam(1e-2)
    again = smaller(masked(model, a, kept), a, kept)
    train(again, fresh, 1)
    assert np.abs(again(x) - small(x)).max() > 1e-3


def test_each_group_keeps_its_highest_scoring_channels_in_whole_units():
    """l1 scores add a channel's |w| over every weight of its group; the count kept is the
    nearest multiple of round_to channels (a head counts key_dim of them) and of a
    GroupNormalization's blocks, at least one unit, all of them in a group of one unit."""
    x = keras.Input((6, 6, 3))
    y = L.Conv2D(32, 1, use_bias=False, name="wide")(x)
    y = L.GroupNormalization(4, name="gn")(L.Conv2D(24, 1, name="grouped")(L.ReLU()(y)))
    model = keras.Model(x, L.Dense(2)(L.GlobalAveragePooling2D()(L.Conv2D(6, 1, name="few")(y))))
    wide = model.get_layer("wide").kernel
    value = np.full(wide.shape, 0.01, "float32")
    value[..., [3, 9, 30]] = 5.0  # three loud filters
    wide.assign(value)
    a = channel_groups(model)
    by_maker = {a.groups[g].made_by[0]: g for g in a.prunable()}

    def l1(name, index):  # |w| of each element of a weight
        return np.abs(keras.ops.convert_to_numpy(model.get_layer(name).weights[index]))

    score = scores(a, by_position(l1))
    assert set(np.argsort(-score[by_maker["wide"]])[:3]) == {3, 9, 30}
    kept = choose(a, score, 0.5, 8)
    assert {3, 9, 30} <= set(kept[by_maker["wide"]].tolist())
    assert len(kept[by_maker["wide"]]) == 16  # 32 x 0.5, a multiple of 8
    # 24 channels in GroupNormalization blocks of 6, counts a multiple of 8: lcm 24, all stay
    assert len(kept[by_maker["grouped"]]) == 24
    assert len(kept[by_maker["few"]]) == 6  # 6 channels, fewer than one unit of 8: all stay
    assert kept_count(24, 0.5, 24) == 24 and kept_count(48, 0.5, 24) == 24
    assert kept_count(40, 0.9, 8) == 8 and kept_count(40, 0.3, 8) == 24  # 28: 24, at least 30% go
    assert kept_count(12, 0.0, 8) == 12  # nothing to go: all stay, though not a multiple of 8
