"""What a training step compiled by XLA for a CPU keeps at its peak (TF 2.21), for the estimate.

XLA plans a compiled step's memory before running it: `XLA_FLAGS=--xla_dump_to=DIR` writes the
plan (`*buffer-assignment.txt`, "Total bytes used"). In 62 jobs of the transformer the plan was
the allocator's measured peak to within 0.8 MiB (2.6 MiB with a vocabulary of 2048). The
figures below are fitted to those plans (issue 17): the slope between micro-batch 8 and 16,
and what stays at micro-batch 0, over h 48-256, 64-256 tokens, 2-9 layers, 4-8 heads,
vocabularies of 32-2048, dropout 0 and 0.1, and checkpointing none, selective, blocks and sqrt.
Against measured peaks at micro-batch 8-32 in 28 other jobs (accum 2 among them) the estimate
read 0.93-1.00x, median 0.99x. They are measured, not derived: XLA's fusions decide what it
keeps. CNNs under XLA (not the default on a CPU) are not fitted.

- Each layer keeps Korthikanti et al.'s 16sbh + as^2b elements and 4sbh more. Dropout's masks
  are kept as their random draws (32 bits under float32, 16 under 16-bit policies), not as
  bytes; 16-bit policies keep float32 copies beside 16-bit tensors (CORE_BYTES). Under
  recomputation the dropout masks drawn in the forward (the attention's as^2b and the two
  sbh) stay alive until their segment is rebuilt:
  a mask depends on the seed, not on the layer's input, so XLA computes it once for both.
  Backprop rebuilds the last segment first, so inside a segment's backward the masks of the
  layers before it are alive beside it, and those after it are freed. Read off XLA's plans:
  - segments of 2 and 1 layers (seed 29's draw 14: h=48, 3 layers, 16 heads, 83 tokens): at
    the peak, in the first segment's backward, six as^2b float32 buffers, its two layers'
    softmax, dropout output and mask, and no other layer's mask (counting every layer's mask
    besides had put the estimate at 1.44x the plan);
  - 4 layers under blocks (h=64, 4 heads, 128 tokens): in the last layer's backward, all
    four attention masks and seven sbh masks (the last layer's MLP mask was freed).
- Backprop peaks at one of two moments, whichever holds more: at the loss, with the float32
  logits and their gradient and 3sbh float32 besides; or inside a layer's backward (the
  rebuilt segment's, under checkpointing): in its MLP, with 6sbh float32 of gradients besides
  the kept activations (5sbh when the layer was rebuilt); or in its attention, where the
  MLP's activations are freed and the scores' gradients are alive (many heads, long
  sequences).
- Gradients: XLA applies each variable's update as soon as its gradient is ready, so under
  float32 without accumulation only about the two largest variables' gradients are alive at
  once (measured 0.08-0.39 of all gradients; the two largest: an MLP's two kernels, or the
  embedding and the output layer); an accumulating step holds them all (gradient_bytes).
  Under 16-bit policies, 0.9-1.0 (bfloat16) and 1.5-2.0 (float16) of all gradients were
  alive beyond the weights and slots: they are counted in full. 16-bit policies read
  1.01-1.06x (bfloat16) and 0.90-1.08x (float16) of XLA's plan.
"""

import math

from runner.estimate import chunked_core
from runner.estimate.calibration import (  # fitted to XLA's plans: calibration.py
    CORE_BYTES,
    EXTRA_PER_LAYER,
    LAYER_GRADIENTS,
    LOSS_GRADIENTS,
    MASK_BYTES,
    MLP_16BIT_SAVING,
    MLP_KEPT,
    ONE_BLOCK_16BIT,
    SCORE_GRADIENTS,
    TRANSPOSED_COPY,
)
from runner.techniques.checkpointing import segment_length


def layer_bytes(s, b, h, a, p, dropout, block=None, policy="float32", core=None) -> int:
    """Activations a transformer layer keeps for backward under XLA on a CPU; with a chunked
    core (block), what it keeps (runner/estimate/chunked_core.py) in place of the as^2b terms.
    p: bytes per sbh element; policy: the precision policy (CORE_BYTES, MASK_BYTES); core:
    the precision the attention core computes in (None: the policy's)."""
    sbh, ass = s * b * h, a * s * s * b
    masks = 2 * sbh * MASK_BYTES[policy] if dropout > 0 else 0  # the residual path's two
    kept = ((16 + EXTRA_PER_LAYER) * p - MLP_16BIT_SAVING[policy]) * sbh + masks
    if block and policy == "mixed_float16":
        return masks + chunked_core.xla_float16_layer(s, b, a, h)
    if block:
        return kept + chunked_core.kept(s, b, a, h, xla=True)
    return kept + ass * CORE_BYTES[core or policy][dropout > 0]


def core_bytes(s: int, b: int, a: int, dropout: float, policy: str = "float32") -> int:
    """What checkpointing=selective rebuilds of a layer: the core's as^2b tensors, but its
    dropout mask, which stays (CORE_BYTES)."""
    ass = a * s * s * b
    if dropout > 0:
        return ass * (CORE_BYTES[policy][1] - MASK_BYTES[policy])
    return ass * CORE_BYTES[policy][0]


def score_moment(ass: int, dropout: float, precision: str) -> int:
    """Bytes the attention's backward holds beyond its core's kept as^2b tensors: the float32
    softmax and the scores' gradients, less the core (CORE_BYTES), never below nothing."""
    core = CORE_BYTES[precision][dropout > 0]
    return int(max(0.0, 4 + SCORE_GRADIENTS * 4 - core) * ass)


def transformer_activations(cfg, spec, p: int, block: int | None = None) -> tuple[int, int]:
    """(activations kept, workspace at the peak) of the transformer under XLA on a CPU; block:
    a chunked core's keys per block (None: the standard core)."""
    s, b, m = spec.seq_len, cfg.data.batch_size, cfg.model
    sbh, ass = s * b * m.h, m.heads * s * s * b
    precision = core = cfg.precision.policy  # core: what the attention core computes in
    is_chunked = block is not None  # selective never rebuilds one (one key block or more)
    if block and s <= block:
        # One key block: XLA removes the loops, and its common-subexpression pass merges the
        # backward's recomputed scores and dropout factors with the forward's, so the core
        # keeps what the standard core keeps (seed 29's draw 59, 9 layers, bfloat16, dropout:
        # 2.18x the chunked core's count, 1.01x the standard's). The chunked core computes its
        # scores, probabilities and dropout draws in float32 (models/chunked_attention.py),
        # so it keeps them as float32's standard core does (draw 59: 1.30 counted as
        # bfloat16's); under a 16-bit policy, as two (ONE_BLOCK_16BIT).
        block, core = None, "float32" if precision == "float32" else ONE_BLOCK_16BIT
    layer = layer_bytes(s, b, m.h, m.heads, p, m.dropout, block, precision, core)
    policy, masks = cfg.checkpointing.policy, 0
    if policy == "none" or (policy == "selective" and is_chunked):  # not rebuilt
        kept, rebuilt = m.layers * layer, 0
    elif policy == "selective":
        rebuilt = core_bytes(s, b, m.heads, m.dropout, core)
        kept = m.layers * (layer - rebuilt) + rebuilt
    else:  # each segment of k layers keeps its input; one segment is rebuilt at a time
        k = segment_length(policy, m.layers, cfg.checkpointing.every)
        # What a layer's forward leaves alive until the layer is rebuilt: its dropout masks,
        # the attention's as^2b (not a chunked core's, drawn again from seeds) and its two
        # sbh, as random draws (MASK_BYTES); and a chunked core's loop operands.
        mask = (
            2 * sbh * MASK_BYTES[precision] + (0 if block else ass * MASK_BYTES[core])
            if m.dropout > 0
            else 0
        )
        if block:
            mask += chunked_core.loop_operands(s, b, m.heads, m.h, block, p)
        # Segments start every k layers; the masks of the layers before a segment are alive.
        starts = range(0, m.layers, k)
        rebuilt = max(i * mask + min(k, m.layers - i) * layer for i in starts)
        masks = m.layers * mask  # at the loss, no segment rebuilt yet: every mask alive
        kept = math.ceil(m.layers / k) * sbh * p + rebuilt
    edges = 2 * sbh * p  # embedding output and final LayerNorm output
    logits = b * (s if spec.per_token else 1) * spec.num_classes * 4
    at_loss = 2 * logits + LOSS_GRADIENTS * sbh * 4
    attention = (
        chunked_core.workspace(s, b, m.h, m.heads, p, m.dropout, block, xla=True)
        - MLP_KEPT * sbh * p
        if block
        else score_moment(ass, m.dropout, core) - MLP_KEPT * sbh * p
    )
    if block is None and b == 1:  # the transposed copies (TRANSPOSED_COPY)
        attention += TRANSPOSED_COPY * ass
    in_mlp = LAYER_GRADIENTS["none" if policy == "none" else "rebuilt"] * sbh * 4
    if block and rebuilt:  # a rebuilt chunked core's backward starts before its MLP's ends
        in_mlp += chunked_core.rebuilt_operands(s, b, m.h, p)
    in_layer = max(in_mlp, attention)  # in the layer's MLP, or in its attention
    # At the loss, no segment is rebuilt yet: what it needs beyond the rebuilt activations.
    return kept + edges, max(in_layer, masks + at_loss - rebuilt)


def gradient_bytes(trainable, policy: str, accum: int = 1) -> int:
    """Float32 gradients alive at the peak: the two largest under float32, all otherwise. An
    accumulating step (accum > 1) holds them all under float32 too: its micro-batch step adds
    every gradient to its sum after the backward. Read off XLA's plan of that step
    (`add_micro_batch`; seed 29's draw 57, h=108, 5 layers, accum 2, blocks): every layer's
    kernel gradients alive at the peak, in the first layer's backward (measured/estimate
    1.171 with the two largest counted, 0.99 with all)."""
    sizes = sorted((math.prod(v.shape) * 4 for v in trainable), reverse=True)
    return sum(sizes[:2]) if policy == "float32" and accum == 1 else sum(sizes)


def update_call_bytes(gradients: int, scaled: bool) -> int:
    """What an accumulating step's update call (runner/techniques/accumulation.py apply_sum),
    compiled by XLA, holds beyond the weights, slots and sums: under loss scaling two float32
    copies of every gradient, the quotients of the sums by the scale (all made before the
    conditional that skips a non-finite step) and the conditional's results, which XLA
    returns as new buffers rather than updating the variables in place. Read off XLA's plans
    of that call (`cond/cond/truediv`, the conditional's outputs and their copies): 1.86, 1.94
    and 2.22 copies in its temporary buffer (h=256, 2 layers, vocabulary 500; h=64, 4 layers,
    vocabulary 2000; h=168, 1 layer, vocabulary 3996; micro-batch 1, `mixed`). Without loss
    scaling there is no conditional, and the micro-batch call holds more in every job measured
    (0 here: not counted). gradients: bytes of every gradient in float32."""
    return 2 * gradients if scaled else 0
