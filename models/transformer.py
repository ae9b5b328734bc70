"""A small pre-LN transformer (GPT-2 style blocks) for token data."""

import keras

from models.common import load_weights, require_kind
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
