"""What a transformer's training step holds without XLA (models/transformer.py; under XLA on a
CPU: runner/estimate/xla_fitted.py), for the estimate (runner/estimate/memory.py): the
activations each layer keeps for backward, by checkpointing policy, and the transients beside
them at the step's three candidate peaks: the loss, the last layer's MLP backward and its
attention core's backward."""

import math
from dataclasses import dataclass

from runner.estimate import chunked_core
from runner.estimate.calibration import CORE_WORKSPACE
from runner.techniques.checkpointing import segment_length


@dataclass(frozen=True)
class Widths:
    """A transformer's widths: h the residual stream, `heads` of key_dim each, mlp_units the
    MLP's hidden width (h / heads and 4h as configured; fewer where pruning=structured
    removed heads or units)."""

    h: int
    heads: int
    key_dim: int
    mlp_units: int
    layers: int
    dropout: float


def widths(m, model=None) -> Widths:
    """cfg.model `m`'s widths, or, given the model, its blocks' as built (the widest of each,
    where blocks differ)."""
    blocks = [
        layer
        for layer in (model.layers if model is not None else [])
        if hasattr(layer, "mlp_units")
    ]
    if not blocks:
        return Widths(m.h, m.heads, m.h // m.heads, 4 * m.h, m.layers, m.dropout)
    heads = max(block.heads for block in blocks)
    key_dim = max(block.key_dim for block in blocks)
    units = max(block.mlp_units for block in blocks)
    return Widths(m.h, heads, key_dim, units, len(blocks), m.dropout)


def layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    p: int,
    dropout: float,
    block: int | None = None,
    attention: int | None = None,
    units: int | None = None,
) -> int:
    """Activations one transformer layer keeps for backward (Korthikanti et al. 2022, Sec. 4.1).

    The paper's 34sbh + 5as^2b bytes (16-bit activations, 1-byte dropout masks) decomposed into
    elements, so the element size p can follow the precision policy:
      attention: LN output sbh, Q and K 2sbh, V sbh, output-projection input sbh  -> 5sbh
                 softmax output as^2b; with dropout its mask as^2b (bytes) and output as^2b
                 and the attention-output dropout mask sbh (bytes)
      MLP:       first linear input sbh, GeLU input 4sbh, second linear input 4sbh -> 9sbh
                 with dropout its mask sbh (bytes)
      2 LNs:     their inputs 2sbh
    => 16sbh + as^2b elements, plus (dropout > 0) 2sbh + as^2b mask bytes and as^2b elements;
    at p = 2 with dropout this is exactly 34sbh + 5as^2b. Q, K, V and the output projection's
    input are `attention` = heads x key_dim wide (h as built), the MLP's GELU and second
    linear inputs `units` wide (4h): 4sbh + 4sb x attention + 2sb x units elements in all.
    models/transformer.py's block keeps exactly these (its layers are memory-limited:
    models/memory_limited.py). A chunked core (block: its keys per block) keeps a float32
    logsumexp in place of the as^2b terms.
    """
    sbh, attention, units = s * b * h, attention or h, units or 4 * h
    elements = 4 * sbh + 4 * s * b * attention + 2 * s * b * units
    total = elements * p + attention_core_bytes(s, b, a, p, dropout, block)
    if dropout > 0:
        total += 2 * sbh
    return total


def attention_core_bytes(
    s: int, b: int, a: int, p: int, dropout: float, block: int | None = None
) -> int:
    """What the attention core keeps beyond its inputs: the softmax output as^2b elements,
    and with dropout its 1-byte mask and its output; checkpointing=selective recomputes it.
    A chunked core (block) keeps its float32 logsumexp, asb elements, and no mask (its
    backward draws the masks again from their seeds: models/chunked_attention.py)."""
    if block:
        return chunked_core.kept(s, b, a)
    ass = a * s * s * b
    return ass * p + ((ass + ass * p) if dropout > 0 else 0)


def core_workspace(s, b, h, a, p, dropout, block=None) -> int:
    """Bytes the attention core's backward holds beside what the step keeps. A chunked core
    (block): runner/estimate/chunked_core.py's rule, derived term by term. The standard core: the
    softmax's float32 temporaries and the gradients of the probabilities, **fitted** per
    scores element (calibration.CORE_WORKSPACE). The core's backward runs in a fixed order
    (models/memory_limited.py): left to the executor, the same job's peak moved by up to 25%
    from one run to the next."""
    if block:
        return chunked_core.workspace(s, b, h, a, p, dropout, block)
    per_score = CORE_WORKSPACE["float32" if p == 4 else "16-bit"][int(dropout > 0)]
    return int(per_score * a * s * s * b)


def mlp_workspace(sbh: int, p: int, wide: int | None = None) -> int:
    """Bytes GELU's backward holds beside its input, over the MLP's hidden activation of `wide`
    = s x b x units elements (4sbh as built; read off the allocator's traces of the drawn
    transformers at their peaks in an MLP's backward): in float32 the output gradient and two
    float32 products (12 bytes an element, 48sbh); at 16 bits the output gradient, float32
    copies of it and of the input, and one float32 product (14 bytes, 56sbh)."""
    wide = wide or 4 * sbh
    return 12 * wide if p == 4 else 14 * wide


def mlp_bytes(sbh: int, p: int, dropout: float, wide: int | None = None) -> int:
    """What a layer keeps for its MLP half: the norm's input, the first linear's input, GELU's
    input and the second linear's input (2sbh + 2 x wide elements, 10sbh as built), and with
    dropout the two residual dropouts' masks (sbh bytes each): all freed once the backward
    has passed the MLP."""
    wide = wide or 4 * sbh
    return (2 * sbh + 2 * wide) * p + (2 * sbh if dropout > 0 else 0)


def kept(cfg, spec, p: int, block: int | None, w: Widths | None = None) -> dict[str, int]:
    """What a transformer's step keeps without XLA (Korthikanti et al. 2022's accounting, per
    checkpointing policy), in bytes: "forward", kept when the forward pass ends (the layers'
    activations, or only the segments' inputs under recomputation); "backward", kept while
    the last layer's backward runs (one rebuilt segment beside the inputs of the others);
    "first", kept while the first layer's backward runs (its own, or its rebuilt segment's);
    "head", the float32 gradient the cross-entropy computes with its loss (measured: 1.00x
    the logits, whose buffer it is; the logits are not kept); "head_backward", the logits
    layer's float32 input and kernel gradients. The embedding output and the final norm's
    output are in both. w: the model's widths (default: cfg.model's)."""
    s, b, m = spec.seq_len, cfg.data.batch_size, w or widths(cfg.model)
    policy = cfg.checkpointing.policy
    attention = m.heads * m.key_dim
    layer = layer_bytes(s, b, m.h, m.heads, p, m.dropout, block, attention, m.mlp_units)
    first = layer  # kept while the first layer's backward runs: its own activations
    if policy == "none" or (policy == "selective" and block):  # a chunked core is not rebuilt
        forward = backward = m.layers * layer
    elif policy == "selective":
        # Each layer keeps all but its attention core, rebuilt one layer at a time.
        core = attention_core_bytes(s, b, m.heads, p, m.dropout)
        forward = m.layers * (layer - core)
        backward = forward + core
    else:
        # Recomputation (Korthikanti et al. 2022, Sec. 4.1: 2sbhL in 16-bit for every block):
        # each segment of k blocks keeps only its input, and one segment's activations are
        # rebuilt at a time in backprop.
        k = segment_length(policy, m.layers, cfg.checkpointing.every)
        forward = math.ceil(m.layers / k) * s * b * m.h * p
        backward = forward + min(k, m.layers) * layer
        first = s * b * m.h * p + min(k, m.layers) * layer  # the first segment, rebuilt
    edges = 2 * s * b * m.h * p  # embedding output and final LayerNorm output
    positions = b * (s if spec.per_token else 1)
    return {
        "forward": forward + edges,
        "backward": backward + edges,
        "first": first + edges,
        "edges": edges,
        "head": positions * spec.num_classes * 4,
        "head_backward": (positions * m.h + m.h * spec.num_classes) * 4,
    }


def activations(
    cfg,
    spec,
    p: int,
    block: int | None,
    grads: tuple[int, int, int, int] = (0, 0, 0, 0),
    w: Widths | None = None,
) -> tuple[int, int, int]:
    """(activations, workspace, gradients) at the step's peak without XLA: the largest of its
    moments. grads: the float32 weight gradients alive at the loss, while the last layer's
    backward runs, while the first layer's runs, and when the backward ends (estimate.py's
    _gradients_alive).
    - The loss: what the forward pass kept, the head's gradient in the logits' buffer, and the
      logits layer's own gradients (the head's backward).
    - The last layer's MLP backward: what backward keeps (one segment rebuilt) and GELU's
      backward (mlp_workspace).
    - Its attention core's backward: what backward keeps, and the core's transients; a chunked
      core's after the layer's MLP activations are freed (its rule is the core's alone; the
      standard core's constants were fitted with them counted).
    - The first layer's MLP and attention backward, with what is kept then (its own layer, or
      its rebuilt segment) and the gradients born by then.
    - The backward's end: the gradients and the embedding's edges.
    Gradients grow and activations shrink layer by layer, so their sum is largest at one end.
    The head's gradient is freed once the logits layer's two gradients are computed, before
    the layers' backward reaches its peak: in the allocator's traces of 28 transformers drawn
    at random (seeds 29 and 31, jit_compile=false), the head's buffer was freed before the
    first layer's backward peaked in every one; summing it with that peak had read up to
    1.6x the measured step (a 1-layer model with 2,546 classes under `blocks`)."""
    m = w or widths(cfg.model)
    held = kept(cfg, spec, p, block, m)
    s, b = spec.seq_len, cfg.data.batch_size
    sbh, wide = s * b * m.h, s * b * m.mlp_units
    # the core sees Q, K and V: heads x key_dim wide (h as built)
    core = core_workspace(s, b, m.heads * m.key_dim, m.heads, p, m.dropout, block)
    freed = mlp_bytes(sbh, p, m.dropout, wide) if block else 0
    mlp_ws = mlp_workspace(sbh, p, wide)
    loss, last, first, end = grads
    moments = [
        (held["forward"] + held["head"], held["head_backward"], loss),
        (held["backward"], mlp_ws, last),
        (held["backward"] - freed, core, last),
        (held["first"], mlp_ws, first),
        (held["first"] - freed, core, first),
        (held["edges"], 0, end),
    ]
    return max(moments, key=sum)
