"""Benchmarks that print figures measured side by side in one process.

    python -m runner.bench overhead     # runner loop vs plain model.fit, same model and data
    python -m runner.bench memory       # peak vs batch size and width, measured vs estimate
    python -m runner.bench gpu_check    # transformer fp32 vs mixed on a GPU

Targets are checked here, by ratios of figures measured in the same run, not by timed unit
tests. Extra Hydra overrides after the name apply to every job of the benchmark.
"""

import statistics
import sys
import tempfile
import time

from omegaconf import DictConfig

# Moderate transformer: big enough that per-step overheads would show, small enough for 2 cores.
OVERHEAD_MODEL = [
    "model.h=256",
    "model.layers=4",
    "data.seq_len=128",
    "data.batch_size=16",
    "data.vocab_size=256",
    "trainer.progress=false",
]


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    from runner.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain fixed-width table of rows (dicts) for the terminal."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _timed_rounds(fn, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def overhead(extra: list[str], steps: int = 20, rounds: int = 5) -> float:
    """Runner loop vs model.fit on the same model, data and XLA setting, alternating rounds."""
    import keras

    from runner.data import build_data
    from runner.loop import train
    from runner.step import build_optimizer, make_train_step, resolve_jit
    from runner.telemetry import Memory
    from runner.tracking import Tracker, client_for
    from runner.train import build_model

    cfg = _compose(OVERHEAD_MODEL + extra)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu=False)
    keras.utils.set_random_seed(0)
    data = build_data(cfg, image_model=False)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours, theirs = build_model(cfg, data.spec), build_model(cfg, data.spec)
    theirs.set_weights(ours.get_weights())
    optimizer = build_optimizer(cfg)
    optimizer.build(ours.trainable_variables)
    step = make_train_step(ours, optimizer, loss_fn, 1, jit)
    theirs.compile(optimizer=build_optimizer(cfg), loss=loss_fn, jit_compile=jit)
    fit_data = data.train.map(lambda xs, ys: (xs[0], ys[0]))  # drop the accum axis (accum=1)
    with tempfile.TemporaryDirectory() as tmp:  # the runner logs every step, as in a real run
        client = client_for(f"sqlite:///{tmp}/mlflow.db")
        tracker = Tracker(client, client.create_run(client.create_experiment("bench")).info.run_id)
        mem = Memory("/CPU:0")

        def runner_round():
            train(step, lambda: {}, data, steps, tracker, 0, False, mem)
            tracker.flush()

        def fit_round():
            theirs.fit(fit_data, steps_per_epoch=steps, epochs=1, verbose=0)

        runner_round(), fit_round()  # trace and compile both before timing
        runner_times, fit_times = [], []
        for _ in range(rounds):
            runner_times += _timed_rounds(runner_round, 1)
            fit_times += _timed_rounds(fit_round, 1)
    ours_s, fit_s = statistics.median(runner_times) / steps, statistics.median(fit_times) / steps
    ratio = ours_s / fit_s
    print(
        f"overhead: transformer h=256 x4 layers, batch 16 x 128 tokens, XLA={jit}, "
        f"{rounds} alternating rounds of {steps} steps"
    )
    print(
        table(
            [
                {"path": "runner loop", "step_s_median": ours_s},
                {"path": "model.fit", "step_s_median": fit_s},
            ],
            ["path", "step_s_median"],
        )
    )
    print(f"runner / model.fit step time = {ratio:.3f} (target <= 1.03)")
    return ratio


def _run_jobs(jobs: dict[str, list[str]], extra: list[str], store: str) -> dict[str, dict]:
    from runner.train import run

    results = {}
    for name, overrides in jobs.items():
        cfg = _compose(
            overrides
            + extra
            + [
                f"mlflow.tracking_uri={store}",
                "mlflow.experiment=bench",
                "trainer.progress=false",
                f"mlflow.run_name='{name}'",
            ]
        )
        results[name] = run(cfg)
    return results


MEMORY_JOBS = {
    f"{p} b={b} h={h}": [
        f"precision={p}",
        f"data.batch_size={b}",
        f"model.h={h}",
        "model.layers=4",
        "data.seq_len=128",
        "trainer.max_steps=8",
    ]
    for p in ("fp32", "bf16")
    for b, h in ((8, 128), (32, 128), (8, 256))
}


def memory(extra: list[str]) -> dict[str, dict]:
    """Peak vs batch size and width (transformer), and measured / estimate, per precision."""
    with tempfile.TemporaryDirectory() as tmp:
        results = _run_jobs(MEMORY_JOBS, extra, f"sqlite:///{tmp}/mlflow.db")
    rows = [
        {
            "job": name,
            "peak_MiB": r["mem/peak_bytes"] / 2**20,
            "estimate_MiB": r["mem/estimate_bytes"] / 2**20,
            "measured/estimate": r["mem/measured_over_estimate"],
            "step_s": r["speed/step_time_s_p50"],
        }
        for name, r in results.items()
    ]
    print(table(rows, ["job", "peak_MiB", "estimate_MiB", "measured/estimate", "step_s"]))
    for p in ("fp32", "bf16"):
        peak = {
            k: results[f"{p} {k}"]["mem/peak_bytes"]
            for k in ("b=8 h=128", "b=32 h=128", "b=8 h=256")
        }
        print(
            f"{p}: peak(batch 32) / peak(batch 8) = {peak['b=32 h=128'] / peak['b=8 h=128']:.2f}"
            f" (target > 2); peak(h=256) / peak(h=128) = "
            f"{peak['b=8 h=256'] / peak['b=8 h=128']:.2f} (target > 1)"
        )
    return results


def gpu_check(extra: list[str]) -> dict[str, dict]:
    """Transformer fp32 vs mixed (float16) on a GPU, side by side."""
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("error: gpu_check needs a GPU; this machine has none")
    size = [
        "model.h=1024",
        "model.layers=8",
        "model.heads=16",
        "data.seq_len=512",
        "data.batch_size=16",
        "data.vocab_size=1024",
        "trainer.max_steps=30",
        "trainer.device=gpu",
    ]
    jobs = {p: [f"precision={p}", *size] for p in ("fp32", "mixed", "bf16")}
    with tempfile.TemporaryDirectory() as tmp:
        results = _run_jobs(jobs, extra, f"sqlite:///{tmp}/mlflow.db")
    keys = [
        "mem/peak_bytes",
        "mem/estimate_bytes",
        "mem/measured_over_estimate",
        "speed/step_time_s_p50",
        "speed/tokens_per_s",
        "speed/mfu",
    ]
    print(
        table(
            [{"precision": p, **{k: r[k] for k in keys}} for p, r in results.items()],
            ["precision", *keys],
        )
    )
    base = results["fp32"]
    for p in ("mixed", "bf16"):
        print(
            f"{p} / fp32: peak {results[p]['mem/peak_bytes'] / base['mem/peak_bytes']:.2f} "
            f"(target <= 0.75), step time "
            f"{results[p]['speed/step_time_s_p50'] / base['speed/step_time_s_p50']:.2f}"
        )
    return results


BENCHES = {"overhead": overhead, "memory": memory, "gpu_check": gpu_check}


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in BENCHES:
        raise SystemExit(f"usage: python -m runner.bench {{{','.join(BENCHES)}}} [overrides...]")
    BENCHES[argv[0]](argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
