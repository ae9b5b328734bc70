"""Checkpointing on models tfmemlab has never seen (issue 28), cut by the graph's structure
(runner/techniques/graph_cuts.py): keras.applications ResNet50, DenseNet121 and ConvNeXtTiny
(weights=None, 10 classes) and a small U-Net, each in a fresh process, without XLA.

    python -m runner.bench checkpointing --unseen [resnet50 densenet121 convnext_tiny unet ...]

Per model and policy: the blocks and segments found, the allocator's peak of one forward and
backward pass over the bytes held before it, against `none`'s, and whether the gradients and
the BatchNorm statistics after the step equal the plain model's (rtol 1e-5, atol 1e-6).
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


# name -> (builder(size), image size, batch, policies)
MODELS = {
    "resnet50": (_application("ResNet50"), 64, 16, ("blocks", "sqrt")),
    "densenet121": (_application("DenseNet121"), 64, 16, ("blocks",)),
    "convnext_tiny": (_application("ConvNeXtTiny"), 64, 16, ("blocks",)),
    "unet": (lambda size: unet(size, 16), 64, 16, ("blocks",)),
    "resnet_like": (lambda size: resnet_like(size, 16), 32, 8, ("blocks",)),
}


def _step(model, variables, x, y):
    import tensorflow as tf

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, variables)

    return step


def measure(name: str, policies: tuple[str, ...] | None = None) -> list[dict]:
    """One row per policy (none first), in this process: build, step once to trace, then
    measure a second step from the same BatchNorm state (the layers are shared by every
    policy's rebuilt model, so the weights are the same)."""
    import numpy as np
    import tensorflow as tf

    from runner.measure.telemetry import Memory
    from runner.techniques import checkpointing

    build, size, batch, default = MODELS[name]
    Memory("/CPU:0").grow_pool()
    keras.utils.set_random_seed(0)
    base = build(size)
    x = tf.random.normal((batch, size, size, 3))
    y = tf.random.uniform((batch,), 0, 10, tf.int32)
    start = [v.numpy() for v in base.non_trainable_variables]
    rows, reference = [], None
    for policy in ("none", *(policies or default)):
        model, info = checkpointing.apply(base, policy, 2)
        step = _step(model, base.trainable_variables, x, y)
        step()
        for variable, value in zip(base.non_trainable_variables, start, strict=True):
            variable.assign(value)
        held = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        grads = step()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - held
        got = [g.numpy() for g in grads] + [v.numpy() for v in base.non_trainable_variables]
        reference = reference or got
        same = all(
            np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, reference, strict=True)
        )
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, reference, strict=True))
        rows.append(
            {"model": name, "policy": policy, "blocks": info.blocks, "segments": info.segments,
             "peak_MiB": mib(peak), "peak": peak, "grads_equal": same, "max_diff": diff}
        )  # fmt: skip
        del grads, step, model
    for row in rows:
        row["peak/none"] = row["peak"] / rows[0]["peak"]
    return rows


COLUMNS = ["model", "policy", "blocks", "segments", "peak_MiB", "peak/none", "grads_equal"]


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
    print(table(rows, [*COLUMNS, "max_diff", "verdict"]))
    return rows
