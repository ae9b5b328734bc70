"""What pruning and quantization buy where the model runs (issue 49): MobileNetV2 (alpha 1.0,
digits at 64 px) and the default transformer, each trained dense, pruned to 50% and to 80%
(polynomial), and 2:4, each with every deploy variant.

    python -m runner.bench deploy [--rounds N] [--steps S] [overrides...]

Two phases. First each job runs as a user runs it (`deploy=litert`, one measurement round, in
a fresh process), which converts its variants and measures their sizes, accuracy and agreement
with the Keras model. Then every variant of every job is timed side by side: N rounds (5 by
default), round r timing each file once, each in a fresh process (runner/deploy/rounds.py), so
that a latency ratio to the same model's dense float32 LiteRT file is paired by round and
printed with its 95% interval (100 timed calls after 10 at each batch). The timed inputs are
zeros of the model's input shape (latency does not depend on the values; accuracy was
measured on the validation split in the first phase).

Targets: float32 LiteRT agrees with Keras (100%, max logit diff <= 1e-4 of the logits' scale);
MobileNetV2 int8 file <= 0.33x float32, val accuracy within 2 points of the Keras model; the
transformer's dynamic_int8 batch-1 latency <= 0.7x float32; pruned 80%: float32 gzip <= 0.45x
dense float32 gzip, sparse file < dense float32 file, int8 (dynamic_int8 for the token model)
gzip <= 0.2x dense float32 file. Pruned latency is printed with its interval, whatever it is.
"""

import os
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from runner.bench import bench_folder, mib, run_jobs, table
from runner.bench.noise import Ratio, take_rounds, take_steps, verdict
from runner.config.schema import DeployConfig
from runner.core.bootstrap import ratio_interval, within_noise
from runner.core.process import in_fresh_process
from runner.deploy import child, rounds
from runner.deploy.report import xnnpack_sparse

MODELS = {
    "mobilenet": (
        ["model=mobilenet", "model.version=v2", "data=digits", "data.image_size=64"],
        300,
    ),
    "transformer": (["model=transformer"], 120),
}


def _prunings(steps: int) -> dict[str, list[str]]:
    """Dense, polynomial to 50% and 80%, and 2:4: the masks settle by 2/3 of the run, which then
    fine-tunes under them."""
    when = [f"pruning.end_step={2 * steps // 3}", f"pruning.frequency={max(steps // 15, 2)}"]
    poly = ["pruning=polynomial", *when]
    return {
        "dense": ["pruning=none"],
        "pruned50": [*poly, "pruning.target_sparsity=0.5"],
        "pruned80": [*poly, "pruning.target_sparsity=0.8"],
        "2:4": ["pruning=m_by_n", *when],
    }


def _jobs(steps: int | None) -> dict[str, list[str]]:
    """Every model with every pruning, trained `steps` optimizer steps (None: the model's own
    number in MODELS)."""
    common = ["deploy=litert", "deploy.rounds=1", "trainer.save_model=true"]
    common += ["trainer.bn_recalibrate=10"]
    return {
        f"{model} {name}": [*overrides, f"trainer.max_steps={steps or own}", *pruning, *common]
        for model, (overrides, own) in MODELS.items()
        for name, pruning in _prunings(steps or own).items()
    }


def files_of(run_dir: Path) -> dict[str, Path]:
    """The job's variants as files: the SavedModel's folder and each .tflite."""
    folder = run_dir / "deploy"
    files = {"saved_model": folder / "saved_model"} if (folder / "saved_model").is_dir() else {}
    return {**files, **{p.stem: p for p in sorted(folder.glob("*.tflite"))}}


def zeros_input(tflite: Path, batch: int, into: Path) -> Path:
    """Zeros of the model's input shape and dtype, `batch` of them, saved to `into`."""
    from ai_edge_litert.interpreter import Interpreter

    detail = Interpreter(model_path=str(tflite)).get_input_details()[0]
    np.save(into, np.zeros([batch, *detail["shape"][1:]], dtype=detail["dtype"]))
    return into


def time_side_by_side(
    files: dict[tuple, Path], inputs: dict[str, Path], n: int, batch_size: int = 32
) -> dict:
    """Every file timed in `n` rounds, round-robin (runner/deploy/rounds.py), at batch 1 and
    at `batch_size`; per (job, variant), its row (medians and per-round latencies), or why it
    could not be timed."""
    settings = {"threads": len(os.sched_getaffinity(0)), "batch_size": batch_size}
    settings.update(repeats=100, warmup=10)  # sub-millisecond calls: more of them
    # and time, as deploy=litert's defaults: runner/deploy/child.py
    settings.update(warmup_s=DeployConfig.warmup_s, min_time_s=DeployConfig.min_time_s)

    def job(key, path):
        saved = key[1] == "saved_model"
        function = child.measure_saved_model if saved else child.measure_litert
        model = key[0].split()[0]
        return lambda: in_fresh_process(
            function, str(path), str(inputs[model]), settings, tensorflow=saved
        )

    measured = rounds.measure({key: job(key, path) for key, path in files.items()}, n)
    return {k: v if isinstance(v, str) else rounds.combine(v) for k, v in measured.items()}


def latency(rows: dict, key: tuple, base: tuple, figure: str) -> Ratio | None:
    """row `key`'s `figure` over row `base`'s: the ratio of their medians, with its interval
    paired by round; None when either was not timed."""
    row, ref = rows.get(key), rows.get(base)
    if not isinstance(row, dict) or not isinstance(ref, dict):
        return None
    interval = ratio_interval(row["per_round"][figure], ref["per_round"][figure], paired=True)
    return Ratio(row[figure] / ref[figure], interval)


def shown(ratio: Ratio | None) -> str:
    """`0.67x [0.63, 0.70]` (`within noise` when the interval holds 1), or `-`."""
    if ratio is None:
        return "-"
    if ratio.interval is None:
        return f"{ratio.value:.2f}x"
    lo, hi = ratio.interval
    noise = " within noise" if within_noise(ratio.interval) else ""
    return f"{ratio.value:.2f}x [{lo:.2f}, {hi:.2f}]{noise}"


def _table(model: str, timed: dict, figures: dict) -> str:
    base = (f"{model} dense", "float32")
    out = []
    for (job, variant), row in timed.items():
        if not job.startswith(model + " "):
            continue
        m = figures[job]

        def f(key: str, m=m, variant=variant):
            return m.get(f"deploy/{variant}/{key}")

        dense = figures[base[0]]
        out.append({
            "job": job.split(" ", 1)[1],
            "variant": variant,
            "file_MiB": mib(f("file_bytes")),
            "file/dense_f32": f("file_bytes") / dense["deploy/float32/file_bytes"],
            "gzip/dense_f32_gzip": f("file_gzip_bytes") / dense["deploy/float32/file_gzip_bytes"],
            "b1_p50_ms": row["latency_b1_p50_ms"] if isinstance(row, dict) else None,
            "b1/dense_f32": shown(latency(timed, (job, variant), base, "latency_b1_p50_ms")),
            "b32/dense_f32": shown(latency(timed, (job, variant), base, "latency_batch_p50_ms")),
            "RSS_MiB": mib(f("rss_growth_bytes")) if f("rss_growth_bytes") is not None else None,
            "val_acc": f("val_accuracy"),
            "agreement": f("agreement"),
        })  # fmt: skip
    return table(out, list(out[0]))


def _check(ok: bool, text: str) -> str:
    return f"{'ok' if ok else 'MISSED'}: {text}"


def _targets(figures: dict, timed: dict) -> list[str]:
    lines = []
    for model in MODELS:
        m = figures[f"{model} dense"]
        agree = m.get("deploy/float32/agreement")
        diff, scale = m.get("deploy/float32/max_logit_diff"), m.get("deploy/keras/logit_scale")
        if None in (agree, diff, scale):
            lines.append(_check(False, f"{model} float32 LiteRT was not measured"))
            continue
        lines.append(_check(
            agree == 1.0 and diff <= 1e-4 * scale,
            f"{model} float32 LiteRT agreement {agree:.2%}, max |logit diff| {diff:.3g} "
            f"(<= 1e-4 x logits up to {scale:.3g})",
        ))  # fmt: skip
    m = figures["mobilenet dense"]
    int8 = m.get("deploy/int8/file_bytes")
    if int8 is not None and m.get("deploy/int8/val_accuracy") is not None:
        file = int8 / m["deploy/float32/file_bytes"]
        drop = m["deploy/keras/val_accuracy"] - m["deploy/int8/val_accuracy"]
        lines.append(_check(file <= 0.33, f"mobilenet int8 file {file:.3f}x float32 (<= 0.33)"))
        lines.append(_check(
            abs(drop) <= 0.02,
            f"mobilenet int8 val accuracy {m['deploy/int8/val_accuracy']:.4f} vs Keras "
            f"{m['deploy/keras/val_accuracy']:.4f} (within 2 points)",
        ))  # fmt: skip
    base, key = ("transformer dense", "float32"), ("transformer dense", "dynamic_int8")
    ratio = latency(timed, key, base, "latency_b1_p50_ms")
    if ratio is not None:
        lines.append(
            f"{verdict([(ratio, 0.7)])}: transformer dynamic_int8 batch-1 latency "
            f"{shown(ratio)} float32 (<= 0.7x, taken on the "
            "interval's far end)"
        )
    for model, int8 in (("mobilenet", "int8"), ("transformer", "dynamic_int8")):
        d, p = figures[f"{model} dense"], figures[f"{model} pruned80"]
        g = p["deploy/float32/file_gzip_bytes"] / d["deploy/float32/file_gzip_bytes"]
        lines.append(_check(g <= 0.45, f"{model} pruned 80% float32 gzip {g:.3f}x dense (<= 0.45)"))
        sparse = p.get("deploy/sparse/file_bytes")
        if sparse is not None:
            s = sparse / d["deploy/float32/file_bytes"]
            said = f"{model} pruned 80% sparse file {s:.3f}x dense float32 (< 1)"
            lines.append(_check(s < 1, said))
        if p.get(f"deploy/{int8}/file_gzip_bytes") is not None:
            q = p[f"deploy/{int8}/file_gzip_bytes"] / d["deploy/float32/file_bytes"]
            lines.append(_check(
                q <= 0.2, f"{model} pruned 80% + {int8} gzip {q:.3f}x dense float32 file (<= 0.2)"
            ))  # fmt: skip
    return lines


def main(extra: list[str]) -> dict:
    """`python -m runner.bench deploy [--rounds N] [overrides...]`; returns the timed rows."""
    n, extra = take_rounds(extra, 5)
    steps, extra = take_steps(extra, 0)
    with bench_folder() as (tmp, store):
        results = run_jobs(_jobs(steps or None), [f"mlflow.tracking_uri={store}", *extra])
        client = MlflowClient(store)
        figures, files = {}, {}
        for name, result in results.items():
            run = client.get_run(result["run_id"])
            figures[name] = run.data.metrics
            for variant, path in files_of(Path(run.data.tags["run_dir"])).items():
                files[(name, variant)] = path
        inputs = {
            model: zeros_input(files[(f"{model} dense", "float32")], 32, tmp / f"{model}.npy")
            for model in MODELS
        }
        print(f"\ntiming {len(files)} files side by side, {n} rounds", flush=True)
        timed = time_side_by_side(files, inputs, n)
    for model in MODELS:
        print(f"\n{model}: ratios to its dense float32 LiteRT file, latency with the 95% "
              f"interval over {n} rounds (paired by round)")  # fmt: skip
        print(_table(model, timed, figures))
    print("\nTargets:")
    print("\n".join(_targets(figures, timed)))
    print(f"\nwhy pruned latency is what it is: {xnnpack_sparse()}")
    return timed
