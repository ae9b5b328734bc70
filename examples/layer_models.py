"""Models of one's own built from standard Keras layers, as users write them: a recurrent text
model, a small vision transformer with keras's MultiHeadAttention, a CNN with group
normalization and GELU, and a Conv1D text model. `python run.py --config-dir examples/conf
model=recurrent` (examples/ on PYTHONPATH); `python -m runner.bench estimate --draws` draws
them at random sizes (runner/bench/draws.py). Each reads the data's DataSpec: tokens give one
prediction per token when the data is language modelling, else one per sequence."""

import keras
from keras import layers


def _tokens(spec, width: int, mask_zero: bool = False):
    if spec.kind != "tokens":
        raise ValueError(f"this model reads tokens; the data gives {spec.kind}")
    inputs = keras.Input(spec.input_shape, dtype="int32")
    return inputs, layers.Embedding(spec.vocab_size, width, mask_zero=mask_zero)(inputs)


def _head(spec, x, pool):
    """One float32 prediction per token (language modelling) or per example (pooled)."""
    if not spec.per_token:
        x = pool(x)
    return layers.Dense(spec.num_classes, dtype="float32", name="head")(x)


def recurrent(
    spec,
    cell: str = "lstm",
    units: int = 96,
    depth: int = 2,
    embed: int = 64,
    bidirectional: bool = False,
) -> keras.Model:
    """Embedding, `depth` recurrent layers (lstm, gru or simple) of `units`, a head. A
    classifier's last layer returns its final state; a language model's every step."""
    kinds = {"lstm": layers.LSTM, "gru": layers.GRU, "simple": layers.SimpleRNN}
    inputs, x = _tokens(spec, embed)
    for i in range(depth):
        sequences = spec.per_token or i < depth - 1
        layer = kinds[cell](units, return_sequences=sequences)
        x = (layers.Bidirectional(layer) if bidirectional else layer)(x)
    logits = layers.Dense(spec.num_classes, dtype="float32", name="head")(x)
    return keras.Model(inputs, logits, name=f"{cell}_text")


def vit(
    spec, patch: int = 4, width: int = 64, depth: int = 3, heads: int = 4, dropout: float = 0.0
) -> keras.Model:
    """A small vision transformer: patches by a strided Conv2D, `depth` pre-norm blocks of
    LayerNormalization, keras MultiHeadAttention and a GELU MLP, mean-pooled to a head."""
    if spec.kind != "image":
        raise ValueError(f"vit reads images; the data gives {spec.kind}")
    inputs = keras.Input(spec.input_shape)
    x = layers.Conv2D(width, patch, strides=patch, name="patches")(inputs)
    x = layers.Reshape((-1, width))(x)
    for i in range(depth):
        h = layers.LayerNormalization(name=f"block_{i}_norm1")(x)
        h = layers.MultiHeadAttention(
            heads, width // heads, dropout=dropout, name=f"block_{i}_mha"
        )(h, h)
        x = layers.Add(name=f"block_{i}_add1")([x, h])
        h = layers.LayerNormalization(name=f"block_{i}_norm2")(x)
        h = layers.Dense(2 * width, activation="gelu", name=f"block_{i}_mlp1")(h)
        h = layers.Dense(width, name=f"block_{i}_mlp2")(h)
        x = layers.Add(name=f"block_{i}_add2")([x, h])
    x = layers.LayerNormalization(name="final_norm")(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(spec.num_classes, dtype="float32")(x), name="vit")


def groupnorm_cnn(spec, filters: int = 32, depth: int = 3, groups: int = 8) -> keras.Model:
    """Conv2D, GroupNormalization and Activation("gelu") blocks, each halving the image."""
    if spec.kind != "image":
        raise ValueError(f"groupnorm_cnn reads images; the data gives {spec.kind}")
    inputs = keras.Input(spec.input_shape)
    x = inputs
    for i in range(depth):
        x = layers.Conv2D(filters * 2**i, 3, padding="same", name=f"block_{i}_conv")(x)
        x = layers.GroupNormalization(groups, name=f"block_{i}_gn")(x)
        x = layers.Activation("gelu", name=f"block_{i}_gelu")(x)
        x = layers.MaxPooling2D(2, name=f"block_{i}_pool")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(spec.num_classes, dtype="float32")(x), name="gn_cnn")


def conv1d_text(spec, embed: int = 64, filters: int = 96, depth: int = 3) -> keras.Model:
    """Embedding, `depth` Conv1D + LayerNormalization, global max pooling (or a head a token)."""
    inputs, x = _tokens(spec, embed)
    for i in range(depth):
        x = layers.Conv1D(filters, 5, padding="same", activation="relu", name=f"conv_{i}")(x)
        x = layers.LayerNormalization(name=f"norm_{i}")(x)
    logits = _head(spec, x, layers.GlobalMaxPooling1D())
    return keras.Model(inputs, logits, name="conv1d_text")
