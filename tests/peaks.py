"""The allocator's peak of one training step, for the tests that hold the backward walk's rules
against it (test_conv_scratch, test_kernel_copies), and of any computation (least_peak:
test_chunked_attention). Import it after TF_CPU_ALLOCATOR_USE_BFC is set: the CPU's peak needs
the BFC allocator.

least_peak reads the allocator's own peak, in the chunks it handed out; requested_peak reads
the bytes the step's operations asked for, off the profiler's trace of one call. A chunk can be
up to twice its request (BFC splits a free chunk only when it is at least twice the request), so
where a test holds a rule about which tensors are alive, not the allocator's share, it reads
requested bytes: the same step read 0.79-1.07 of the walk in chunks and one figure in requests."""

import glob
import tempfile

import keras
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from runner.techniques import accumulation


def grow_pool(mib: int = 256) -> None:
    """Grow the allocator's pool with one allocate-and-free, as the runner does before a job
    (runner/measure/telemetry.py Memory.grow_pool): a request that grows it is otherwise served
    from a whole new region (23 MiB asked, 32 MiB in use)."""
    pool = tf.zeros((mib * 2**20 // 4,))
    del pool


def dense_stack(hidden: int, width: int, inputs: int) -> keras.Model:
    """`hidden` ReLU Dense layers of `width` on `inputs` features, then a 10-class head: a model
    whose kernels, not its activations, are what a step holds at batch 1."""
    x = keras.Input((inputs,))
    h = x
    for _ in range(hidden):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(10)(h))


def step_peak(model, x, y, optimizer=None, peak=None) -> int:
    """Bytes the allocator holds above its resting state during a step (the least of 3, after a
    warm-up). Without an optimizer each gradient is consumed as it comes (none is held); with
    one, every gradient is checked, as runner/techniques/accumulation.py's update does, then
    applied. `peak` reads the step (least_peak unless given)."""
    variables = model.trainable_variables
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if optimizer is not None:
        optimizer.build(variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        if optimizer is None:  # each gradient consumed at once: none is held
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        # as runner/techniques/accumulation.py's update: the check reads every gradient
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        optimizer.apply(grads, variables)
        return loss + tf.cast(finite, loss.dtype) * 0

    return (peak or least_peak)(lambda: step(x, y).numpy())


def accumulating_calls(model, x, y, optimizer):
    """(micro-batch call, update call) of accumulation.py's step at accum=2, each a function
    that runs its compiled call and waits for it, taken from the step's closure after a warm-up
    step."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer.build(model.trainable_variables)
    step = accumulation.make_train_step(model, optimizer, loss_fn, 2, False)
    step(iter([(x, y)] * 2))
    cells = [c.cell_contents for c in step.__closure__]
    calls = dict(zip(step.__code__.co_freevars, cells, strict=True))
    return (
        lambda: calls["add_micro_batch"](x, y, calls["firsts"][1]).numpy(),
        lambda: calls["apply_sum"]([tf.constant(0.0)] * 2)[0].numpy(),
    )


def accumulating_peaks(model, x, y, optimizer, pick=min, calls_each: int = 3) -> tuple[int, int]:
    """(micro-batch call's peak, update call's peak) of accumulation.py's step at accum=2 above
    the allocator's resting state (accumulating_calls), each measured apart (`pick`, the least
    unless given, of `calls_each` calls)."""
    micro, update = accumulating_calls(model, x, y, optimizer)
    return (
        least_peak(micro, pick=pick, calls=calls_each),
        least_peak(update, pick=pick, calls=calls_each),
    )


def least_peak(compute, pick=min, calls: int = 3) -> int:
    """Bytes the allocator holds above its resting state while `compute()` runs (it must wait
    for its result, e.g. read it with .numpy()): the least of `calls` calls (or what `pick`
    picks of them), after a warm-up call."""
    compute()
    peaks = []
    for _ in range(calls):
        tf.config.experimental.reset_memory_stats("CPU:0")
        rest = tf.config.experimental.get_memory_info("CPU:0")["current"]
        compute()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - rest)
    return pick(peaks)


def most_peak(compute) -> int:
    """The most of 6 calls' least_peak figures: for a rule that is a bound on what the executor
    may hold at once. Which independent operations overlap is its timing's choice, and beside
    other work a call can hold less than the bound (a CI run read 0.69 of SGD's products alive,
    where quiet runs read 0.81-1.00); the most of several calls is the bound's measure."""
    return least_peak(compute, pick=max, calls=6)


def requested_peak(compute) -> int:
    """The most bytes that `compute()`'s operations held at once, as requested of the allocator
    (the profiler's memory events of one call, after a warm-up call): what its tensors hold,
    without the chunks' rounding."""
    compute()
    return _traced_peak(compute)


def requested_peaks(compute, calls: int = 6) -> list[int]:
    """Requested bytes above the resting state at the peak of each of `calls` calls, after one
    warm-up call: as the allocator's peak counts it (a buffer made before the call and freed
    in it, such as a variable's old buffer an update replaces, is subtracted when it goes), in
    requests, not chunks. For a rule that bounds what the executor may hold at once, their
    most (which calls reach it is the executor's timing); for one that says what every call
    must hold, their least."""
    compute()
    return [_traced_peak(compute, net=True) for _ in range(calls)]


def _traced_peak(compute, net: bool = False) -> int:
    """The live requested bytes' maximum over one traced call of `compute()`: of the tensors
    the call made, or (net) above what was alive when it started."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        compute()
        tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        with open(path, "rb") as f:
            space = xplane_pb2.XSpace.FromString(f.read())
    events = []  # (time in ps, +1 or -1, address, requested bytes)
    for plane in space.planes:
        kinds = {k: v.name for k, v in plane.event_metadata.items()}
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                sign = {"MemoryAllocation": 1, "MemoryDeallocation": -1}.get(
                    kinds[event.metadata_id]
                )
                if sign:
                    read = {stats[s.metadata_id]: s.int64_value for s in event.stats}
                    when = line.timestamp_ns * 1000 + event.offset_ps
                    events.append((when, sign, read["addr"], read["requested_bytes"]))
    live, now, top = {}, 0, 0
    for _, sign, addr, requested in sorted(events, key=lambda e: e[0]):
        if sign > 0:
            live[addr] = requested
            now += requested
            top = max(top, now)
        else:  # a tensor made before the traced call is counted when it goes only if net
            now -= live.pop(addr, requested if net else 0)
    return top
