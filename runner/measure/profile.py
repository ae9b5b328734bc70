"""`profile.layers=true`: where each step's memory and time go, layer by layer (issue 14).

After the run's timed steps (its own figures are already taken), the job is profiled:
1. its train step, compiled without XLA, is timed over `profile.steps` steps;
2. each row of runner/measure/profile_rows.py (a Keras layer, or a transformer sublayer, and
   the loss) is timed forward+backward *in isolation*, on the inputs it receives from a real
   batch, each in its own tf.function without XLA: without XLA each layer is its own set of
   kernels, and a time per layer is measured rather than modelled. (The alternative, TensorFlow's
   profiler trace attributed by op name, needs the trace's op names to map back onto layers,
   which XLA's fusion and grappler's rewriting blur.) The check: the per-layer times of a
   step (x accum) must add up to 0.7-1.3x the step time of (1); the optimizer's update and
   the framework's overhead are what the layers leave out.
3. each row is classified against the device's ridge point (peak FLOP/s / bandwidth):
   arithmetic intensity below it is memory-bound.
The model's weights, optimizer state and pruning masks are put back afterwards.
"""

import statistics
import time

import keras
import tensorflow as tf

from runner.core.machine import cache_dir
from runner.measure import profile_rows, roofline
from runner.techniques.accumulation import make_train_step

TIMING = "isolation: each layer forward+backward in its own tf.function, no XLA, real inputs"


def _sync() -> None:
    """Wait for queued device work: GPU kernels run asynchronously to Python."""
    if tf.config.list_logical_devices("GPU"):
        tf.test.experimental.sync_devices()


def _median_time(fn, args, repeats: int) -> float:
    fn(*args)  # traces and warms up
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_row(row, inputs: list, output, repeats: int) -> float:
    """Median forward+backward time of one row: gradients for its float inputs and its
    weights, with an upstream gradient of ones made beforehand (not timed)."""
    floats = [t.dtype.is_floating for t in inputs]
    sources_exist = any(floats) or row.variables
    dy = tf.ones_like(output) if output.dtype.is_floating and sources_exist else None

    @tf.function(jit_compile=False)
    def forward_backward(xs, dy):
        with tf.GradientTape() as tape:
            for x, is_float in zip(xs, floats, strict=True):
                if is_float:
                    tape.watch(x)
            y = row.fn(*xs)
        if dy is None:
            return y
        sources = [x for x, f in zip(xs, floats, strict=True) if f] + list(row.variables)
        return tape.gradient(y, sources, output_gradients=dy)

    return _median_time(forward_backward, (list(inputs), dy), repeats)


def _run_rows(model, batch, seq, x, y, repeats: int) -> list[dict]:
    """Each row run once on the real batch (its output feeds the rows after it), described,
    and timed; each tensor is dropped after its last reader."""
    rows = profile_rows.model_rows(model, batch, seq)
    half = keras.mixed_precision.global_policy().compute_dtype != "float32"
    kept = profile_rows.kept_outputs(rows, half)
    last_read = {name: i for i, row in enumerate(rows) for name in row.inputs}
    env = {profile_rows.input_key(model): x, "targets": y}
    table = []
    for i, row in enumerate(rows):
        inputs = [env[name] for name in row.inputs]
        output = tf.convert_to_tensor(row.fn(*inputs))
        described = profile_rows.describe(row, inputs, output, row.name in kept)
        described["time_s"] = _time_row(row, inputs, output, repeats)
        table.append(described)
        env[row.output] = output
        for name in row.inputs:
            if last_read[name] == i:
                env.pop(name, None)
    return table


def _step_time(model, optimizer, data, accum: int, steps: int, after_update) -> float:
    """Median time of the job's own train step compiled without XLA, on batches fetched
    beforehand (no input wait), after one warm-up step."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(model, optimizer, loss_fn, accum, False, after_update)
    it = iter(data.train)
    fetched = [[next(it) for _ in range(accum)] for _ in range(steps + 1)]
    times = []
    for i, micro_batches in enumerate(fetched):
        start = time.perf_counter()
        loss, _ = step(iter(micro_batches))
        float(loss)  # reading the loss back waits for the step
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _finish(table: list[dict], step_s: float, accum: int, ridge: float) -> dict:
    """The derived columns, in place, and the profile's figures."""
    totals = {k: sum(r[k] for r in table) for k in ("time_s", "forward_flops", "activation_bytes")}
    for r in table:
        r["bound"] = "memory" if r["intensity"] < ridge else "compute"
        r["time_share"] = r["time_s"] * accum / step_s
        r["flops_share"] = r["forward_flops"] / totals["forward_flops"]
        r["activation_share"] = r["activation_bytes"] / max(totals["activation_bytes"], 1)
        # Training FLOPs taken as 3x forward, the convention of the run's MFU.
        r["achieved_flops"] = 3 * r["forward_flops"] / r["time_s"]
    memory = [r for r in table if r["bound"] == "memory"]
    return {
        "layers/memory_bound_time_frac": sum(r["time_s"] for r in memory) / totals["time_s"],
        "layers/memory_bound_flops_frac": sum(r["forward_flops"] for r in memory)
        / totals["forward_flops"],
        "layers/memory_bound_activation_frac": sum(r["activation_bytes"] for r in memory)
        / max(totals["activation_bytes"], 1),
        "layers/activation_bytes": totals["activation_bytes"],
        "layers/sum_time_s": totals["time_s"] * accum,
        "layers/step_time_noxla_s": step_s,
        "layers/sum_over_step_time": totals["time_s"] * accum / step_s,
        "layers/rows": len(table),
    }


def profile_layers(cfg, built, model, optimizer, data, pruner, device_name: str):
    """Profile the job (module docstring): (figures, tags, the rows, the roofline's figures);
    runner/report/layer_report.py writes them out.

    built: the model as built (its layers are the rows); model: as trained (checkpointing's
    wrapper around built, or built itself), whose step is timed.
    """
    state = [*model.weights, *optimizer.variables, *_masks(pruner)]
    saved = [v.numpy() for v in state]
    after_update = pruner.after_update if pruner else None
    try:
        step_s = _step_time(model, optimizer, data, cfg.accum, cfg.profile.steps, after_update)
        x, y = next(iter(data.train))
        seq = data.spec.seq_len if data.spec.kind == "tokens" else None
        table = _run_rows(built, cfg.data.batch_size, seq, x, y, cfg.profile.repeats)
    finally:
        for v, value in zip(state, saved, strict=True):
            v.assign(value)
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    # A layer faster than the cached CPU peak makes it calibrate again, as a run's MFU does: a
    # calibration taken on a busy machine (right after training, say) is too low.
    achieved = max(3 * r["forward_flops"] / r["time_s"] for r in table)
    roof = roofline.ridge_point(device_name, cfg.precision.policy, cache_dir(), tf32, achieved)
    figures = _finish(table, step_s, cfg.accum, roof["ridge"])
    figures.update(
        {
            "layers/ridge_flops_per_byte": roof["ridge"],
            "layers/bandwidth_bytes_per_s": roof["bandwidth"],
            "layers/peak_flops": roof["peak_flops"],
        }
    )
    top = max(table, key=lambda r: r["activation_bytes"])
    tags = {
        "layers/top_activation": top["name"],
        "layers/timing": TIMING,
        "layers/bandwidth_source": roof["bandwidth_source"],
        "layers/peak_source": roof["peak_source"],
    }
    return figures, tags, table, roof


def _masks(pruner) -> list:
    return list(pruner.masks) if pruner else []
