"""What a transformer's training step holds without XLA (models/transformer.py; under XLA on a
CPU: runner/estimate/xla_fitted.py), for the estimate (runner/estimate/memory.py): the
activations each layer keeps for backward, by checkpointing policy, and the transients beside
them at the step's three candidate peaks: the loss, the last layer's MLP backward and its
attention core's backward."""

import math

from runner.estimate import chunked_core
from runner.estimate.calibration import CORE_WORKSPACE
from runner.techniques.checkpointing import segment_length


def layer_bytes(
    s: int, b: int, h: int, a: int, p: int, dropout: float, block: int | None = None
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
    at p = 2 with dropout this is exactly 34sbh + 5as^2b. models/transformer.py's block keeps
    exactly these (its layers are memory-limited: models/memory_limited.py). A chunked core
    (block: its keys per block) keeps a float32 logsumexp in place of the as^2b terms.
    """
    sbh = s * b * h
    total = 16 * sbh * p + attention_core_bytes(s, b, a, p, dropout, block)
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


def mlp_workspace(sbh: int, p: int) -> int:
    """Bytes GELU's backward holds beside its input, over the 4h-wide activation (read off the
    allocator's traces of the drawn transformers at their peaks in an MLP's backward): in
    float32 the output gradient and two float32 products (48sbh bytes); at 16 bits the
    output gradient, float32 copies of it and of the input, and one float32 product (56sbh)."""
    return 48 * sbh if p == 4 else 56 * sbh


def mlp_bytes(sbh: int, p: int, dropout: float) -> int:
    """What a layer keeps for its MLP half: the norm's input, the first linear's input, GELU's
    input and the second linear's input (10sbh elements), and with dropout the two residual
    dropouts' masks (sbh bytes each): all freed once the backward has passed the MLP."""
    return 10 * sbh * p + (2 * sbh if dropout > 0 else 0)


def kept(cfg, spec, p: int, block: int | None) -> dict[str, int]:
    """What a transformer's step keeps without XLA (Korthikanti et al. 2022's accounting, per
    checkpointing policy), in bytes: "forward", kept when the forward pass ends (the layers'
    activations, or only the segments' inputs under recomputation); "backward", kept while
    the last layer's backward runs (one rebuilt segment beside the inputs of the others);
    "first", kept while the first layer's backward runs (its own, or its rebuilt segment's);
    "head", the float32 gradient the cross-entropy computes with its loss (measured: 1.00x
    the logits, whose buffer it is; the logits are not kept); "head_backward", the logits
    layer's float32 input and kernel gradients. The embedding output and the final norm's
    output are in both."""
    s, b, m = spec.seq_len, cfg.data.batch_size, cfg.model
    policy = cfg.checkpointing.policy
    layer = layer_bytes(s, b, m.h, m.heads, p, m.dropout, block)
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
    cfg, spec, p: int, block: int | None, grads: tuple[int, int, int, int] = (0, 0, 0, 0)
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
    held, m = kept(cfg, spec, p, block), cfg.model
    s, b = spec.seq_len, cfg.data.batch_size
    sbh = s * b * m.h
    core = core_workspace(s, b, m.h, m.heads, p, m.dropout, block)
    freed = mlp_bytes(sbh, p, m.dropout) if block else 0
    mlp_ws = mlp_workspace(sbh, p)
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
