"""What a chunked attention core (models/chunked_attention.py, model.attention=chunked) holds
for the estimate: what it keeps for backward, and what its backward holds while it runs.

The core is one tf.custom_gradient over loops of key blocks: backward keeps q, k, v and the
output (the layer keeps those anyway, as Korthikanti et al.'s 5sbh of attention) and a float32
logsumexp per query, and recomputes each key block's probabilities from it; every temporary is
[b, a, s, block]. Both terms are linear in s for a fixed block, where the standard core's are
a s^2 b.
"""


def kept(s: int, b: int, a: int, h: int = 0, xla: bool = False) -> int:
    """Bytes the core keeps beyond q, k, v and its output: the float32 logsumexp, asb; under
    XLA on a CPU (xla) also the forward's scaled queries and blocked keys and values in
    float32, 3 sbh: backward computes the same tensors from the same inputs, and XLA keeps
    the forward's rather than compute them twice. Measured, chains of 2 and 6 cores
    (forward and backward, jit_compile=True, the allocator's peak; s=512, b=4, h 64-128, 4-8
    heads, blocks of 64-128): 28.0-28.5 bytes per sbh a layer in float32, 24.3-24.5 in
    bfloat16, where q, k, v and the output alone are 16 and 8 (without XLA no such term)."""
    return 4 * a * s * b + (3 * s * b * h * 4 if xla else 0)


def loop_operands(s: int, b: int, a: int, h: int, block: int, p: int) -> int:
    """Bytes of a chunked core's forward loop that XLA on a CPU keeps, under recomputation,
    from the forward pass until the core's layer is rebuilt: the copies of the scaled queries,
    the blocked keys and values (padded to whole blocks) and the float32 accumulator that
    enter the key-block loop, and the loop's running max and sum (asb float32 each). Read off
    XLA's buffer assignments, for each layer not yet rebuilt:
    - h=64, 4 layers, 4 heads, 256 tokens, batch 4, blocks of 64, checkpointing=blocks: four
      sbh float32 buffers in float32; in bfloat16 two float32 and two bfloat16;
    - seed 29's draw 52 (h=40, 11 layers, 10 heads, 127 tokens, batch 6, blocks of 32,
      dropout 0.1): four sbh buffers (two of them padded to 128 tokens) and two asb.
    More than one key block (s > block): with one, XLA removes the loop, and xla_memory counts
    the core as the standard one. p: the element size the estimate takes for the policy under
    XLA on a CPU (float32's for bfloat16), at most 4."""
    padded = -(-s // block) * block
    return b * h * (2 * s * 4 + 2 * padded * min(p, 4)) + 2 * a * padded * b * 4


def rebuilt_operands(s: int, b: int, h: int, p: int) -> int:
    """Bytes XLA on a CPU allocates for a rebuilt layer's chunked core backward before that
    layer's MLP backward has ended, so both are alive at once: three sbh float32 copies of the
    loop's operands and one of the key or value gradients' arrays (sbh at p). Read off the
    same buffer assignments as loop_operands (float32: four sbh float32; bfloat16: three
    float32 and one bfloat16); more than one key block, as there."""
    return s * b * h * (3 * 4 + min(p, 4))


def workspace(
    s: int, b: int, h: int, a: int, p: int, dropout: float, block: int, xla: bool = False
) -> int:
    """Bytes a chunked core's backward holds while it runs (models/chunked_attention.py
    _backward): the output gradient and its transposed copy, the scaled queries and the
    blocked keys and values (5 sbh at p bytes), dk and dv's arrays (2 sbh), the float32 dq
    sum (4 sbh bytes) and delta (asb float32); and one key block's [b, a, s, block]
    temporaries: the scores, probabilities and their gradient in float32, with dropout the
    mask's factors and the dropped probabilities, and under a 16-bit policy the 16-bit copies
    of the probabilities and of the scores' gradient (in float32 those casts are no-ops).

    Measured, the core alone (forward and backward of chunked_attention_core, no XLA, the
    allocator's peak above its inputs, 24 shapes: s 256-1024, b 2-8, h 64-128, 4-8 heads,
    blocks of 64-128, float32 and bfloat16, dropout 0 and 0.1): a least-squares fit gave
    29.5 bytes per sbh and 11.7 per [b, a, s, block] element in float32 without dropout
    (7p + 4 = 32 and 12 here), 24.0 per block element with dropout (20 here), 17.1 in
    bfloat16 (16 here).
    Under XLA on a CPU (xla) the loop's body is fused: of each key block only the
    probabilities and their gradient are buffers, and the mask's factors with dropout, in
    float32 whatever the policy; the sbh part is float32 too. Measured as above with
    jit_compile=True: 32.9 bytes per sbh (7 x 4 + 4 = 32 here) and 8.5 per block element
    (8 here) in float32, 30.4 and 8.0 in bfloat16; with dropout 12.4 and 12.1 (12 here).
    Those shapes had b and a above 1. Where either is 1 (a micro-batch of one, or one head),
    XLA gives one more block its own storage (xla_block_buffers).
    """
    sbh, asc = s * b * h, a * s * block * b
    if xla:
        # the 3 sbh kept from the forward pass (kept) are not allocated again here
        return (32 - 12) * sbh + 4 * a * s * b + xla_block_buffers(b, a, dropout) * 4 * asc
    per_block = (3 + (2 if dropout > 0 else 0)) * 4 + (2 * p if p < 4 else 0)
    return (7 * p + 4) * sbh + 4 * a * s * b + per_block * asc


def xla_block_buffers(b: int, a: int, dropout: float) -> int:
    """Float32 [b, a, s, block] buffers that XLA's plan of a chunked core's backward on a CPU
    stores at once: the probabilities and their gradient, with dropout the random bits (u32,
    read by two fusions) and the dropped probabilities. A fusion whose operand dies in it may
    write its output into the operand's buffer, when both have one shape: with b and a above 1
    the dropped probabilities overwrite the probabilities (and without dropout the gradient
    does). Where b or a is 1, XLA drops the unit dimension inside those fusions (their outputs
    are [a, s, block] or [b, s, block], a bitcast), the shapes differ, and each keeps its own
    buffer. Read off the plan's peak (XLA_FLAGS=--xla_dump_to, "Live ranges at ... (peak)"
    and each value's offset), the core alone, jit_compile=True: (b, a) = (2, 8), (2, 4),
    (4, 3), (3, 5): 3 live and 2 stored, 4 and 3 with dropout; (1, 8), (2, 1), (1, 1) and
    b=1 a=8 at 512 tokens: 3 and 3, 4 and 4. In a model, seed 31's draw 6 (b=1, 15 heads,
    693 tokens) and h=32, 8 heads, 512 tokens at b=1: four stored; at b=2, blocks of 64: four
    live, three stored."""
    unit = b == 1 or a == 1
    return (3 if dropout > 0 else 2) + (1 if unit else 0)


def xla_float16_layer(s: int, b: int, a: int, h: int) -> int:
    """Bytes a transformer layer with a chunked core (more than one key block) keeps under XLA
    on a CPU with the float16 policy, beyond its dropout masks. The standard core's layer keeps
    float32 copies beside its 16-bit tensors (6 bytes per sbh element, calibration.CPU_XLA_BYTES);
    this one keeps its sbh terms as float32's layer does, except the residual stream and the
    core's blocked operands, which stay float16, and one 4h float32 copy more in its MLP (the
    down projection's operand, a float32 copy of the 16-bit GELU output). Read off XLA's plans
    (the per-layer slope of 2 and 4 layers, h=64, 4 heads, 256 tokens, blocks of 64, b=4,
    `none`, dropout 0): float32's layer three 4h and 12 sbh float32 tensors (96 bytes per
    sbh; the rule 92); float16's four 4h float32, 6 sbh float32 and 6 float16 (the two
    residual adds and four blocked operands): 100 bytes per sbh, where 6 bytes per element
    counted 132. Here: 20 sbh elements and one 4h copy in float32, and the core's 3 sbh kept
    operands at 2 bytes (102), and its logsumexp (kept without XLA's float32 operands)."""
    return (20 * 4 + 4 * 4 + 3 * 2) * s * b * h + kept(s, b, a)
