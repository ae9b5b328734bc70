"""The runner's own loop vs plain model.fit: same model, data and XLA setting, one process."""

import statistics
import tempfile
import time

from runner.config import compose_config
from runner.core.text import table

# Moderate transformer: big enough that per-step overheads would show, small enough for 2 cores.
OVERHEAD_MODEL = [
    "model.h=256",
    "model.layers=4",
    "data.seq_len=128",
    "data.batch_size=16",
    "data.vocab_size=256",
    "trainer.progress=false",
]


def _timed_rounds(fn, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main(extra: list[str], steps: int = 20, rounds: int = 12) -> float:
    """Runner loop vs model.fit on the same model, data and XLA setting, alternating rounds.

    On the 2-core machine whole rounds of either path were seen running ~1.7x slower (0.52
    against 0.30 s per step) in episodes that come from outside the process: with 5 rounds
    the ratio of medians ranged 0.65 to 1.68 between runs of the same code, and with 12 rounds
    up to 8 of a path's rounds were slow. Interference only adds time, so the target is
    checked on each path's fastest round (as timeit advises); the medians and the number of
    slow rounds are printed beside it.
    """
    import keras

    from runner.measure.telemetry import Memory
    from runner.techniques.accumulation import make_train_step
    from runner.track.client import client_for
    from runner.track.tracker import Tracker
    from runner.train.data import build_data
    from runner.train.job import build_model
    from runner.train.loop import Steps, train
    from runner.train.optimizer import build_optimizer, resolve_jit

    cfg = compose_config(OVERHEAD_MODEL + extra)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu=False)
    keras.utils.set_random_seed(0)
    data = build_data(cfg, image_model=False)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours, theirs = build_model(cfg.model, data.spec), build_model(cfg.model, data.spec)
    theirs.set_weights(ours.get_weights())
    optimizer = build_optimizer(cfg.trainer)
    optimizer.build(ours.trainable_variables)
    step = make_train_step(ours, optimizer, loss_fn, 1, jit)
    theirs.compile(optimizer=build_optimizer(cfg.trainer), loss=loss_fn, jit_compile=jit)
    with tempfile.TemporaryDirectory() as tmp:  # the runner logs every step, as in a real run
        client = client_for(f"sqlite:///{tmp}/mlflow.db")
        tracker = Tracker(client, client.create_run(client.create_experiment("bench")).info.run_id)
        mem = Memory("/CPU:0")

        def runner_round():
            train(Steps(step, dict, iter(data.train), steps, progress=False), tracker, mem)
            tracker.flush()

        def fit_round():
            theirs.fit(data.train, steps_per_epoch=steps, epochs=1, verbose=0)

        runner_round(), fit_round()  # trace and compile both before timing
        runner_times, fit_times = [], []
        for _ in range(rounds):
            runner_times += _timed_rounds(runner_round, 1)
            fit_times += _timed_rounds(fit_round, 1)
    paths = {"runner loop": runner_times, "model.fit": fit_times}
    fastest = {path: min(times) / steps for path, times in paths.items()}
    median = {path: statistics.median(times) / steps for path, times in paths.items()}
    ratio = fastest["runner loop"] / fastest["model.fit"]
    median_ratio = median["runner loop"] / median["model.fit"]
    print(
        f"overhead: transformer h=256 x4 layers, batch 16 x 128 tokens, XLA={jit}, "
        f"{rounds} alternating rounds of {steps} steps"
    )
    print(
        table(
            [
                {"path": p, "step_s_fastest_round": fastest[p], "step_s_median": median[p]}
                for p in paths
            ],
            ["path", "step_s_fastest_round", "step_s_median"],
        )
    )
    for path, times in paths.items():
        slow = sum(t > 1.3 * min(times) for t in times)
        print(f"{path}: {slow} of {rounds} rounds over 1.3x its fastest round")
    print(
        f"runner / model.fit step time = {ratio:.3f} on the fastest rounds (target <= 1.03); "
        f"{median_ratio:.3f} on the medians"
    )
    return ratio
