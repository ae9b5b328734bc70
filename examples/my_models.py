"""Two models of one's own, for `python run.py --config-dir examples/conf model=unet` (see
examples/conf/model/ and docs/models.md). Run with examples/ on PYTHONPATH (or from inside it)."""

import keras
from keras import layers


def _conv_bn_relu(x, filters: int, name: str):
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv")(x)
    x = layers.BatchNormalization(name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x)


def _u_block(x, filters: int, name: str):
    """Encoder, half-resolution middle, decoder with the encoder's output concatenated back (a
    skip connection inside the block: only the block's input and output cross its edges, so
    checkpointing=blocks can cut between blocks named block_<n>)."""
    encoded = _conv_bn_relu(x, filters, f"{name}_enc")
    middle = layers.MaxPooling2D(2, name=f"{name}_down")(encoded)
    middle = _conv_bn_relu(middle, 2 * filters, f"{name}_mid")
    up = layers.UpSampling2D(2, name=f"{name}_up")(middle)
    merged = layers.Concatenate(name=f"{name}_skip")([up, encoded])
    return _conv_bn_relu(merged, filters, f"{name}_dec")


def unet(spec, filters: int = 16, blocks: int = 2) -> keras.Model:
    """A small U-Net-like classifier: a stem, `blocks` U-shaped blocks with skip connections,
    global pooling and a Dense head with spec.num_classes float32 logits. Images whose side is
    even (the blocks halve and double it)."""
    if spec.kind != "image":
        raise ValueError(f"unet needs image data, got {spec.kind}")
    inputs = keras.Input(shape=spec.input_shape, name="pixels")
    x = _conv_bn_relu(inputs, filters, "stem")
    for i in range(1, blocks + 1):
        x = _u_block(x, filters, f"block_{i}")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    x = layers.Dense(spec.num_classes, name="head")(x)
    # float32 logits under mixed precision (Keras's mixed-precision guide)
    outputs = layers.Activation("linear", dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="unet")


class TinyNet(keras.Model):
    """A subclassed model for tokens or images, whichever the data spec says: tokens are
    embedded (one prediction per token for language modelling, else per sequence), images go
    through a conv with BatchNorm; both end in a hidden Dense and a float32 head."""

    def __init__(self, spec, width: int = 32, **kwargs):
        super().__init__(**kwargs)
        self.tokens, self.per_token = spec.kind == "tokens", spec.per_token
        if self.tokens:
            self.embed = layers.Embedding(spec.vocab_size, width)
            self.pool = None if spec.per_token else layers.GlobalAveragePooling1D()
        else:
            self.conv = layers.Conv2D(width, 3, padding="same", use_bias=False)
            self.norm = layers.BatchNormalization()
            self.pool = layers.GlobalAveragePooling2D()
        self.hidden = layers.Dense(width, activation="relu")
        self.head = layers.Dense(spec.num_classes, dtype="float32")

    def call(self, x, training=False):
        if self.tokens:
            x = self.embed(x)
        else:
            x = keras.ops.relu(self.norm(self.conv(x), training=training))
        if self.pool is not None:
            x = self.pool(x)
        return self.head(self.hidden(x))
