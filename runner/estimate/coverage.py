"""Which Keras layer kinds the estimate has a rule for, and which it names as not modelled.

Without XLA the estimate walks a functional model's operations (runner/estimate/graph_walk.py)
by the rules of each layer kind (layer_rules.py, sequence_rules.py). A kind is in exactly one of:
- RULED: its backward is modelled, each rule measured against the allocator (a chain of the
  layer), or, for the kinds that compute nothing a gradient reads (reshapes, paddings, a sum),
  the walk's default: its readers keep what they read;
- NO_BACKWARD: preprocessing and augmentation, which sit at a model's input where no weight
  went in before them, so no backward runs for them (graph_walk.backward_runs);
- OTHER_BACKENDS: wrappers that run only on another Keras backend (JAX, Flax, PyTorch);
- NOT_MODELLED: everything else, by name. A run whose model has one of these (or any kind
  named nowhere: a user's own layer) says so in its `mem/estimate_note` tag
  (`not modelled: MyLayer x3`): its estimate is then a lower bound.
tests/test_coverage.py checks that every layer class keras.layers exports is in one of them, so
that a Keras release adding a layer fails until someone decides.
"""

from collections import Counter

from runner.estimate import graph_walk, layer_rules, model_graph
from runner.estimate.sequence_rules import recurrent_ahead_bytes

RULED = {
    "Activation", "ActivityRegularization", "Add", "AlphaDropout", "Attention", "Average",
    "AveragePooling1D", "AveragePooling2D", "BatchNormalization", "Bidirectional",
    "CenterCrop", "Concatenate", "Conv1D", "Conv1DTranspose", "Conv2D", "Conv2DTranspose",
    "Cropping2D", "Dense", "DepthwiseConv2D", "Dot", "Dropout", "EinsumDense", "ELU",
    "Embedding", "Flatten", "GaussianDropout", "GaussianNoise", "GlobalAveragePooling1D",
    "GlobalAveragePooling2D", "GlobalMaxPooling1D", "GRU", "GroupNormalization", "Identity",
    "InputLayer", "LayerNormalization", "LeakyReLU", "LSTM", "Masking", "MaxPooling1D",
    "MaxPooling2D", "Maximum", "Minimum", "MultiHeadAttention", "Multiply", "Normalization",
    "Permute", "PReLU", "ReLU", "RepeatVector", "Rescaling", "Reshape", "Resizing",
    "SeparableConv2D", "SimpleRNN", "Softmax", "SpatialDropout2D", "Subtract",
    "TimeDistributed", "UnitNormalization", "UpSampling1D", "UpSampling2D", "ZeroPadding2D",
}  # fmt: skip
# The activation functions whose gradients the rules follow (Activation:<function>, and a
# layer's own activation= argument, which the walk reads as an Activation after the layer).
RULED_ACTIVATIONS = {
    "linear", "relu", "relu6", "sigmoid", "tanh", "softmax", "swish", "silu", "hard_swish",
    "hard_silu", "elu", "selu", "gelu", "gelu_approximate", "mish", "leaky_relu", "softplus",
    "exponential",
}  # fmt: skip
NO_BACKWARD = {
    "AugMix", "AutoContrast", "CategoryEncoding",
    "ContrastLimitedAdaptiveHistogramEqualization", "CutMix", "Discretization", "Equalization",
    "HashedCrossing", "Hashing", "IntegerLookup", "MaxNumBoundingBoxes", "MelSpectrogram",
    "MixUp", "Pipeline", "RandAugment", "RandomBrightness",
    "RandomColorDegeneration", "RandomColorJitter", "RandomContrast", "RandomCrop",
    "RandomElasticTransform", "RandomErasing", "RandomFlip", "RandomGaussianBlur",
    "RandomGrayscale", "RandomHue", "RandomInvert", "RandomPerspective", "RandomPosterization",
    "RandomRotation", "RandomSaturation", "RandomSharpness", "RandomShear",
    "RandomTranslation", "RandomZoom", "STFTSpectrogram", "Solarization",
    "StringLookup", "TextVectorization",
}  # fmt: skip
OTHER_BACKENDS = {"FlaxLayer", "JaxLayer", "TorchModuleWrapper"}
NOT_MODELLED = {
    "AdaptiveAveragePooling1D", "AdaptiveAveragePooling2D", "AdaptiveAveragePooling3D",
    "AdaptiveMaxPooling1D", "AdaptiveMaxPooling2D", "AdaptiveMaxPooling3D", "AdditiveAttention",
    "AveragePooling3D", "Conv3D", "Conv3DTranspose", "ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D",
    "Cropping1D", "Cropping3D", "DepthwiseConv1D", "GRUCell", "GlobalAveragePooling3D",
    "GlobalMaxPooling2D", "GlobalMaxPooling3D", "GroupedQueryAttention", "LSTMCell", "Lambda",
    "Layer", "MaxPooling3D", "RMSNormalization", "RNN", "ReversibleEmbedding",
    "SeparableConv1D", "SimpleRNNCell", "SpatialDropout1D", "SpatialDropout3D",
    "SpectralNormalization", "StackedRNNCells", "TFSMLayer", "UpSampling3D", "Wrapper",
    "ZeroPadding1D", "ZeroPadding3D",
}  # fmt: skip
# The project's own layers, each with its rules (models/): the transformer's blocks are walked
# by its closed form, not this walk; these appear in graph models.
PROJECT = {"LayerNorm", "Cast", "ZerosLike", "Arange"}


def ruled(op) -> bool:
    """Whether the walk has a rule for this layer (a Bidirectional: of its recurrent layer)."""
    name = type(op).__name__
    if name == "Activation":
        return layer_rules.kind(op).removeprefix("Activation:") in RULED_ACTIVATIONS
    if name == "Bidirectional":
        return type(op.forward_layer).__name__ in RULED
    if name == "TimeDistributed":  # measured with a Dense inside
        return type(op.layer).__name__ == "Dense"
    return name in RULED or name in PROJECT


def unmodelled(model, b: int, p: int) -> tuple[Counter, int]:
    """(the layer kinds of a functional model that the walk has no rule for, counted, among
    the operations whose backward runs (preprocessing before any weight runs none); the bytes
    its recurrent layers may hold beyond their rule, sequence_rules.recurrent_ahead_bytes) at
    micro-batch b and p bytes an activation element."""
    ops, _, elements = model_graph.operations(model)
    producer = {t: i for i, _, _, outs in ops for t in outs}
    _, runs = graph_walk.backward_runs(ops, producer)
    found, ahead = Counter(), 0
    for (_, op, ins, _), run in zip(ops, runs, strict=True):
        if not run:
            continue
        if not ruled(op):
            found[layer_rules.kind(op)] += 1
        width = 4 if getattr(op, "compute_dtype", None) == "float32" else p
        if ins:
            ahead += recurrent_ahead_bytes(op, elements[ins[0]] * b, width)
    return found, ahead


def note(model, b: int, p: int) -> str | None:
    """What the walk leaves out of a functional model's estimate, in one line: the kinds it
    has no rule for (`not modelled: MyLayer x3`: the estimate is a lower bound) and what its
    recurrent layers may add; None when it leaves nothing out."""
    found, ahead = unmodelled(model, b, p)
    said = []
    if found:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(found.items()))
        said.append(f"not modelled: {kinds} (the estimate is a lower bound)")
    if ahead:
        said.append(
            f"a bound: it counts {ahead / 2**20:.1f} MiB of recurrent weight-gradient products "
            "run ahead of their sum, which the executor's timing holds in some steps, not all"
        )
    return "; ".join(said) or None
