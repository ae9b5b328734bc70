"""How TensorFlow's executor runs a graph model's train step, beyond what each layer keeps: the
weight gradients it consumes as they come, the optimizer's update buffers, the threads that
run them at once, and which CPU convolution kernels (runner/estimate/conv_scratch.py) take
their im2col buffers. The estimate (runner/estimate/memory.py) reads these for the backward
walk (runner/estimate/timeline.py Executor) and for an accumulating step's update call."""

import math
import os

import keras
import tensorflow as tf

from runner.estimate import conv_scratch, timeline

# Float32 buffers of its variable's size an optimizer's update holds beside the gradient, by
# class. Keras's Adam computes (g - m) * (1 - beta_1) and (g^2 - v) * (1 - beta_2) for its
# slots, then m * alpha and sqrt(v) + epsilon for the variable (keras/src/optimizers/adam.py):
# two buffers at a time, each product written over its operand. **Measured** (peak above the
# resting state of a step on a Dense stack whose 16 MiB kernels dominate, batch 1, the
# allocator's pool grown first, this CPU): with one inter-op thread the peak was the gradient
# and 2 such buffers for Adam, 2 for SGD (its g * lr, and a copy of the variable the executor
# makes to update it while a read of it is alive), 3 for AdamW (its decay, var * wd * lr,
# first); with two threads two updates overlapped, fully or in part (Adam 64-96 MiB, SGD
# 48-80, AdamW 96-112): the rule is their bound.
UPDATE_BUFFERS = {"Adam": 2, "SGD": 2, "AdamW": 3}
# Optimizers whose update has two branches that meet (Keras's Adam and AdamW:
# m * alpha / (sqrt(v) + epsilon), keras/src/optimizers/adam.py): whichever of the two float32
# buffers is made first waits for the other, one such buffer an update at most
# (update_call_bytes).
MEETING_BRANCHES = ("Adam", "AdamW")


def momentum_products(optimizer) -> bool:
    """Whether each update computes a float32 product of its variable's size from the
    optimizer's slots alone: Keras's SGD with momentum, m.assign(m * momentum - g * lr)
    (keras/src/optimizers/sgd.py). m * momentum waits for nothing the step computes, so the
    executor runs every variable's when the step (or the update's call) starts, and each
    lives until that variable's gradient reaches its update. **Measured** (the profiler's
    memory events of MobileNetV2's accum=1 step, 32 px, batch 2, 8.5 MiB of weights): with
    SGD the step held 15.7 MiB above its start at its peak, with Adam 12.6; the products
    (`Mul`, one per variable) were alive at SGD's peak. keras ResNet50 (50 px, batch 1):
    SGD's step held 128 MiB above its resting state, Adam's 41, with 90 MiB of weights."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return isinstance(inner, keras.optimizers.SGD) and float(inner.momentum) != 0


def replicated(cfg) -> bool:
    """Whether the step runs under a tf.distribute strategy, whose update waits for the
    all-reduce of every gradient (all_reduce_pack)."""
    return cfg.distribution.strategy != "none"


def float32_sizes(variables) -> list[int]:
    """Each variable's bytes in float32, the largest first: gradients, sums and masks are
    float32 whatever the policy (variables stay float32 under mixed policies)."""
    return sorted((math.prod(v.shape) * 4 for v in variables), reverse=True)


def float32_bytes(variables) -> int:
    """All of `variables` in float32 (float32_sizes)."""
    return sum(float32_sizes(variables))


# Under a strategy Keras all-reduces the whole list of gradients in one call, and
# TensorFlow's collective all-reduce first concatenates them into one tensor: **measured**
# (the profiler's memory events of MobileNetV2's accum=1 step on 2 logical CPUs, 8.5 MiB of
# weights): at the step's peak each replica's gradients and their concatenation (8.53 MiB
# each) were alive, beside the collective's temporary chunk (4.27 MiB), and no update had
# run. The estimate counts each replica's gradients and one pack; a GPU's NCCL all-reduce
# packs them too (tf.distribute's NcclAllReduce, num_packs=1), unconfirmed here.
def all_reduce_pack(trainable) -> int:
    """Float32 bytes of the all-reduce's pack of every gradient."""
    return float32_bytes(trainable)


def executor(optimizer, cfg, cpu_xla: bool, gradients: int = 0) -> timeline.Executor:
    """How the executor runs a graph model's step (timeline.Executor). In an accum=1 step,
    weight gradients are applied as they come by as many updates at once as it has inter-op
    threads, each holding its gradient and its update's buffers (UPDATE_BUFFERS). In a
    micro-batch of an accumulating step each gradient is added in place into its float32 sum
    as it comes (runner/techniques/accumulation.py: one assign_add, no buffer of its own) and
    dies there. The add is its gradient's only consumer, so the executor runs it on the thread
    that computed the gradient, right after it (tensorflow/core/common_runtime/executor.cc
    ScheduleReady: a node's single ready successor runs inline): as many gradients at once as
    inter-op threads compute weight gradients, a bound. **Measured** on a stack of two 16 MiB
    kernels, 2 threads, the profiler's requested bytes: 17.5 MiB (one) or 32.0 (both) alone,
    32.0 in every call beside two busy processes (tests/test_conv_scratch.py). A loss-scaled
    accum=1 step waits for every gradient to check it, a step under a strategy for their
    all-reduce (all_reduce_pack): each is held from its backward on, and once the backward
    has ended all of them with their copies, `gradients` (estimate._gradient_bytes:
    Executor.waits_for). Convolutions take conv_scratch's buffers on a CPU without XLA or
    oneDNN."""
    threading = tf.config.threading
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    waits = scaled or replicated(cfg)  # every gradient before any update
    on_cpu = not tf.config.list_logical_devices("GPU")
    if cfg.accum > 1:
        # Under a strategy a replica's gradients are the outputs of its own function
        # (accumulation.make_replicated_step): compiled by XLA, all alive when it returns
        # (measured: 16.05 MiB a replica on a 16 MiB Dense stack); without XLA it is inlined
        # and each is added into its sum as it comes. On a GPU, where the job compiles with
        # XLA unless told not to, all of them (unconfirmed).
        compiled = replicated(cfg) and (cpu_xla or not on_cpu)
        slots, per_byte = 0 if compiled else inter_op_threads(), 1.0
    else:
        slots = 0 if waits else inter_op_threads()
        per_byte = 1 + UPDATE_BUFFERS.get(type(optimizer).__name__, 2)
    conv = on_cpu and not cpu_xla and not conv_scratch.onednn_convolutions(cfg.precision.policy)
    intra = threads(threading.get_intra_op_parallelism_threads()) if conv else 0
    products = ""
    if momentum_products(optimizer) and not cpu_xla and cfg.accum == 1:
        products = "at_the_end" if waits else "as_they_come"
    waits_for = gradients if waits and cfg.accum == 1 else 0
    return timeline.Executor(slots, per_byte, intra, on_cpu and cpu_xla, products, waits_for)


def update_call_bytes(trainable, optimizer, slots: int, replicated: bool = False) -> int:
    """What an accumulating step's update call (accumulation.py's apply_sum: the sums read in
    place, then optimizer.apply) holds above the weights, slots and sums, at most. Every
    update's first operations read only the sums and slots, so all are ready when the call
    starts and TensorFlow's executor hands them all to its inter-op threads' queues at once
    (tensorflow/core/common_runtime/executor.cc ScheduleReady, with no inline queue): a thread
    runs one update's chain (each elementwise step writes over its operand) and may leave its
    other branch queued. So `slots` threads each hold one chain's buffer, the largest
    variables' at worst, and under Adam every variable may hold its update's waiting buffer
    (MEETING_BRANCHES) beside them. Other optimizers: `slots` updates, each holding as many
    buffers as an accum=1 update holds with its gradient (1 + UPDATE_BUFFERS).
    **Measured** (the profiler's requested bytes above the resting state, 2 inter-op threads,
    the most of 6 calls): two 16 MiB kernels (33.6 MiB of weights) 64.0-65.7 MiB alone and
    beside two busy processes, the bound 65.6; fifteen 1 MiB kernels 7-12 MiB (at 11 MiB,
    eleven buffers: nine waiting, two in chains), the bound 17.4, where `slots` updates each
    with its gradient and two buffers count 6 (tests/test_conv_scratch.py); the tests' tiny
    EfficientNetB0 (32 px, batch 4) 10.1-11.6 MiB, the bound 18.3, the old rule 8.9. An
    accum=1 step does not gather them: its updates start one by one as the backward makes
    their gradients (executor). A loss-scaled step first divides every sum by the scale, and
    those float32 quotients are all alive before the update, which frees each as it consumes
    it: the call holds them or the buffers, whichever is more (measured on the two-kernel
    stack in float16: +64-72 MiB, quotients 64). Under a strategy (replicated) the sums are
    all-reduced first: the all-reduce holds their pack (all_reduce_pack) and its result, then
    the updates' buffers run beside the result (measured on 2 logical CPUs, a replica's share
    of the call: 29-37 MiB on a Dense stack of 16 MiB, the rule 34; 128-130 on one of 64
    MiB)."""
    sizes = float32_sizes(trainable)
    name = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
    everything = sum(sizes)
    if name in MEETING_BRANCHES:
        buffers = everything + sum(sizes[:slots])
    else:
        buffers = (1 + UPDATE_BUFFERS.get(name, 2)) * sum(sizes[:slots])
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    quotients = everything if scaled else 0
    # SGD's momentum products, all made when the call starts (momentum_products)
    products = everything if momentum_products(optimizer) else 0
    pack = everything if replicated else 0  # all_reduce_pack
    return products + pack + max(buffers, quotients, pack)


def threads(setting: int) -> int:
    """A TensorFlow thread-pool setting as the threads it runs: 0 means one per core."""
    return setting or os.cpu_count() or 1


def inter_op_threads() -> int:
    """The inter-op threads TensorFlow runs independent ops on."""
    return threads(tf.config.threading.get_inter_op_parallelism_threads())


def choice_bytes(kernels, copies: int, slots: int, cpu_xla: bool) -> int:
    """What a step that chooses new masks (every pruning run has one: its last) holds above the
    weights, slots and masks once its update has run: the choice runs after the update, when the
    step's activations and gradients are gone, and every kernel's choice is independent of the
    others'. Under XLA on a CPU the new masks, and the masked kernels, are all alive until the
    computation returns (two float32 copies of every pruned kernel) and one kernel's choice at a
    time holds its `copies` (the schedule's choice_copies: runner/schedules/). TensorFlow's
    executor runs the choices side by side:
    each holds at least one float32 copy of its kernel from its first op to its mask's assign,
    and `slots` (its inter-op threads) are at work at once, each holding the rest of its copies:
    the bound is one copy of every kernel and `copies` - 1 more of the `slots` largest
    (on six 4 MiB Dense kernels: magnitude 28.0-32.0 MiB, the rule 32; m_by_n 24.0-36.1, the
    rule 40; a step that chooses nothing 20-24). **Measured** (the
    allocator's peak above the resting state of a choice step, Adam, batch 1-2): keras ResNet50
    at 50 px 77.5 MiB (89.5 MiB of masks, the rule 106.5), DenseNet121 at 40 px 21.2 (26.2, the
    rule 28.7), six 16 MiB Dense kernels 112.1 (the rule 128); the profiler's memory events put
    the choices of many kernels alive at once at the peak (53 new masks, 27 kept flags, 4
    top_k's outputs in DenseNet121's)."""
    sizes = float32_sizes(kernels)
    if not sizes:
        return 0
    if cpu_xla:
        return 2 * sum(sizes) + copies * sizes[0]
    return sum(sizes) + (copies - 1) * sum(sizes[:slots])
