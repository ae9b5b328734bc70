"""A small pre-LN transformer (GPT-2 style blocks) for token data."""

import keras
import tensorflow as tf

from models.common import Sublayer, load_weights, require_kind
from models.spec import DataSpec


class TransformerBlock(keras.layers.Layer):
    """Pre-LN block: x + MHA(LN(x)), then x + MLP(LN(x)); 12h^2 + 13h parameters.

    call() takes the hidden tensor as its only positional tensor and no tensor kwargs, so the
    block can be wrapped in tf.recompute_grad (keras.RematScope is broken on the TF backend,
    keras-team/keras#21207). Causality is a constructor flag for the same reason.
    """

    def __init__(self, h, heads, dropout=0.0, causal=False, **kwargs):
        super().__init__(**kwargs)
        self.h, self.heads, self.dropout, self.causal = h, heads, dropout, causal
        self.attn_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="attn_norm")
        self.attn = keras.layers.MultiHeadAttention(
            num_heads=heads, key_dim=h // heads, dropout=dropout, name="attn"
        )
        self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="mlp_norm")
        self.mlp_up = keras.layers.Dense(4 * h, activation="gelu", name="mlp_up")
        self.mlp_down = keras.layers.Dense(h, name="mlp_down")
        self.mlp_dropout = keras.layers.Dropout(dropout, name="mlp_dropout")

    def build(self, input_shape):
        # Build every sublayer now so count_params() works before the first call.
        self.attn_norm.build(input_shape)
        self.attn.build(input_shape, input_shape)
        self.mlp_norm.build(input_shape)
        self.mlp_up.build(input_shape)
        self.mlp_down.build((*input_shape[:-1], 4 * self.h))

    def call(self, x, training=None):
        y = self.attn_norm(x)
        x = x + self.attn(y, y, use_causal_mask=self.causal, training=training)
        y = self.mlp_down(self.mlp_up(self.mlp_norm(x)))
        return x + self.mlp_dropout(y, training=training)

    def sublayers(self, x: str, out: str, batch: int, seq: int) -> list[Sublayer]:
        """The block as the per-layer profile's rows: norms, the attention projections, the
        attention scores, softmax (and dropout) and product with V, the MLP's matmuls and GELU,
        and the residual adds, from input `x` to output `out` (names in the caller's dataflow).

        They compute what call() computes (a test composes them and compares): the sublayers'
        own layers where they are layers, and Keras's attention core spelled out step by step.
        Keras's MultiHeadAttention takes ops.dot_product_attention when dropout is 0 (logits and
        softmax in float32, then a cast to the compute dtype: backward keeps both copies, and
        a causal run keeps a boolean mask of the scores' size) and its own Softmax layer in the
        compute dtype otherwise (keras/src/layers/attention/multi_head_attention.py).
        """
        h, a, attn, p = self.h, self.heads, self.attn, self.name + "/"
        bsh, ass = batch * seq * h, a * seq * seq * batch
        half = keras.backend.standardize_dtype(self.compute_dtype) != "float32"
        matmul = 2 * bsh * h + bsh  # one h x h projection with its bias
        if self.dropout == 0:
            scores, softmax = self._dot_product_scores, self._dot_product_softmax
            # The boolean causal mask (1 byte) and, in 16 bits, the float32 probabilities.
            mask_bytes, f32_bytes = (ass if self.causal else 0), (4 * ass if half else 0)
        else:
            scores, softmax, mask_bytes, f32_bytes = self._scaled_scores, self._softmax, 0, 0
        rows = [
            Sublayer(p + "attn_norm", "LayerNormalization", self.attn_norm, (x,), p + "y", []),
            *(
                Sublayer(p + f"attn_{n}", "EinsumDense", dense, (p + "y",), p + n, [], matmul)
                for n, dense in (
                    ("query", attn._query_dense),
                    ("key", attn._key_dense),
                    ("value", attn._value_dense),
                )
            ),
            Sublayer(
                p + "attn_scores",
                "attention_scores",
                scores,
                (p + "query", p + "key"),
                p + "scores",
                [],
                2 * seq * bsh,
                mask_bytes,
            ),
            Sublayer(
                p + "attn_softmax",
                "attention_softmax",
                softmax,
                (p + "scores",),
                p + "probs",
                [],
                None,
                f32_bytes,
            ),
        ]
        probs = p + "probs"
        if self.dropout > 0:
            rows.append(
                Sublayer(
                    p + "attn_dropout",
                    "Dropout",
                    self._attention_dropout,
                    (probs,),
                    p + "dropped",
                    [],
                )
            )
            probs = p + "dropped"
        rows += [
            Sublayer(
                p + "attn_context",
                "attention_context",
                self._context,
                (probs, p + "value"),
                p + "context",
                [],
                2 * seq * bsh,
            ),
            Sublayer(
                p + "attn_output",
                "EinsumDense",
                attn._output_dense,
                (p + "context",),
                p + "attended",
                [],
                matmul,
            ),
            Sublayer(p + "attn_residual", "Add", tf.add, (x, p + "attended"), p + "x1", []),
            Sublayer(
                p + "mlp_norm", "LayerNormalization", self.mlp_norm, (p + "x1",), p + "y2", []
            ),
            Sublayer(
                p + "mlp_up", "Dense", self._mlp_up_linear, (p + "y2",), p + "up", [], 4 * matmul
            ),
            Sublayer(p + "mlp_gelu", "GELU", keras.activations.gelu, (p + "up",), p + "gelu", []),
            Sublayer(
                p + "mlp_down",
                "Dense",
                self.mlp_down,
                (p + "gelu",),
                p + "down",
                [],
                4 * matmul - 3 * bsh,
            ),
            Sublayer(
                p + "mlp_dropout", "Dropout", self._mlp_dropout, (p + "down",), p + "mlp_out", []
            ),
            Sublayer(p + "mlp_residual", "Add", tf.add, (p + "x1", p + "mlp_out"), out, []),
        ]
        if self.dropout == 0:  # an identity: no row for it
            rows = [r for r in rows if r.name != p + "mlp_dropout"]
            rows[-1] = rows[-1]._replace(inputs=(p + "x1", p + "down"))
        owners = {
            "attn_norm": self.attn_norm,
            "attn_query": attn._query_dense,
            "attn_key": attn._key_dense,
            "attn_value": attn._value_dense,
            "attn_output": attn._output_dense,
            "mlp_norm": self.mlp_norm,
            "mlp_up": self.mlp_up,
            "mlp_down": self.mlp_down,
        }
        return [
            r._replace(variables=owners[r.name[len(p) :]].trainable_variables)
            if r.name[len(p) :] in owners
            else r
            for r in rows
        ]

    # The attention core, step by step, as Keras's TensorFlow backend computes it
    # (keras/src/backend/tensorflow/nn.py, _dot_product_attention_xla and _apply_masks).
    def _dot_product_scores(self, query, key):
        logits = tf.cast(tf.einsum("BTNH,BSNH->BNTS", query, key), tf.float32)
        logits = logits * (1.0 / float(self.attn._key_dim) ** 0.5)
        if not self.causal:
            return logits
        seq = tf.shape(logits)
        band = tf.linalg.band_part(tf.ones((seq[2], seq[3]), tf.bool), -1, 0)[None, None]
        keep = tf.logical_and(tf.ones_like(logits, dtype=tf.bool), band)
        return tf.where(keep, logits, tf.constant(-0.7 * 3.38953e38, tf.float32))

    def _dot_product_softmax(self, logits):
        return tf.cast(tf.nn.softmax(logits, axis=-1), self.compute_dtype)

    # With dropout, MultiHeadAttention's own path (its _compute_attention).
    def _scaled_scores(self, query, key):
        attn = self.attn
        query = keras.ops.multiply(query, keras.ops.cast(attn._inverse_sqrt_key_dim, query.dtype))
        return keras.ops.einsum(attn._dot_product_equation, key, query)

    def _softmax(self, scores):
        mask = self.attn._compute_causal_mask(scores[:, 0], scores[:, 0]) if self.causal else None
        return self.attn._masked_softmax(scores, mask)

    def _attention_dropout(self, probs):
        return self.attn._dropout_layer(probs, training=True)

    def _context(self, probs, value):
        if self.dropout == 0:
            return tf.einsum("BNTS,BSNH->BTNH", probs, value)
        return keras.ops.einsum(self.attn._combine_equation, probs, value)

    def _mlp_up_linear(self, y):
        """mlp_up without its GELU (a row of its own): matmul and bias, as Dense computes them."""
        dense = self.mlp_up
        return keras.ops.cast(y, dense.compute_dtype) @ keras.ops.cast(
            dense.kernel, dense.compute_dtype
        ) + keras.ops.cast(dense.bias, dense.compute_dtype)

    def _mlp_dropout(self, y):
        return self.mlp_dropout(y, training=True)

    def get_config(self):
        config = super().get_config()
        config.update(h=self.h, heads=self.heads, dropout=self.dropout, causal=self.causal)
        return config


def build_transformer(spec: DataSpec, h=128, layers=2, heads=4, dropout=0.0, weights=None):
    """Token + learned position embeddings -> `layers` TransformerBlocks -> LN -> head.

    spec.per_token: causal blocks and logits [B, seq, num_classes] (language modelling);
    otherwise bidirectional blocks, mean-pooled, logits [B, num_classes]. Logits are float32
    under any precision policy (float16 softmax/cross-entropy overflows).
    """
    require_kind(spec, "tokens", "transformer")
    if h % heads:
        raise ValueError(f"model.h={h} must be divisible by model.heads={heads}")
    tokens = keras.Input(shape=(spec.seq_len,), dtype="int32", name="tokens")
    # Positions 0..seq-1 per row, derived from `tokens` so they stay inside the graph.
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(spec.seq_len, dtype="int32")
    x = keras.layers.Embedding(spec.vocab_size, h, name="token_embedding")(tokens)
    x = x + keras.layers.Embedding(spec.seq_len, h, name="position_embedding")(positions)
    for i in range(layers):
        x = TransformerBlock(h, heads, dropout, causal=spec.per_token, name=f"block_{i}")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    if not spec.per_token:
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(spec.num_classes, dtype="float32", name="logits")(x)
    model = keras.Model(tokens, logits, name="transformer")
    return load_weights(model, weights)
