"""What a transformer's training step holds without XLA (models/transformer.py; under XLA on a
CPU: runner/measure/xla_memory.py), for the estimate (runner/measure/estimate.py): the
activations each layer keeps for backward, by checkpointing policy, and the transients beside
them at the step's two candidate peaks, the loss and the last layer's backward."""

import math

from runner.measure import chunked
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
        return chunked.kept(s, b, a)
    ass = a * s * s * b
    return ass * p + ((ass + ass * p) if dropout > 0 else 0)


def workspace(s, b, h, a, p, dropout, block=None) -> int:
    """Bytes alive beside the kept activations at the peak without XLA: the larger of two
    transients, both **fitted** to measured BFC peaks (this CPU, 4 runs of 18 jobs at
    s=256, b=8, h=32, 4 heads, 2 layers: 3 precisions x dropout 0/0.1 x none/blocks/selective;
    checked at an MLP-bound size, h=128 at 128 tokens, and at s=512, b=2):
    - attention: the softmax's float32 temporaries and the gradients of the probabilities,
      per scores element: 3.2 bytes in float32 (3.6 with dropout), 5 at 16 bits (3.4 with
      dropout), whatever the checkpointing policy;
    - MLP: GELU over the 4h-wide activation, on float32 copies under 16-bit policies.
    The attention core's backward runs in a fixed order (models/memory_limited.py): left to
    the executor, the same job's peak moved by up to 25% from one run to the next.
    """
    sbh, ass = s * b * h, a * s * s * b
    if block:
        return max(
            chunked.workspace(s, b, h, a, p, dropout, block), 16 * sbh * (3.5 if p == 2 else 1)
        )
    if p == 4:
        per_score = 3.6 if dropout > 0 else 3.2
    else:
        per_score = 3.4 if dropout > 0 else 5.0
    mlp = 16 * sbh * (3.5 if p == 2 else 1)
    return int(max(per_score * ass, mlp))


def kept(cfg, spec, p: int, block: int | None) -> dict[str, int]:
    """What a transformer's step keeps without XLA (Korthikanti et al. 2022's accounting, per
    checkpointing policy), in bytes: "forward", kept when the forward pass ends (the layers'
    activations, or only the segments' inputs under recomputation); "backward", kept while
    the last layer's backward runs (one rebuilt segment beside the inputs of the others);
    "head", the float32 gradient the cross-entropy computes with its loss (measured: 1.00x
    the logits, whose buffer it is; the logits are not kept); "head_backward", the logits
    layer's float32 input and kernel gradients. The embedding output and the final norm's
    output are in both."""
    s, b, m = spec.seq_len, cfg.data.batch_size, cfg.model
    policy = cfg.checkpointing.policy
    layer = layer_bytes(s, b, m.h, m.heads, p, m.dropout, block)
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
    edges = 2 * s * b * m.h * p  # embedding output and final LayerNorm output
    positions = b * (s if spec.per_token else 1)
    return {
        "forward": forward + edges,
        "backward": backward + edges,
        "head": positions * spec.num_classes * 4,
        "head_backward": (positions * m.h + m.h * spec.num_classes) * 4,
    }


def activations(cfg, spec, p: int, block: int | None) -> tuple[int, int]:
    """(activations, workspace) at the step's peak without XLA: the larger of two moments.
    - The loss: what the forward pass kept, the head's gradient in the logits' buffer, and the
      logits layer's own gradients (the head's backward).
    - The last layer's backward: what backward keeps (one segment rebuilt), and the larger of
      its attention core's and its MLP's transients (workspace).
    The head's gradient is freed once the logits layer's two gradients are computed, before
    the layers' backward reaches its peak: in the allocator's traces of 28 transformers drawn
    at random (seeds 29 and 31, jit_compile=false), the head's buffer was freed before the
    first layer's backward peaked in every one; summing it with that peak had read up to
    1.6x the measured step (a 1-layer model with 2,546 classes under `blocks`)."""
    held, m = kept(cfg, spec, p, block), cfg.model
    transients = workspace(spec.seq_len, cfg.data.batch_size, m.h, m.heads, p, m.dropout, block)
    loss = (held["forward"] + held["head"], held["head_backward"])
    layers = (held["backward"], transients)
    return max(loss, layers, key=sum)
