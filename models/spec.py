"""What a model builder needs to know about the data it will be fed."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    """Shape of one example and of the target, as produced by `runner.data`.

    kind: "image" (float32 [H, W, 3]) or "tokens" (int32 [seq_len]).
    num_classes: output units of the head (the vocabulary size for language modelling).
    per_token: True when the target is one class per token (language modelling),
        False when it is one class per example.
    vocab_size: number of distinct input tokens (tokens only).
    """

    kind: str
    input_shape: tuple
    num_classes: int
    per_token: bool = False
    vocab_size: int = 0

    @property
    def seq_len(self) -> int:
        return self.input_shape[0] if self.kind == "tokens" else 0


# Option names of the image models, here (no TensorFlow import) so that config validation
# and the builders share one list.
MOBILENET_VERSIONS = ("v2", "v3_small", "v3_large")
EFFICIENTNET_VARIANTS = tuple(f"B{i}" for i in range(8)) + tuple(
    f"V2{v}" for v in ("B0", "B1", "B2", "B3", "S", "M", "L")
)
