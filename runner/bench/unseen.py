"""The estimate against the measured peak on functional models it was never written for
(issue 28): the example U-Net (examples/my_models.py, examples/conf/model/unet.yaml) and
keras.applications ResNet50, DenseNet121 and ConvNeXtTiny (`model=keras_app`), each in
float32 and bfloat16, checkpointing none and blocks: 16 jobs, one fresh process each, as a
user runs them.

    python -m runner.bench estimate --unseen [overrides...]

Synthetic 64x64 images, batch 16, 4 steps (the peak is the steady one, after the first). The
CNNs run without XLA: `trainer.jit_compile=auto` compiles with XLA on a CPU for the
transformer only (runner/train/optimizer.py). Band: 0.85-1.15, as the transformer's.
"""

import itertools
import sys
from pathlib import Path

from runner.bench import mib, run_jobs, table

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELS = {
    "unet": ["model=unet"],
    "resnet50": ["model=keras_app", "model.name=ResNet50"],
    "densenet121": ["model=keras_app", "model.name=DenseNet121"],
    "convnext_tiny": ["model=keras_app", "model.name=ConvNeXtTiny"],
}
SIZES = [
    "data=synthetic",
    "data.image_size=64",
    "data.batch_size=16",
    "data.train_samples=64",
    "data.val_samples=16",
    "trainer.max_steps=4",
    "trainer.save_model=false",
]
PRECISIONS = ("fp32", "bf16")
POLICIES = ("none", "blocks")
CELLS = list(itertools.product(MODELS, PRECISIONS, POLICIES))
BAND = (0.85, 1.15)


def job(cell: tuple[str, str, str]) -> list[str]:
    model, precision, policy = cell
    return [*MODELS[model], *SIZES, f"precision={precision}", f"checkpointing={policy}"]


def main(extra: list[str], cells: list[tuple] = CELLS) -> dict[tuple, dict]:
    """measured / estimate per cell, printed with the band's verdict."""
    if str(EXAMPLES) not in sys.path:  # my_models, as PYTHONPATH=examples gives it a user
        sys.path.append(str(EXAMPLES))  # (a spawned job inherits the import path)
    jobs = {" ".join(cell): job(cell) for cell in cells}
    results = dict(zip(cells, run_jobs(jobs, extra, str(EXAMPLES / "conf")).values(), strict=True))
    low, high = BAND
    rows = []
    for (model, precision, policy), r in results.items():
        ratio = r["mem/measured_over_estimate"]
        rows.append(
            {"model": model, "precision": precision, "checkpointing": policy,
             "peak_MiB": mib(r["mem/peak_bytes"]), "estimate_MiB": mib(r["mem/estimate_bytes"]),
             "activations_MiB": mib(r["mem/estimate/activations_bytes"]),
             "workspace_MiB": mib(r["mem/estimate/workspace_bytes"]),
             "measured/estimate": ratio, "verdict": "ok" if low <= ratio <= high else "MISSED"}
        )  # fmt: skip
    print(table(rows, list(rows[0])))
    ratios = [row["measured/estimate"] for row in rows]
    missed = [row for row in rows if row["verdict"] != "ok"]
    print(
        f"measured/estimate {min(ratios):.3f}-{max(ratios):.3f} over {len(rows)} cells "
        f"(target: every cell in {low}-{high}): "
        + ("ok" if not missed else f"MISSED in {len(missed)}")
    )
    return results
