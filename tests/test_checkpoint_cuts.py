"""Checkpointing on models without block names (issue 28): cut points that every path crosses,
never a live skip connection; blocks by structure; the same gradients and BatchNorm state;
a lower measured peak; subclassed models refused in one line."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from runner.bench.cuts import measure, resnet_like, unet
from runner.core.process import in_fresh_process
from runner.techniques import checkpointing, graph_cuts


def _crossed_by_every_path(graph, tensor) -> bool:
    """Independent of graph_cuts' live-set sweep: with `tensor` removed, no output is reachable
    from the inputs (so no skip connection goes around it)."""
    readers = {}
    for node in (n for nodes in graph._nodes_by_depth.values() for n in nodes):
        for t in node.input_tensors:
            readers.setdefault(id(t), []).append(node)
    seen, todo = set(), [t for t in graph.inputs if t is not tensor]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for node in readers.get(id(t), []):
            todo += [out for out in node.outputs if out is not tensor]
    return not any(id(t) in seen for t in graph.outputs)


def _check_segments(model, policy: str = "blocks"):
    """The cuts, and the rebuilt model's segments: each op in exactly one place."""
    graph = graph_cuts.graph_of(model, policy)
    bounds, how = graph_cuts.block_boundaries(graph)
    assert how == "structure"
    for t in bounds:
        assert _crossed_by_every_path(graph, t), t._keras_history[0].name
    _, info = checkpointing.apply(model, policy, 2)
    inside = [name for ops in info.segment_ops for name in ops]
    assert len(inside) == len(set(inside))  # no layer in two segments
    return bounds, info


def _producers(tensors) -> list[str]:
    return [t._keras_history[0].name for t in tensors]


def test_resnet_like_is_cut_between_residual_blocks_never_across_a_shortcut():
    keras.backend.clear_session()
    model = resnet_like()
    bounds, info = _check_segments(model)
    # the stem conv, three residual blocks (each ends at the ReLU after its add; the last takes
    # the pooling along, cheap layers joining the block before them), the Dense head
    ends = ["re_lu", "re_lu_2", "re_lu_4", "global_average_pooling2d", "dense"]
    assert _producers(bounds) == ["input_layer", *ends]
    assert info.segments == 5
    assert checkpointing.apply(model, "sqrt", 2)[1].segments == 2  # ceil(sqrt(5)) = 3 blocks
    # a cut point is not always a block end (after each layer of the stem, after each add),
    # and none falls inside a residual block, where its shortcut is live
    cuts = _producers(graph_cuts.cut_points(model))
    assert {"conv2d", "batch_normalization", "add"} <= set(cuts)
    assert not {"re_lu_1", "re_lu_3", "re_lu_5", "conv2d_3"} & set(cuts)


def test_unet_keeps_every_skip_inside_one_block():
    keras.backend.clear_session()
    model = unet()
    bounds, info = _check_segments(model)
    # conv, conv (the first skip), all between the first skip and the last concatenation,
    # the last two convs (the second with the pooling), the Dense head
    assert _producers(bounds)[1:] == [
        "re_lu", "re_lu_1", "concatenate_1", "re_lu_7", "global_average_pooling2d", "dense"
    ]  # fmt: skip
    assert info.segments == 6
    assert {"max_pooling2d", "concatenate", "re_lu_4"} <= info.segment_ops[2]


def test_sequential_chain_gets_one_block_per_convolution_and_several_inputs_start_at_merge():
    keras.backend.clear_session()
    layers = [keras.Input((8, 8, 3))]
    for _ in range(3):
        layers += [keras.layers.Conv2D(4, 3, padding="same"), keras.layers.BatchNormalization()]
        layers += [keras.layers.ReLU()]
    model = keras.Sequential([*layers, keras.layers.Flatten(), keras.layers.Dense(2)])
    _, info = _check_segments(model)
    assert info.blocks == 4  # three Conv-BN-ReLU (the last with Flatten), then the Dense
    a, b = keras.Input((4,)), keras.Input((4,))
    x = keras.layers.Concatenate()([keras.layers.Dense(4)(a), keras.layers.Dense(4)(b)])
    x = keras.layers.Dense(2)(keras.layers.ReLU()(keras.layers.Dense(4)(x)))
    model = keras.Model([a, b], x)
    rebuilt, info = checkpointing.apply(model, "blocks", 2)
    assert info.blocks == 2 and "concatenate" not in set().union(*info.segment_ops)
    xs = [tf.random.normal((2, 4)), tf.random.normal((2, 4))]
    np.testing.assert_allclose(rebuilt(xs), model(xs), rtol=1e-6)


def test_resnet_like_gradients_and_batchnorm_state_equal_the_plain_models():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = resnet_like()
    x, y = tf.random.normal((4, 32, 32, 3)), tf.constant([1, 2, 3, 4])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    start = [v.numpy() for v in model.non_trainable_variables]
    results = []
    for policy in ("none", "blocks", "sqrt"):
        rebuilt, _ = checkpointing.apply(model, policy, 2)  # shares the model's layers

        @tf.function
        def step(rebuilt=rebuilt):
            with tf.GradientTape() as tape:
                value = loss(y, rebuilt(x, training=True))
            return tape.gradient(value, model.trainable_variables)

        for variable, value in zip(model.non_trainable_variables, start, strict=True):
            variable.assign(value)
        grads = [g.numpy() for g in step()]
        results.append(grads + [v.numpy() for v in model.non_trainable_variables])
    assert not np.allclose(results[0][-1], start[-1])  # the statistics did move, once
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("policy", ["blocks", "sqrt", "every", "selective"])
def test_subclassed_model_is_refused_in_one_line(policy):
    model = _Subclassed()
    model(tf.zeros((1, 4)))
    with pytest.raises(ValueError, match=f"checkpointing={policy}: .*subclassed.*no policy") as e:
        checkpointing.apply(model, policy, 2)
    assert "\n" not in str(e.value)


def test_blocks_lower_the_measured_peak_of_a_resnet_like_model(capfd):
    # State equality alone would pass a Remat that skipped recomputation; the allocator's
    # peak does not. Each row is a whole optimizer step (Adam), the median of 3. Fresh
    # process: BFC allocator on, nothing else allocated before.
    rows = in_fresh_process(measure, "resnet_like", ("blocks",))
    none, blocks = rows
    assert blocks["segments"] == 5 and blocks["state_equal"]
    assert blocks["peak/none"] < 0.85, rows  # measured 0.67-0.75
    # The fresh process started TensorFlow quietly (runner/core/process.py), though importing
    # `measure`'s module imports it: no absl or C++ start-up lines on its stderr.
    err = capfd.readouterr().err
    assert "absl::InitializeLog" not in err and "cudart_stub" not in err, err[-2000:]
