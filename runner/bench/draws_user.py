"""The drawn family of users' own functional models (issue 50): examples/layer_models.py's
recurrent text models, small vision transformers with keras's MultiHeadAttention, CNNs with
GroupNormalization and GELU, and Conv1D text models, each at random sizes, for
runner/bench/draws.py. They are composed from examples/conf beside conf/, with examples/ on
the import path, as a user runs `python run.py --config-dir examples/conf model=vit`."""

import random
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
USER_MODELS = ("recurrent", "vit", "groupnorm_cnn", "conv1d_text")
GATES = {"lstm": 4, "gru": 3, "simple": 1}


def examples_importable() -> str:
    """examples/ on the import path (a spawned job inherits it); its conf folder, for
    run_jobs's config_dir."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    return str(EXAMPLES / "conf")


def _recurrent(rng: random.Random) -> tuple[dict, float, float, float]:
    cell = rng.choice(tuple(GATES))
    units, embed, depth = rng.randint(16, 256), rng.randint(16, 256), rng.randint(1, 3)
    steps, vocab, both = rng.randint(16, 256), rng.randint(16, 4096), rng.random() < 0.25
    knobs = {
        "model": "recurrent", "model.cell": cell, "model.units": units, "model.depth": depth,
        "model.embed": embed, "model.bidirectional": both, "data.seq_len": steps,
        "data.vocab_size": vocab,
    }  # fmt: skip
    directions = 2 if both else 1
    weights = sum(
        (f + units) * GATES[cell] * units for f in [embed] + [units * directions] * (depth - 1)
    )
    macs = steps * directions * weights + steps * units * directions * vocab
    held = depth * directions * steps * (7 * units + 2 * max(embed, units)) * 4
    ahead = depth * directions * 32 * weights * 4  # weight-gradient products run ahead
    params = directions * weights + vocab * (embed + units * directions)
    return knobs, 6 * macs / 1e9, held / 2**20, (params * 16 + ahead) / 2**20


def _vit(rng: random.Random) -> tuple[dict, float, float, float]:
    heads, key_dim, patch = rng.randint(1, 8), rng.choice((8, 16, 32)), rng.choice((2, 4, 8))
    width, depth = heads * key_dim, rng.randint(1, 4)
    size = patch * rng.randint(4, 16)
    knobs = {
        "model": "vit", "model.patch": patch, "model.width": width, "model.heads": heads,
        "model.depth": depth, "model.dropout": rng.choice((0.0, 0.1)), "data.image_size": size,
    }  # fmt: skip
    n = (size // patch) ** 2
    macs = depth * (8 * n * width * width + 2 * n * n * width) + n * patch * patch * 3 * width
    held = depth * (20 * n * width + 3 * heads * n * n) * 4
    return knobs, 6 * macs / 1e9, held / 2**20, depth * 12 * width * width * 16 / 2**20


def _groupnorm_cnn(rng: random.Random) -> tuple[dict, float, float, float]:
    groups, depth = rng.choice((1, 2, 4, 8)), rng.randint(1, 4)
    filters, size = groups * rng.randint(1, 8), rng.randint(16, 128)
    knobs = {
        "model": "groupnorm_cnn", "model.filters": filters, "model.depth": depth,
        "model.groups": groups, "data.image_size": size,
    }  # fmt: skip
    macs = held = 0
    for i in range(depth):
        pixels, cin = (size / 2**i) ** 2, 3 if i == 0 else filters * 2 ** (i - 1)
        macs += pixels * 9 * cin * filters * 2**i
        held += pixels * filters * 2**i * 6 * 4
    params = sum(9 * filters**2 * 4**i for i in range(depth))
    return knobs, 6 * macs / 1e9, held / 2**20, params * 16 / 2**20


def _conv1d_text(rng: random.Random) -> tuple[dict, float, float, float]:
    embed, filters, depth = rng.randint(16, 128), rng.randint(16, 256), rng.randint(1, 4)
    steps, vocab = rng.randint(16, 512), rng.randint(16, 4096)
    knobs = {
        "model": "conv1d_text", "model.embed": embed, "model.filters": filters,
        "model.depth": depth, "data.seq_len": steps, "data.vocab_size": vocab,
    }  # fmt: skip
    macs = steps * (5 * embed * filters + (depth - 1) * 5 * filters**2 + filters * vocab)
    held = steps * (depth * 6 * filters + 3 * vocab) * 4
    params = 5 * filters * (embed + (depth - 1) * filters) + vocab * (embed + filters)
    return knobs, 6 * macs / 1e9, held / 2**20, params * 16 / 2**20


def user_model(rng: random.Random, kind: str) -> tuple[dict, float, float, float]:
    """(overrides, GFLOPs and MiB held per example, MiB held whatever the batch) of a user's
    model of `kind` (USER_MODELS) at sizes drawn at random (rough figures: they only reject
    draws)."""
    draw = {"recurrent": _recurrent, "vit": _vit, "groupnorm_cnn": _groupnorm_cnn}
    return draw.get(kind, _conv1d_text)(rng)


def policies(knobs: dict) -> tuple[str, ...]:
    """The checkpointing policies a drawn user's model takes: the blocks its layers name
    (block_<n>_...), or none."""
    return ("none", "blocks") if knobs["model"] in ("vit", "groupnorm_cnn") else ("none",)


def is_user(knobs: dict) -> bool:
    return knobs["model"] in USER_MODELS
