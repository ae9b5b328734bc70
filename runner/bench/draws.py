"""Jobs drawn at random from the whole space a user can configure (issue 29), for the estimate
to be checked on shapes it was never fitted to.

    python -m runner.bench estimate --draws N [--seed S] [overrides...]

A draw picks a model family and its version, its shape, the batch, the precision, a
checkpointing policy that applies, dropout and accum, each uniformly. A draw over the budget
(BUDGET: training FLOPs of one optimizer step, and a rough size of what it holds) is
rejected and drawn again, so that every job runs in seconds here; large shapes belong to the
fixed benchmarks. The budget's sizes are published FLOP counts and rough formulas, used only
to reject draws: they never enter the estimate.
"""

import math
import random
from dataclasses import dataclass

from runner.bench.draws_user import USER_MODELS, is_user, policies, user_model

# Multiply-accumulates of one 224x224 image's forward pass and parameters (millions), as the
# papers and keras.applications' documentation give them, at 1000 classes; a draw's FLOPs
# scale them by its image area (and MobileNet's by alpha^2). Only the budget reads them.
CNN_COST = {
    ("mobilenet", "v2"): (300, 3.5),
    ("mobilenet", "v3_small"): (56, 2.5),
    ("mobilenet", "v3_large"): (217, 5.4),
    ("efficientnet", "B0"): (390, 5.3),
    ("efficientnet", "B1"): (700, 7.9),
    ("efficientnet", "B2"): (1000, 9.2),
    ("efficientnet", "B3"): (1800, 12.3),
    ("efficientnet", "B4"): (4200, 19.5),
    ("efficientnet", "B5"): (9900, 30.6),
    ("efficientnet", "B6"): (19000, 43.3),
    ("efficientnet", "B7"): (37000, 66.7),
    ("efficientnet", "V2B0"): (720, 7.2),
    ("efficientnet", "V2B1"): (1200, 8.2),
    ("efficientnet", "V2B2"): (1700, 10.2),
    ("efficientnet", "V2B3"): (3000, 14.5),
    ("efficientnet", "V2S"): (8400, 21.6),
    ("efficientnet", "V2M"): (24700, 54.4),
    ("efficientnet", "V2L"): (56300, 119.0),
    ("keras_app", "MobileNet"): (569, 4.3),
    ("keras_app", "DenseNet121"): (2900, 8.1),
    ("keras_app", "ResNet50"): (4100, 25.6),
}
MOBILENET_ALPHAS = {"v2": (0.35, 0.5, 0.75, 1.0), "v3_small": (0.75, 1.0), "v3_large": (0.75, 1.0)}
PRECISIONS = ("fp32", "bf16", "mixed")
POLICIES = ("none", "blocks", "sqrt", "every", "selective")
# selective recomputes attention cores, or the cheap layers between a depthwise convolution's
# normalizations (runner/techniques/checkpointing.py): these have neither, and refuse it.
NO_SELECTIVE = {"DenseNet121", "ResNet50"}
ACCUMS = (1, 2, 4)
STEPS = 3
# float16 is emulated on a CPU: without XLA (the CNNs) a MobileNetV2 step ran 25x slower under
# precision=mixed than under fp32 with oneDNN's kernels (2x with TensorFlow's own, on a CPU
# without AVX512); its FLOPs count the slower CPU's factor, so a draw fits either.
MIXED_CNN_SLOWDOWN = 25


@dataclass(frozen=True)
class Budget:
    """A draw's ceiling: GFLOPs of one optimizer step (forward and backward, all micro-batches)
    and MiB of what it holds (weights with Adam's slots, and activations, roughly)."""

    gflops: float
    mib: float


BUDGET = Budget(gflops=4.0, mib=600.0)  # python -m runner.bench estimate --draws
SMALL = Budget(gflops=1.0, mib=150.0)  # the suite's randomized test


def _transformer(rng: random.Random) -> tuple[dict, float, float, float]:
    """(overrides, GFLOPs and MiB held per example, MiB of weights and Adam's slots) of a
    transformer drawn at random."""
    heads = rng.randint(1, 16)
    h = heads * rng.randint(max(1, math.ceil(32 / heads)), 512 // heads)
    layers, s, vocab = rng.randint(1, 16), rng.randint(16, 1024), rng.randint(16, 4096)
    attention = rng.choice(("standard", "chunked"))
    knobs = {
        "model": "transformer", "model.h": h, "model.layers": layers, "model.heads": heads,
        "data.seq_len": s, "data.vocab_size": vocab, "model.attention": attention,
        "model.dropout": rng.choice((0.0, 0.1)),
    }  # fmt: skip
    if attention == "chunked":
        knobs["model.attention_block"] = rng.choice((16, 32, 64, 128, 256))
    per_token = 24 * layers * h * h + 4 * layers * s * h + 2 * h * vocab
    gflops = 3 * per_token * s / 1e9
    params = layers * 12 * h * h + 2 * vocab * h
    # Korthikanti's 16sbh + 5as^2b per layer (float32, per example), and the logits' gradients.
    held = layers * (16 * s * h + 5 * heads * s * s) * 4 + 2 * s * vocab * 4
    return knobs, gflops, held / 2**20, params * 16 / 2**20


def _cnn(rng: random.Random, family: str) -> tuple[dict, float, float, float]:
    """As _transformer, for a CNN of `family`: its version, width and image size."""
    version = rng.choice([v for f, v in CNN_COST if f == family])
    macs, params = CNN_COST[family, version]
    size = rng.randint(32, 224)
    knobs = {"model": family, "data": "synthetic", "data.image_size": size}
    if family == "mobilenet":
        alpha = rng.choice(MOBILENET_ALPHAS[version])
        knobs |= {"model.version": version, "model.alpha": alpha}
        macs, params = macs * alpha**2, params * alpha**2
    else:
        knobs["model.variant" if family == "efficientnet" else "model.name"] = version
    area = (size / 224) ** 2
    gflops = 3 * 2 * macs * 1e6 * area / 1e9
    # Held per example: not known before the model is built; the FLOPs bound it.
    return knobs, gflops, 0.0, params * 1e6 * 16 / 2**20


def draw(rng: random.Random, budget: Budget = BUDGET) -> dict:
    """One job's overrides: a family (each equally often), then its shape and batch, drawn
    again until they fit the budget."""
    family = rng.choice(("transformer", "mobilenet", "efficientnet", "keras_app", "user"))
    kind = rng.choice(USER_MODELS) if family == "user" else None  # drawn once, then its sizes
    shape = {"transformer": _transformer, "user": lambda r: user_model(r, kind)}
    while True:
        knobs, gflops, held, fixed = shape.get(family, lambda r: _cnn(r, family))(rng)
        b, accum, precision = rng.randint(1, 64), rng.choice(ACCUMS), rng.choice(PRECISIONS)
        if family != "transformer" and precision == "mixed":
            gflops *= MIXED_CNN_SLOWDOWN
        if gflops * b * accum > budget.gflops or fixed + held * b > budget.mib:
            continue
        policy = rng.choice(policies(knobs) if is_user(knobs) else POLICIES)
        while policy == "selective" and knobs.get("model.name") in NO_SELECTIVE:
            policy = rng.choice(POLICIES)  # drawn again: a draw is a job that runs
        return knobs | {
            "data.batch_size": b, "accum": accum, "precision": precision,
            "checkpointing": policy,
        }  # fmt: skip


def draws(n: int, seed: int, budget: Budget = BUDGET) -> list[dict]:
    """n jobs drawn from `seed`: the same seed gives the same jobs."""
    rng = random.Random(seed)
    return [draw(rng, budget) for _ in range(n)]


def overrides(knobs: dict) -> list[str]:
    """A draw as the command line's overrides, with the data and steps it runs on."""
    per_step = knobs["data.batch_size"] * knobs["accum"]
    return [
        *(f"{k}={v}" for k, v in knobs.items()),
        f"data.train_samples={per_step * STEPS}",
        f"data.val_samples={knobs['data.batch_size']}",
        f"trainer.max_steps={STEPS}",
        "trainer.save_model=false",
    ]


SHORT = {
    "model.h": "h", "model.layers": "L", "model.heads": "a", "data.seq_len": "s",
    "data.vocab_size": "V", "model.attention_block": "block", "model.dropout": "drop",
    "data.image_size": "px", "data.batch_size": "b", "accum": "accum", "model.cell": "cell",
    "model.units": "U", "model.depth": "depth", "model.embed": "embed", "model.width": "w",
    "model.patch": "patch", "model.filters": "filters", "model.groups": "groups",
    "model.bidirectional": "bi",
}  # fmt: skip


def describe(knobs: dict) -> str:
    """A draw in one short line: family and version, then its shape and techniques."""
    name = [knobs["model"]]
    name += [str(knobs[k]) for k in ("model.version", "model.variant", "model.name") if k in knobs]
    if "model.alpha" in knobs:
        name.append(f"x{knobs['model.alpha']}")
    if knobs["model"] == "transformer":
        name.append(knobs["model.attention"])
    shape = [f"{SHORT[k]}={v}" for k, v in knobs.items() if k in SHORT]
    return " ".join(name + shape + [knobs["precision"], knobs["checkpointing"]])


def verdict(result: dict | None, band: tuple[float, float]) -> tuple[float | None, str]:
    """(measured / estimate, its verdict): ok, MISSED, a note when not modelled, or the error."""
    if result is None or "error" in result:
        return None, f"error: {result.get('error') if result else 'none'}"
    ratio = result.get("mem/measured_over_estimate")
    if ratio is None:
        return None, "not modelled"
    if band[0] <= ratio <= band[1]:
        return ratio, "ok"
    # Part of the estimate a bound (recurrent layers' products run ahead): a peak between the
    # estimate without it and the whole, each with the band's margin, is what it says.
    bound, estimate = result.get("mem/estimate_bound_bytes", 0), result["mem/estimate_bytes"]
    least = band[0] * (estimate - bound) / estimate
    return ratio, "ok (in its bound)" if bound and least <= ratio <= band[1] else "MISSED"


def distribution(ratios: list[float], band: tuple[float, float]) -> str:
    """Worst, median and the share within the band of the ratios measured."""
    if not ratios:
        return "no draw was estimated"
    ordered = sorted(ratios)
    worst = max(ordered, key=lambda r: abs(math.log(r)))
    median = (
        ordered[len(ordered) // 2]
        if len(ordered) % 2
        else ((ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2)
    )
    inside = sum(band[0] <= r <= band[1] for r in ratios)
    return (
        f"measured/estimate over {len(ratios)} estimated draws: worst {worst:.3f}, median "
        f"{median:.3f}, range {ordered[0]:.3f}-{ordered[-1]:.3f}, within {band[0]}-{band[1]}: "
        f"{inside}/{len(ratios)} ({100 * inside / len(ratios):.0f}%)"
    )
