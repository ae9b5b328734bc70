"""A small pre-LN transformer (GPT-2 style blocks) for token data."""

import functools

import keras
import tensorflow as tf

from models.chunked_attention import chunked_attention_core
from models.common import Sublayer, load_weights, require_kind
from models.memory_limited import (
    LayerNorm,
    attention_context,
    attention_core,
    attention_scores,
    gelu,
    probs_dropout,
    softmax,
)
from models.spec import ATTENTION_KINDS, DataSpec


class TransformerBlock(keras.layers.Layer):
    """Pre-LN block: x + Dropout(MHA(LN(x))), then x + Dropout(MLP(LN(x))) (GPT-2's residual
    dropouts); 12h^2 + 13h parameters as built (key_dim h / heads, mlp_units 4h).

    Its layers are memory-limited (models/memory_limited.py): the norms keep only their
    input, GELU its input, the softmax its 16-bit output, so each layer keeps Korthikanti et
    al. 2022's 34sbh + 5as^2b bytes at 16 bits. MultiHeadAttention holds the projections'
    weights; the attention core between them is memory_limited.attention_core, recomputed in
    backprop when `recompute_attention` is set (checkpointing=selective). With
    attention="chunked" the core is models/chunked_attention.py's, key blocks of
    `attention_block`, and is never recomputed: it keeps only q, k, v, its output (which the
    output projection keeps anyway) and a float32 logsumexp per query, and its backward already
    recomputes the probabilities, so recomputing it would cost a forward pass of the core to
    save the logsumexp alone.

    call() takes the hidden tensor as its only positional tensor and no tensor kwargs, so the
    block can be wrapped in tf.recompute_grad (keras.RematScope is broken on the TF backend,
    keras-team/keras#21207). Causality is a constructor flag for the same reason.
    """

    def __init__(
        self,
        h,
        heads,
        dropout=0.0,
        causal=False,
        attention="standard",
        attention_block=128,
        key_dim=None,
        mlp_units=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_KINDS}")
        self.h, self.heads, self.dropout, self.causal = h, heads, dropout, causal
        self.attention, self.attention_block = attention, attention_block
        # A head's width and the MLP's (h / heads and 4h as built; fewer where structured
        # pruning removed heads or hidden units: runner/channels/).
        self.key_dim, self.mlp_units = key_dim or h // heads, mlp_units or 4 * h
        self.recompute_attention = False
        self.attn_norm = LayerNorm(epsilon=1e-5, name="attn_norm")
        self.attn = keras.layers.MultiHeadAttention(
            num_heads=heads, key_dim=self.key_dim, dropout=dropout, name="attn"
        )
        self.attn_dropout = keras.layers.Dropout(dropout, name="attn_dropout")
        self.probs_seed = keras.random.SeedGenerator(name="probs_seed") if dropout > 0 else None
        self.mlp_norm = LayerNorm(epsilon=1e-5, name="mlp_norm")
        self.mlp_up = keras.layers.Dense(self.mlp_units, activation=gelu, name="mlp_up")
        self.mlp_down = keras.layers.Dense(h, name="mlp_down")
        self.mlp_dropout = keras.layers.Dropout(dropout, name="mlp_dropout")

    def build(self, input_shape):
        # Build every sublayer now so count_params() works before the first call.
        self.attn_norm.build(input_shape)
        self.attn.build(input_shape, input_shape)
        self.mlp_norm.build(input_shape)
        self.mlp_up.build(input_shape)
        self.mlp_down.build((*input_shape[:-1], self.mlp_units))

    def call(self, x, training=None):
        attn, y = self.attn, self.attn_norm(x)
        query, key, value = attn._query_dense(y), attn._key_dense(y), attn._value_dense(y)
        # One seed per step, drawn outside the core: a recomputation draws the same mask.
        rate = self.dropout if training else 0.0
        seed = None
        if rate > 0:  # stateless dropout takes an int32 seed pair
            seed = tf.cast(tf.math.floormod(self.probs_seed.next(), tf.int32.max - 1), tf.int32)

        def core(query, key, value):  # the seed is captured: recompute_grad watches floats
            if self.attention == "chunked":
                block = self.attention_block
                return chunked_attention_core(query, key, value, seed, rate, self.causal, block)
            return attention_core(query, key, value, seed, rate, self.causal)

        if self.recompute_attention and training and self.attention == "standard":
            context = tf.recompute_grad(core)(query, key, value)
        else:
            context = core(query, key, value)
        x = x + self.attn_dropout(attn._output_dense(context), training=training)
        y = self.mlp_down(self.mlp_up(self.mlp_norm(x)))
        return x + self.mlp_dropout(y, training=training)

    def sublayers(self, x: str, out: str, batch: int, seq: int) -> list[Sublayer]:
        """The block as the per-layer profile's rows: norms, the attention projections, the
        attention scores, softmax (and dropout) and product with V, the MLP's matmuls and GELU,
        the residual dropouts and adds, from input `x` to output `out` (names in the caller's
        dataflow). Composed, they compute what call() computes (a test compares).
        """
        h, attn, p = self.h, self.attn, self.name + "/"
        bs, inner, units = batch * seq, self.heads * self.key_dim, self.mlp_units
        bsh = bs * h
        project = 2 * bsh * inner + bs * inner  # h -> heads x key_dim, with its bias

        def row(name, kind, fn, inputs, output, owner=None, flops=None, kept=0):
            variables = owner.trainable_variables if owner is not None else []
            return Sublayer(p + name, kind, fn, tuple(inputs), output, variables, flops, kept)

        def dropout(name, layer, inputs, output):
            return row(name, "Dropout", lambda t: layer(t, training=True), inputs, output)

        rows = [
            row("attn_norm", "LayerNorm", self.attn_norm, [x], p + "y", self.attn_norm),
            *(
                row(f"attn_{n}", "EinsumDense", dense, [p + "y"], p + n, dense, project)
                for n, dense in (
                    ("query", attn._query_dense),
                    ("key", attn._key_dense),
                    ("value", attn._value_dense),
                )
            ),
            *self._core_rows(row, p, batch, seq),
            row(
                "attn_output",
                "EinsumDense",
                attn._output_dense,
                [p + "context"],
                p + "attended",
                attn._output_dense,
                2 * bs * inner * h + bsh,
            ),
            dropout("attn_dropout", self.attn_dropout, [p + "attended"], p + "attn_out"),
            row("attn_residual", "Add", tf.add, [x, p + "attn_out"], p + "x1"),
            row("mlp_norm", "LayerNorm", self.mlp_norm, [p + "x1"], p + "y2", self.mlp_norm),
            row(
                "mlp_up",
                "Dense",
                self._mlp_up_linear,
                [p + "y2"],
                p + "up",
                self.mlp_up,
                2 * bsh * units + bs * units,
            ),
            row("mlp_gelu", "GELU", gelu, [p + "up"], p + "gelu"),
            row(
                "mlp_down",
                "Dense",
                self.mlp_down,
                [p + "gelu"],
                p + "down",
                self.mlp_down,
                2 * bs * units * h + bsh,
            ),
            dropout("mlp_dropout", self.mlp_dropout, [p + "down"], p + "mlp_out"),
            row("mlp_residual", "Add", tf.add, [p + "x1", p + "mlp_out"], out),
        ]
        if self.dropout > 0:
            return rows
        # Dropout at rate 0 is an identity: no rows for it, its consumers read its input.
        skip = {r.output: r.inputs[0] for r in rows if r.kind == "Dropout"}
        return [
            r._replace(inputs=tuple(skip.get(i, i) for i in r.inputs))
            for r in rows
            if r.kind != "Dropout"
        ]

    def _core_rows(self, row, p: str, batch: int, seq: int) -> list[Sublayer]:
        """The attention core's rows, from query, key and value to the context: scores,
        softmax, dropout and product with V; or, chunked, one memory-limited row that keeps
        q, k, v (its readers' rule does not know the kind yet) and a float32 logsumexp per
        query and head."""
        inner = self.heads * self.key_dim
        seed, flops = tf.constant([1, 2], tf.int32), 2 * seq * batch * seq * inner
        qkv = [p + "query", p + "key", p + "value"]
        if self.attention == "chunked":
            width = tf.as_dtype(self.compute_dtype).size
            block, kept = self.attention_block, batch * seq * (3 * inner * width + 4 * self.heads)

            def core(q, k, v):
                return chunked_attention_core(q, k, v, seed, self.dropout, self.causal, block)

            return [
                row(
                    "attn_core",
                    "chunked_attention",
                    core,
                    qkv,
                    p + "context",
                    None,
                    2 * flops,
                    kept,
                )
            ]
        return [
            row(
                "attn_scores",
                "attention_scores",
                attention_scores,
                qkv[:2],
                p + "scores",
                flops=flops,
            ),
            row(
                "attn_softmax",
                "attention_softmax",
                functools.partial(softmax, causal=self.causal),
                [p + "scores"],
                p + "probs",
            ),
            row(
                "attn_probs_dropout",
                "Dropout",
                lambda t: probs_dropout(t, self.dropout, seed),
                [p + "probs"],
                p + "dropped",
            ),
            row(
                "attn_context",
                "attention_context",
                attention_context,
                [p + "dropped", p + "value"],
                p + "context",
                flops=flops,
            ),
        ]

    def _mlp_up_linear(self, y):
        """mlp_up without its GELU (a row of its own): matmul and bias, as Dense computes them."""
        dense = self.mlp_up
        return keras.ops.cast(y, dense.compute_dtype) @ keras.ops.cast(
            dense.kernel, dense.compute_dtype
        ) + keras.ops.cast(dense.bias, dense.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(h=self.h, heads=self.heads, dropout=self.dropout, causal=self.causal)
        config.update(attention=self.attention, attention_block=self.attention_block)
        config.update(key_dim=self.key_dim, mlp_units=self.mlp_units)
        return config


def build_transformer(
    spec: DataSpec,
    h=128,
    layers=2,
    heads=4,
    dropout=0.0,
    attention="standard",
    attention_block=128,
    weights=None,
):
    """Token + learned position embeddings -> `layers` TransformerBlocks -> LN -> head.

    attention: "standard" (the s^2 core) or "chunked" (exact, linear in the sequence length,
    key blocks of `attention_block`: models/chunked_attention.py).

    spec.per_token: causal blocks and logits [B, seq, num_classes] (language modelling);
    otherwise bidirectional blocks, mean-pooled, logits [B, num_classes]. Logits are float32
    under any precision policy (float16 softmax/cross-entropy overflows).
    """
    require_kind(spec, "tokens", "transformer")
    if h % heads:
        raise ValueError(f"model.h={h} must be divisible by model.heads={heads}")
    tokens = keras.Input(shape=(spec.seq_len,), dtype="int32", name="tokens")
    # Positions 0..seq-1 per row, derived from `tokens` so they stay inside the graph. A running
    # count, not `zeros + arange`: TensorFlow lowers an int32 add of a [seq] constant to BiasAdd,
    # which LiteRT's builtin ops lack (the converter refuses the model); CUMSUM they have.
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1
    x = keras.layers.Embedding(spec.vocab_size, h, name="token_embedding")(tokens)
    x = x + keras.layers.Embedding(spec.seq_len, h, name="position_embedding")(positions)
    for i in range(layers):
        block = TransformerBlock(
            h, heads, dropout, spec.per_token, attention, attention_block, name=f"block_{i}"
        )
        x = block(x)
    x = LayerNorm(epsilon=1e-5, name="final_norm")(x)
    if not spec.per_token:
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    model = keras.Model(tokens, logits, name="transformer")
    return load_weights(model, weights)
