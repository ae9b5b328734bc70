"""Which layer kinds and Keras operations the channel analysis (runner/channels/groups.py)
follows, and whether a masked channel, zero, stays zero through them (evaluated at zero)."""

import keras
import numpy as np

# Made channels (a new group per call): their output axis, and the weights indexed by it.
CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
# Layers whose every channel goes through alone (space changes, channels do not).
SPATIAL = (
    keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D, keras.layers.AveragePooling3D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalAveragePooling3D, keras.layers.GlobalMaxPooling1D,
    keras.layers.GlobalMaxPooling2D, keras.layers.GlobalMaxPooling3D,
    keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D,
    keras.layers.Cropping1D, keras.layers.Cropping2D, keras.layers.Cropping3D,
    keras.layers.UpSampling1D, keras.layers.UpSampling2D, keras.layers.UpSampling3D,
    keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
    keras.layers.Identity,
)  # fmt: skip
# Element-wise merges: their inputs' channels are one another's.
MERGE = (keras.layers.Add, keras.layers.Subtract, keras.layers.Average)
# A product is zero where any input is: the gate of a squeeze-and-excitation block.
PRODUCT = (keras.layers.Multiply,)
# Per-channel functions (f applied to each element).
ACTIVATION = (
    keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU,
    keras.layers.Rescaling,
)  # fmt: skip


# Normalisations across the channel axis: a channel removed changes the others' statistics.
NORMS = (keras.layers.LayerNormalization, keras.layers.UnitNormalization, keras.layers.Softmax)


def zero_preserving(activation) -> bool:
    """Whether f(0) = 0, evaluated."""
    if activation is None:
        return True
    value = activation(keras.ops.zeros((1,), "float32"))
    return float(keras.ops.convert_to_numpy(value)[0]) == 0.0


# Keras operations on tensors (x + 3.0, keras.ops.sigmoid(x)) that act element by element.
BINARY_OPS = {"Add": "merge", "Subtract": "merge", "Maximum": "merge", "Minimum": "merge",
              "Multiply": "product", "Divide": "", "TrueDivide": ""}  # fmt: skip
UNARY_OPS = {
    "Relu", "Relu6", "Sigmoid", "HardSigmoid", "Silu", "HardSilu", "Gelu", "Tanh", "Elu",
    "Selu", "Softplus", "Softsign", "LeakyRelu", "Mish", "Negative", "Abs", "Square", "Exp",
}  # fmt: skip


def elementwise(node) -> str:
    """ "unary" for a Keras operation applied element by element to one tensor (a constant
    beside it), "merge" or "product" for two tensors, "" otherwise."""
    op = node.operation
    if isinstance(op, keras.layers.Layer) or not type(op).__module__.startswith("keras.src.ops"):
        return ""
    name, tensors = type(op).__name__, len(node.arguments.keras_tensors)
    if tensors == 1 and (name in UNARY_OPS or name in BINARY_OPS):
        return "unary"
    return BINARY_OPS.get(name, "") if tensors == 2 else ""


def zero_at_zero(node) -> bool:
    """Whether the node's operation gives zeros where its tensors are zeros, evaluated."""
    zeros = {
        id(t): keras.ops.zeros([d or 1 for d in t.shape], t.dtype)
        for t in node.arguments.keras_tensors
    }
    args, kwargs = node.arguments.fill_in(zeros)
    out = keras.ops.convert_to_numpy(node.operation(*args, **kwargs))
    return not np.any(out)
