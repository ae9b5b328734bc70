"""Checkpointing on models tfmemlab has never seen (issue 28), cut by the graph's structure
(runner/techniques/graph_cuts.py): keras.applications ResNet50, DenseNet121 and ConvNeXtTiny
(weights=None, 10 classes) and a small U-Net, each in a fresh process, without XLA.

    python -m runner.bench checkpointing --unseen [resnet50 densenet121 convnext_tiny unet ...]

Per model and row: the blocks and segments found, the allocator's peak of one optimizer step
(Adam) over the bytes held before it (the median of REPEATS steps, and their range), against
`none`'s, and whether the weights, Adam's slots and the BatchNorm statistics after the step
equal the plain model's (rtol 1e-5, atol 1e-6). A row is a policy with an optional suffix, and
its `step` column says what its peak covers:
- `P` (none, blocks, sqrt): fwd+bwd+apply, the runner's train step at accum=1
  (runner/techniques/accumulation.py): forward, backward and optimizer.apply in one
  tf.function, where TensorFlow's executor runs each variable's update once its gradient exists;
- `P+wait`: the same, with every update held until all the gradients exist (as a step that
  checks them all first, float16 loss scaling's, holds them), so all are alive at the end of
  backward, as they were when this benchmark measured forward and backward alone.
Target: blocks on ResNet50 at 64x64, batch 16: peak <= 0.7x none's.
"""

import keras

from runner.bench import mib, table
from runner.core.process import in_fresh_process


def _conv_bn(x, filters: int, kernel: int = 3, strides: int = 1, relu: bool = True):
    x = keras.layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def resnet_like(size: int = 32, width: int = 8, classes: int = 10) -> keras.Model:
    """Stem conv, three residual blocks (the second downsamples through a projection
    shortcut), pooling and a Dense head: 5 blocks by structure, no block names."""
    inputs = keras.Input((size, size, 3))
    x = _conv_bn(inputs, width)
    for filters, strides in ((width, 1), (2 * width, 2), (2 * width, 1)):
        shortcut = x
        if strides != 1:
            shortcut = _conv_bn(x, filters, 1, strides, relu=False)
        y = _conv_bn(_conv_bn(x, filters, strides=strides), filters, relu=False)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x), name="resnet_like")


def unet(size: int = 32, width: int = 8, classes: int = 10) -> keras.Model:
    """Two encoder levels (two conv-BN-ReLU each, the second's output kept as a skip), a
    bottleneck, two decoder levels (upsample, concatenate the skip, two conv-BN-ReLU), then
    GlobalAveragePooling and a Dense head: 6 blocks by structure (the first skip is live from
    the encoder's second convolution to the last concatenation: one block)."""
    inputs = keras.Input((size, size, 3))
    x, skips = inputs, []
    for filters in (width, 2 * width):
        x = _conv_bn(_conv_bn(x, filters), filters)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = _conv_bn(x, 4 * width)
    for filters, skip in zip((2 * width, width), reversed(skips), strict=True):
        x = keras.layers.Concatenate()([keras.layers.UpSampling2D()(x), skip])
        x = _conv_bn(_conv_bn(x, filters), filters)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x), name="unet")


def _application(name: str):
    # Logits out, as tfmemlab's models: with a softmax head, Keras's cross-entropy reads the
    # logits the Softmax left on its output tensor (`_keras_logits`), which a Remat's output
    # does not carry, so the plain and rebuilt models' losses would differ (measured: relative
    # gradient differences ~1 on ResNet50 with from_logits=True).
    return lambda size: getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )


# name -> (builder(size), image size, batch, rows after none's)
MODELS = {
    "resnet50": (
        _application("ResNet50"),
        64,
        16,
        ("none+wait", "blocks", "blocks+wait", "sqrt"),
    ),
    "densenet121": (_application("DenseNet121"), 64, 16, ("blocks",)),
    "convnext_tiny": (_application("ConvNeXtTiny"), 64, 16, ("blocks",)),
    "unet": (lambda size: unet(size, 16), 64, 16, ("blocks",)),
    "resnet_like": (lambda size: resnet_like(size, 16), 32, 8, ("blocks",)),
}
# What each row's peak covers (the `step` column), by the row's suffix.
STEPS = {
    "": "fwd+bwd+apply",
    "wait": "fwd+bwd+apply, updates wait for all grads",
}
REPEATS = 3  # measured steps per row: the executor's order, and so the peak, moves between runs


def _waiting_step(model, optimizer, loss):
    """The train step with every update held until all gradients exist, as a step that checks
    them all first (float16 loss scaling's skip on overflow) holds them."""
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        optimizer.apply([tf.where(finite, g, 0.0) for g in grads], model.trainable_variables)
        return value

    return lambda batches: step(*next(batches))


def _step(base, row: str, optimizer, loss):
    """(the row's train step, RematInfo): `P` or `P+wait` for policy P."""
    from runner.techniques import checkpointing
    from runner.techniques.accumulation import make_train_step

    policy, _, kind = row.partition("+")
    model, info = checkpointing.apply(base, policy, 2)
    if kind == "wait":
        return _waiting_step(model, optimizer, loss), info
    return make_train_step(model, optimizer, loss, 1, False), info


def _peaks(step, batches, state, start) -> list[int]:
    """The allocator's peak over the bytes held before it, of REPEATS steps from `start`."""
    import tensorflow as tf

    peaks = []
    for _ in range(REPEATS):
        _restore(state, start)
        held = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        step(batches)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - held)
    return sorted(peaks)


def _restore(variables, values) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def measure(name: str, policies: tuple[str, ...] | None = None) -> list[dict]:
    """One row per policy (none first; STEPS for the suffixes), in this process: build, step
    once to trace, then measure REPEATS steps, each from the same weights, Adam slots and
    BatchNorm statistics (the layers are shared by every policy's rebuilt model)."""
    import itertools

    import numpy as np
    import tensorflow as tf

    from runner.measure.telemetry import Memory

    build, size, batch, default = MODELS[name]
    Memory("/CPU:0").grow_pool()
    keras.utils.set_random_seed(0)
    base = build(size)
    batches = itertools.repeat(
        (tf.random.normal((batch, size, size, 3)), tf.random.uniform((batch,), 0, 10, tf.int32))
    )
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(base.trainable_variables)
    state = [*base.weights, *optimizer.variables]
    start = [v.numpy() for v in state]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows, reference = [], None
    for row in ("none", *(policies or default)):
        step, info = _step(base, row, optimizer, loss)
        step(batches)  # traced
        peaks = _peaks(step, batches, state, start)
        got = [v.numpy() for v in state]
        reference = reference or got
        pairs = list(zip(got, reference, strict=True))
        rows.append(
            {"model": name, "policy": row, "step": STEPS[row.partition("+")[2]],
             "blocks": info.blocks, "segments": info.segments, "peak": peaks[len(peaks) // 2],
             "range_MiB": f"{mib(peaks[0]):.1f}-{mib(peaks[-1]):.1f}",
             "state_equal": all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs),
             "max_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs)}
        )  # fmt: skip
        rows[-1]["peak_MiB"] = mib(rows[-1]["peak"])
        _restore(state, start)
        del step
    for row in rows:
        row["peak/none"] = row["peak"] / rows[0]["peak"]
    return rows


COLUMNS = ["model", "policy", "step", "blocks", "segments", "peak_MiB", "range_MiB", "peak/none"]


def main(names: list[str]) -> list[dict]:
    """Each model (all when none are named) in a fresh process; one table."""
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"error: --unseen {unknown[0]}: expected one of {', '.join(MODELS)}")
    rows = []
    for name in names or [n for n in MODELS if n != "resnet_like"]:
        rows += in_fresh_process(measure, name)
    for row in rows:
        if row["model"] == "resnet50" and row["policy"] == "blocks":
            row["verdict"] = f"target peak <= 0.7: {'ok' if row['peak/none'] <= 0.7 else 'MISSED'}"
    print(table(rows, [*COLUMNS, "state_equal", "max_diff", "verdict"]))
    return rows
