"""The estimate's backward walk on functional graphs (runner/estimate/graph_walk.py): where the peak
is, what a concatenation's backward holds, and what GELU keeps, against the allocator."""

import keras
import pytest
import tensorflow as tf

from runner.core.process import in_fresh_process
from runner.estimate import graph_walk, layer_rules, timeline
from runner.techniques.checkpointing import RematInfo
from tests.peaks import least_peak

L = keras.layers


@pytest.fixture(autouse=True)
def fresh_session():
    keras.backend.clear_session()
    yield


def skip_and_concat():
    """a (1x1 conv, 8 channels) -> b (1x1 conv, 8) -> concat [a, b] (16) -> c (1x1 conv, 4) ->
    pooling -> head, on 8x8x3 images: a's output is read on both sides of b (a skip), and the
    concatenation's output (1024 elements an example) is the largest tensor."""
    x = keras.Input((8, 8, 3))
    a = L.Conv2D(8, 1, name="a")(x)
    b = L.Conv2D(8, 1, name="b")(a)
    merged = L.Concatenate(name="concat")([a, b])
    c = L.Conv2D(4, 1, name="c")(merged)
    pooled = L.GlobalAveragePooling2D(name="pool")(c)
    return keras.Model(x, L.Dense(10, name="head")(pooled))


def test_the_peak_is_a_concatenations_backward_beside_the_next_convolutions_filter_gradient():
    # Per example, float32. The concatenation's backward holds its output gradient (1024
    # elements) beside its inputs' (512 + 512). c's filter gradient runs beside it, so c's
    # output gradient (256) and c's input, the concatenation's output (1024), are alive too,
    # beside a's output, which b reads (512): 1536 kept, 2304 of workspace, the largest moment
    # (c's own backward: 1536 + 1280; b's: 512 + 1024 + a's gradient waiting, 512). Without
    # the concatenation's input gradients the peak was c's backward (1536 + 1280); without
    # the filter gradient's overlap, the concatenation's (512 + 2048).
    activations, workspace = graph_walk.walk(skip_and_concat(), 4, 4, RematInfo())
    assert (activations, workspace) == (1536 * 4 * 4, 2304 * 4 * 4)


def _peak_over_step(model, x) -> int:
    """The allocator's peak over one forward+backward above what was held: the least of 3 calls
    after a warm-up (tests/peaks.py least_peak). The rules it checks are what a layer keeps; a
    single call beside the suite's other worker held one more tensor a layer (hard-swish 1.335
    of the rule in a CI run, 1.000 in every run here)."""

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, [x])

    return least_peak(lambda: [g.numpy() for g in step()])


def gelu_chain(depth: int, activation: str = "gelu") -> keras.Model:
    x = keras.Input((16, 16, 32))
    y = x
    for _ in range(depth):
        y = L.Activation(activation)(y)
    return keras.Model(x, y)


def test_gelu_keeps_three_tensors_its_gradient_reads_as_measured():
    # Four more Activation("gelu") add what they keep to the peak of a forward+backward:
    # tf.nn.gelu's gradient reads x/2, -x/sqrt(2) and erfc(-x/sqrt(2)) (3 tensors, plus the
    # erfc gradient's square computed ahead: measured 3.25). The old rule kept GELU's input
    # (1 tensor a layer).
    x = tf.random.normal((8, 16, 16, 32))
    tensor = 8 * 16 * 16 * 32 * 4
    measured = (_peak_over_step(gelu_chain(6), x) - _peak_over_step(gelu_chain(2), x)) / 4
    assert layer_rules.OWN_KEPT["Activation:gelu"] == 3
    estimated = [graph_walk.walk(gelu_chain(d), 8, 4, RematInfo()) for d in (2, 6)]
    per_layer = (sum(estimated[1]) - sum(estimated[0])) / 4
    assert per_layer == 3 * tensor
    assert 0.85 <= measured / per_layer <= 1.25


def test_a_depthwise_grouped_convolution_holds_xlas_dense_filter_gradient_at_any_batch():
    # Conv2D(64, 7, groups=64) on 4x4x64: Keras runs it under XLA, whose CPU backward builds
    # the filter gradient as a dense 7x7x64x64 convolution and masks it: 2 x 802,816 bytes,
    # the same at batch 1 and 8. The old rule had no such term (its workspace was an output).
    model = _grouped()
    buffer = 2 * 7 * 7 * 64 * 64 * 4
    for batch in (1, 8):
        activations, workspace = graph_walk.walk(model, batch, 4, RematInfo())
        assert workspace == buffer + 2 * 4 * 4 * 64 * 4 * batch  # and its gradient pair
    # A fresh process: in one that ran other tests, the allocator's free chunks held each of
    # the two 802,816-byte buffers whole (it splits a chunk only at twice the request), and the
    # peak read 2,824,448 bytes against 1,671,168 estimated (1.69x; alone: within the band).
    measured = in_fresh_process(_grouped_peak)
    assert 0.9 <= measured / (activations + workspace) <= 1.25


def _grouped() -> keras.Model:
    x = keras.Input((4, 4, 64))
    return keras.Model(x, L.Conv2D(64, 7, padding="same", groups=64)(x))


def _grouped_peak() -> int:
    return _peak_over_step(_grouped(), tf.random.normal((8, 4, 4, 64)))


def test_under_xla_on_a_cpu_a_depthwise_convolution_holds_the_dense_filter_gradient(xla_peaks):
    # DepthwiseConv2D(3) on 4x4x256 in a step XLA compiles: XLA's CPU backward builds its
    # filter gradient as a dense 3x3x256x256 convolution and masks it, as a grouped Conv2D's
    # (2 x 2,359,296 bytes). Keras MobileNet (53 px, batch 1) under trainer.jit_compile=true
    # had read 1.97x its estimate for this (EfficientNet B0 at 134 px: 4.56x). Not compiled,
    # TensorFlow's own depthwise kernels hold no such buffer.
    model = _depthwise()
    buffer = 2 * 3 * 3 * 256 * 256 * 4
    assert layer_rules.grouped_conv_bytes(model.layers[1], xla=False) == 0
    walked = {
        xla: sum(graph_walk.walk_step(model, 8, 4, RematInfo(), timeline.Executor(cpu_xla=xla)))
        for xla in (False, True)
    }
    assert walked[True] - walked[False] == buffer
    measured = xla_peaks["depthwise"]
    assert 0.85 <= measured / walked[True] <= 1.15, (measured, walked)


@pytest.fixture(scope="module")
def xla_peaks() -> dict[str, int]:
    """Requested bytes of the steps XLA compiles below, all in one fresh process."""
    return in_fresh_process(_xla_peaks)


def _xla_peaks() -> dict[str, int]:
    return {"depthwise": _depthwise_xla_peak(), **_kernel_copies_xla_peaks()}


def _depthwise() -> keras.Model:
    x = keras.Input((4, 4, 256))
    return keras.Model(x, L.DepthwiseConv2D(3, padding="same")(x))


def _depthwise_xla_peak() -> int:
    """Requested bytes (tests/peaks.py): the allocator handed XLA's 4.7 MiB buffer a chunk of
    8 MiB whole (it splits one only at twice the request), 8,537,088 bytes at the peak."""
    from tests.peaks import requested_peak

    model, x = _depthwise(), tf.random.normal((8, 4, 4, 256))
    wrt = [x, *model.trainable_variables]

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, wrt)

    return requested_peak(lambda: [g.numpy() for g in step()])


def test_under_xla_on_a_cpu_convolution_kernels_are_kept_transposed_and_in_float32(xla_peaks):
    # Four 1x1 Conv2D (256 -> 512 -> 512 -> 512 -> 512) on 4x4 maps at batch 2: activations of
    # 64 KiB, kernels of 3.5 MiB in float32. XLA on a CPU transposes each kernel whose input
    # gradient it computes (not the first layer's: it reads the model's input) when the step
    # starts and keeps it until that layer's backward: 3 MiB beside the walk's 0.375. In
    # bfloat16 it also keeps each kernel rounded and converted back to float32 (3.5 MiB) in
    # place of the bfloat16 casts (1.75 MiB). EfficientNetV2B2 had read 1.25-1.28x its
    # estimate under trainer.jit_compile=true for these.
    measured = xla_peaks
    transposes, converted = 3 * 512 * 512 * 4, (256 + 3 * 512) * 512 * 4
    for policy, p in (("float32", 4), ("mixed_bfloat16", 2)):
        model = _conv_stack(policy)
        # The estimate walks a step XLA compiles on a CPU at float32's width (CPU_XLA_BYTES).
        walked = {
            xla: sum(
                graph_walk.walk_step(
                    model, 2, 4 if xla else p, RematInfo(), timeline.Executor(cpu_xla=xla)
                )
            )
            for xla in (False, True)
        }
        copies = transposes + (converted if p < 4 else 0)  # in place of bfloat16's casts
        assert copies <= walked[True] <= copies + walked[False], (policy, walked)
        assert 0.85 <= measured[policy] / walked[True] <= 1.15, (policy, measured, walked)


def _conv_stack(policy: str) -> keras.Model:
    x = keras.Input((4, 4, 256))
    y = x
    for _ in range(4):
        y = L.Conv2D(512, 1, dtype=policy)(y)
    return keras.Model(x, y)


def _kernel_copies_xla_peaks() -> dict[str, int]:
    """Requested bytes (tests/peaks.py) of a step XLA compiles, its weight gradients summed
    (so that none is kept to its end: the kernels' copies are the step's largest tensors)."""
    from tests.peaks import requested_peak

    peaks = {}
    for policy in ("float32", "mixed_bfloat16"):
        model, x = _conv_stack(policy), tf.random.normal((2, 4, 4, 256))

        @tf.function(jit_compile=True)
        def step(model=model, x=x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(model(x, training=True), "float32"))
            grads = tape.gradient(loss, model.trainable_variables)
            return tf.add_n([tf.reduce_sum(g) for g in grads])

        peaks[policy] = requested_peak(lambda step=step: step().numpy())
    return peaks


def test_hard_swish_keeps_its_input_and_two_tensors_its_gradient_reads_as_measured():
    # MobileNetV3's hard-swish, x * (relu6(x + 3) / 6): the product's gradient reads x and the
    # quotient, the division's and Relu6's read relu6's output (measured: 3 tensors a layer in
    # float32). The old rule kept x only, and MobileNetV3 read 1.44-1.52x its estimate.
    x = tf.random.normal((8, 16, 16, 32))
    tensor = 8 * 16 * 16 * 32 * 4
    chains = {d: gelu_chain(d, "hard_swish") for d in (2, 6)}
    measured = (_peak_over_step(chains[6], x) - _peak_over_step(chains[2], x)) / 4
    estimated = [sum(graph_walk.walk(chains[d], 8, 4, RematInfo())) for d in (2, 6)]
    per_layer = (estimated[1] - estimated[0]) / 4
    assert per_layer == 3 * tensor
    # 0.85-1.25 as the GELU chain's: in a suite worker the allocator's chunks read 1.114
    # (876,160 bytes a layer); the old rule's one tensor reads 3x.
    assert 0.85 <= measured / per_layer <= 1.25


def _pooled_16_bit() -> keras.Model:
    x = keras.Input((32, 32, 64))
    y = L.ReLU(dtype="mixed_bfloat16", name="relu")(x)
    return keras.Model(x, L.GlobalAveragePooling2D(dtype="mixed_bfloat16", name="pool")(y))


def test_global_average_pooling_of_a_16_bit_map_holds_a_float32_gradient_of_its_size():
    # Keras's mean casts a 16-bit map to float32 before reducing it, so the pooling's gradient
    # is a float32 broadcast over the map, cast back to bfloat16 beside it: 6 bytes an element,
    # with the ReLU's kept bfloat16 output 8 in all (measured: 8.0). The old rule (the gradient
    # at the map's own width, 6 in all) read 1.33x. A fresh process: in a suite worker that
    # had run other tests, the allocator's free chunks read 5,980,160 bytes (1.43x).
    measured = in_fresh_process(_pooled_peak)
    estimated = sum(graph_walk.walk(_pooled_16_bit(), 8, 2, RematInfo()))
    assert 0.85 <= measured / estimated <= 1.25, (measured, estimated)


def _pooled_peak() -> int:
    return _peak_over_step(_pooled_16_bit(), tf.random.normal((8, 32, 32, 64)))


def _wide(activation: str, own: bool) -> keras.Model:
    """16 features -> Dense(4096) with `activation` as its own (own) or as an Activation layer
    after it -> Dense(10): the 4096-wide maps are the step (the kernels are 0.4 MiB)."""
    x = keras.Input((16,))
    if own:
        h = L.Dense(4096, activation=activation)(x)
    else:
        h = L.Activation(activation)(L.Dense(4096)(x))
    return keras.Model(x, L.Dense(10)(h))


@pytest.mark.parametrize(
    "activation, own, maps, before",
    [("relu", False, 2, 3), ("relu", True, 2, 2), ("swish", True, 4, 2)],
)
def test_a_layers_own_activation_is_walked_and_a_relus_gradient_takes_no_buffer(
    activation, own, maps, before
):
    # Requested bytes of a training step (no optimizer: each weight gradient consumed at once),
    # in 16 MiB maps (batch 1024). ReluGrad writes the input gradient over the output gradient
    # it reads: at its backward the ReLU's output and that gradient, 2 maps (measured 32.2 MiB);
    # the old rule gave it a new buffer, 3 (0.67x). Dense(4096, activation="swish") is a Dense
    # layer, then swish, whose gradient reads its input: 4 maps (measured 64.0 MiB); walked as a
    # Dense layer alone (the old walk), 2 (1.94x). Dense(..., activation="relu") holds 2 either
    # way. Measured 32.2 MiB (relu, either way) and 64.0-64.2 (swish) in two runs: 1.005x.
    # What every call holds is the least of several (tests/peaks.py requested_peaks): beside two
    # busy processes one call of swish's held a fifth map (84.1 MB, 1.25x) in 1 of 3 runs.
    from tests.peaks import requested_peaks, step_peak

    b, tensor = 1024, 1024 * 4096 * 4
    model = _wide(activation, own)
    x, y = tf.random.normal((b, 16)), tf.zeros((b,), tf.int32)
    measured = step_peak(model, x, y, peak=lambda call: min(requested_peaks(call, calls=3)))
    kept, work, _ = graph_walk.walk_step(model, b, 4, RematInfo(), timeline.Executor())
    assert round((kept + work) / tensor) == maps, (kept, work)
    assert 0.9 <= measured / (kept + work) <= 1.15, (measured, kept + work)
    assert not 0.9 <= measured / (before * tensor) <= 1.15 or maps == before


def _patches(policy: str) -> keras.Model:
    """A strided Conv2D of 4x4 patches on 64x64x16 float32 images (2 MiB a batch of 8), to 4
    channels, pooled, a float32 head: the images' cast is the largest tensor a step makes."""
    x = keras.Input((64, 64, 16))
    y = L.Conv2D(4, 4, strides=4, dtype=policy, name="patches")(x)
    y = L.GlobalAveragePooling2D(dtype=policy, name="pool")(y)
    return keras.Model(x, L.Dense(10, name="head")(y), name="patches_model")


def _patches_peaks() -> dict[str, int]:
    """Requested bytes at the peak of a training step (its weights' gradients only) of
    _patches under each policy (tests/peaks.py requested_peak)."""
    from tests.peaks import grow_pool, requested_peak

    grow_pool()
    x, peaks = tf.random.normal((8, 64, 64, 16)), {}
    for policy in ("float32", "mixed_bfloat16"):
        step = _weights_step(_patches(policy), x)
        peaks[policy] = requested_peak(lambda step=step: step().numpy())
    return peaks


def _weights_step(model, x):
    """A compiled forward and backward of `model` on x that differentiates its weights only,
    as a training step does, each gradient consumed at once."""
    weights = model.trainable_variables

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, weights)])

    return step


def test_a_16_bit_layer_keeps_its_cast_of_a_float32_model_input():
    # Keras casts the images to bfloat16 as it calls the Conv2D, and the filter gradient reads
    # that copy: bfloat16 holds 1 MiB more than float32 (measured: 1.064 and 0.078 MiB), where
    # float32's input is the batch itself. Without the rule the walk kept nothing more.
    measured = in_fresh_process(_patches_peaks)
    kept = {
        p: graph_walk.walk_step(_patches(policy), 8, p, RematInfo(), timeline.Executor())[0]
        for policy, p in (("float32", 4), ("mixed_bfloat16", 2))
    }
    more = measured["mixed_bfloat16"] - measured["float32"]
    assert 0.85 <= more / (kept[2] - kept[4]) <= 1.15, (measured, kept)
