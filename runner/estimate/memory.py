"""Analytic memory estimate, logged beside the measured peak (FLOPs, MFU: measure/flops.py).

The memory estimate is a model of what training keeps alive at its peak: weights, gradients,
optimizer slots, the accumulation sum, pruning masks and one micro-batch's activations (the
train step, runner/techniques/accumulation.py, runs micro-batches one at a time, so only one
micro-batch's activations live at a time). Its ratio to the measured peak says how much the
framework adds or fuses.
"""

import keras

from models.common import is_graph
from runner.estimate import (
    coverage,
    executor_rules,
    graph_walk,
    resident,
    small_tensors,
    transformer_form,
    xla_fitted,
    xla_plan,
)
from runner.estimate.calibration import ALLOCATOR_WASTE, CPU_XLA_BYTES
from runner.schedules import schedule_of
from runner.techniques import pruning
from runner.techniques.checkpointing import RematInfo

# Bytes of one activation element: the compute dtype of each policy (variables stay float32).
ACTIVATION_BYTES = {"float32": 4, "mixed_float16": 2, "mixed_bfloat16": 2}
CHECKPOINTING = ("none", "blocks", "sqrt", "every", "selective")
NOT_MODELLED = (
    "activations not modelled: a subclassed model's layers cannot be read as a graph, so the "
    "estimate has only params, gradients, optimizer, accumulation and masks (no total)"
)


def not_modelled(cfg, model) -> str | None:
    """Why the estimate has no activations part for this job (None: it has one)."""
    return None if is_graph(model) else NOT_MODELLED


def estimate_note(cfg, model, cpu_xla: bool) -> str | None:
    """What the rules' estimate leaves out of this job, in one line (the run's
    `mem/estimate_note`): a subclassed model's activations (no total), or the layer kinds the
    walk has no rule for (a lower bound) and what recurrent layers may add; None when it
    leaves nothing out. The shipped transformer is its closed form's (transformer_form.py)."""
    if not is_graph(model):
        return NOT_MODELLED
    if not walked(cfg, model):
        return None
    return coverage.note(model, cfg.data.batch_size, _activation_bytes(cfg, cpu_xla))


def bound_bytes(cfg, model, cpu_xla: bool) -> int:
    """How much of the rules' estimate is a bound, not a prediction: the weight-gradient
    products recurrent layers may run ahead of their sum (sequence_rules.recurrent_ahead_bytes),
    which the executor's timing holds in some steps, not all. 0 for anything else."""
    if not walked(cfg, model):
        return 0
    return coverage.unmodelled(model, cfg.data.batch_size, _activation_bytes(cfg, cpu_xla))[1]


def walked(cfg, model) -> bool:
    """Whether the rules' estimate of this job walks its graph (graph_walk.py): a functional
    model's, not the shipped transformer's (its closed form: transformer_form.py)."""
    return is_graph(model) and cfg.model.name != "transformer"


def attention_block(cfg, spec) -> int | None:
    """Keys per block of a chunked attention core (never more than the sequence), or None for
    the standard core (models/chunked_attention.py)."""
    if cfg.model.name != "transformer" or cfg.model.get("attention", "standard") != "chunked":
        return None
    return min(cfg.model.attention_block, spec.seq_len)


def on_gpu(device_name: str) -> bool:
    """Whether runner.train.device.describe's name is a GPU's ("NVIDIA H200", "/GPU:0")."""
    return "GPU" in device_name.upper() or "NVIDIA" in device_name


def is_cpu_xla(jit: bool, device_name: str) -> bool:
    """Whether XLA compiles the steps for a CPU (device_name: runner.train.device.describe's)."""
    return jit and not on_gpu(device_name)


def _activation_bytes(cfg, cpu_xla: bool) -> int:
    """Bytes per activation element: the policy's compute dtype, or what XLA on a CPU keeps."""
    policy = cfg.precision.policy
    if policy not in ACTIVATION_BYTES:
        raise ValueError(f"precision.policy={policy}: expected one of {sorted(ACTIVATION_BYTES)}")
    return CPU_XLA_BYTES[policy] if cpu_xla else ACTIVATION_BYTES[policy]


def _gradient_bytes(trainable, optimizer, cfg, transformer_xla: bool) -> int:
    """Float32 gradients alive at the peak (under XLA: xla_memory's rule). A loss-scaled step
    holds two copies: Keras's LossScaleOptimizer checks the scaled gradients, then divides
    each by the scale (keras/src/optimizers/loss_scale_optimizer.py) and applies the
    quotients, so both are alive before the update. Measured under XLA on a CPU: 1.5-2.0 of
    all gradients (runner/estimate/xla_fitted.py); a transformer drawn at random (1 layer,
    h=144, vocabulary 2101, micro-batch 1, gradients 3.3 MiB) peaked 2.2 MiB above an
    estimate with one copy. An accumulating step (accum > 1) holds one: its micro-batch call
    adds the scaled gradients into the sums, and the quotients are made in the update's own
    call (runner/techniques/accumulation.py apply_sum), where no activation is alive
    (estimate_memory weighs that call: executor_rules.update_call_bytes, xla_memory's). Seed
    988575's draw 1 (h=60, 5 layers, batch 4, accum 4, `mixed`, 1.6 MiB of gradients) peaked
    at the same 13.85 MiB with accum 2 and 4, 0.842 of the estimate with two copies; without
    XLA 0.835, and h=128 at accum 2 0.862 (0.95-0.96 with one).
    Under a tf.distribute strategy the update is outside XLA, and Keras all-reduces every
    gradient in one call before it applies any (keras/src/backend/tensorflow/optimizer.py
    _all_reduce_sum_gradients), packing them into one float32 tensor: all of them and their
    pack (executor_rules.all_reduce_pack)."""
    replicated = executor_rules.replicated(cfg)
    if transformer_xla and not replicated:
        nbytes = xla_fitted.gradient_bytes(trainable, cfg.precision.policy, cfg.accum)
    else:
        nbytes = executor_rules.float32_bytes(trainable)
    copies = 2 if _scaled(optimizer) and cfg.accum == 1 else 1
    pack = executor_rules.all_reduce_pack(trainable) if replicated and cfg.accum == 1 else 0
    return copies * nbytes + pack


def _scaled(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _gradients_alive(trainable, optimizer, cfg, spec, every: int) -> tuple[int, int, int, int]:
    """Float32 weight gradients a transformer's step holds without XLA at the loss, while its
    last layer's backward runs, while its first layer's runs, and when its backward ends
    (transformer_form.activations' moments). A loss-scaled accum=1 step checks every
    gradient before it applies any: none exists at the loss but the head's (counted in the
    head's backward), the head's at the last layer, all but the embedding's at the first, and
    at the end all of them beside their unscaled quotients (_gradient_bytes). In the trace of
    a drawn job (h=39, 3 layers, 3,987 classes, batch 1, `mixed selective`) the step's
    allocations at its peak were the loss moment's, 3.32 MiB, no other gradient alive; the
    estimate had added two copies of every gradient to it (6.4 MiB). Other steps: `every`
    (_gradient_bytes) at each moment, a bound (their updates and sums are not traced here)."""
    if not _scaled(optimizer) or cfg.accum > 1:
        return every, every, every, every
    all_of_them = executor_rules.float32_bytes(trainable)
    head = (cfg.model.h + 1) * spec.num_classes * 4
    embedding = spec.vocab_size * cfg.model.h * 4
    return 0, head, all_of_them - embedding, 2 * all_of_them


def input_shapes(model) -> list[tuple]:
    """An example's shape of each of a graph model's inputs."""
    return [tuple(t.shape[1:]) for t in model.inputs]


# Each model of a step's own memory returns the same parts: the tensors kept for backward at
# the peak (with the input micro-batches), what the running operation holds, and the weight
# gradients alive then. The total is their sum beside the variables (estimate_memory).
STEP_PARTS = ("gradients", "activations", "workspace")


def _walked(model, optimizer, cfg, spec, p: int, cpu_xla: bool, remat, on_gpu: bool) -> dict:
    """A functional model's step, from the backward walk (runner/estimate/graph_walk.py): the
    tensors the backward pass still keeps at its peak, by the layer rules, with the input
    micro-batches the pipeline holds; what the running operation's backward and the gradients
    waiting at skip connections hold (with a convolution's buffers); and the weight gradients
    alive then: those in flight where the executor applies them as they come (their updates'
    buffers), else every gradient beside the slot products (timeline.Executor)."""
    every = _gradient_bytes(model.trainable_variables, optimizer, cfg, False)
    executor = executor_rules.executor(optimizer, cfg, cpu_xla, every)
    b = cfg.data.batch_size
    kept, workspace, in_flight = graph_walk.walk_step(model, b, p, remat, executor)
    kept += resident.inputs_bytes(input_shapes(model), b, on_gpu)
    waits = executor.slots or executor.waits_for
    return {"gradients": in_flight if waits else every + in_flight, "activations": kept,
            "workspace": workspace}  # fmt: skip


def _transformer_formed(model, optimizer, cfg, spec, p: int) -> dict:
    """The shipped transformer's step without XLA: its closed form (transformer_form.py), at
    its widths as built (pruning=structured narrows them)."""
    every = _gradient_bytes(model.trainable_variables, optimizer, cfg, False)
    alive = _gradients_alive(model.trainable_variables, optimizer, cfg, spec, every)
    widths, block = transformer_form.widths(cfg.model, model), attention_block(cfg, spec)
    kept, workspace, gradients = transformer_form.activations(cfg, spec, p, block, alive, widths)
    return {"gradients": gradients, "activations": kept, "workspace": workspace}


def _transformer_fitted(model, optimizer, cfg, spec, p: int) -> dict:
    """The shipped transformer's step under XLA on a CPU where XLA's own plan is not read:
    constants fitted to XLA's plans (xla_fitted.py)."""
    gradients = _gradient_bytes(model.trainable_variables, optimizer, cfg, True)
    kept, workspace = xla_fitted.transformer_activations(cfg, spec, p, attention_block(cfg, spec))
    return {"gradients": gradients, "activations": kept, "workspace": workspace}


def _update_call(model, optimizer, cfg, cpu_xla: bool, on_gpu: bool) -> dict:
    """An accumulating step's update, in a call of its own (runner/techniques/accumulation.py
    apply_sum), beside the input micro-batches the pipeline holds and no activation."""
    trainable, replicated = model.trainable_variables, executor_rules.replicated(cfg)
    if cpu_xla and cfg.model.name == "transformer" and not replicated:  # a strategy's is not XLA's
        sums = executor_rules.float32_bytes(trainable)
        update = xla_fitted.update_call_bytes(sums, _scaled(optimizer))
    else:
        threads = executor_rules.inter_op_threads()
        update = executor_rules.update_call_bytes(trainable, optimizer, threads, replicated)
    inputs = resident.inputs_bytes(input_shapes(model), cfg.data.batch_size, on_gpu)
    return {"gradients": update, "activations": inputs, "workspace": 0}


def step_parts(model, optimizer, cfg, spec, cpu_xla: bool, remat, on_gpu: bool) -> dict | None:
    """The step's own parts by the model that has it (STEP_PARTS), the larger of an
    accumulating step's two calls; None for a subclassed model (not modelled)."""
    if not_modelled(cfg, model):
        return None
    p = _activation_bytes(cfg, cpu_xla)
    if cpu_xla and cfg.model.name == "transformer":
        step = _transformer_fitted(model, optimizer, cfg, spec, p)
    elif cfg.model.name == "transformer":
        step = _transformer_formed(model, optimizer, cfg, spec, p)
    else:
        step = _walked(model, optimizer, cfg, spec, p, cpu_xla, remat or RematInfo(), on_gpu)
    if cfg.accum > 1:  # the update's own call, if it holds more
        update = _update_call(model, optimizer, cfg, cpu_xla, on_gpu)
        if sum(update.values()) > sum(step.values()):
            step = update
    return step


def estimate_memory(
    model,
    optimizer,
    cfg,
    spec,
    cpu_xla: bool = False,
    remat: RematInfo | None = None,
    on_gpu: bool = False,
    planned: xla_plan.Planned | None = None,
) -> dict[str, int]:
    """Bytes of each part training keeps at its peak, and their sum under "total": the
    variables and what the data keeps (held), the step's own parts (XLA's plan of it, else
    step_parts), the allocator's rounding of a step without XLA, and what a step choosing
    pruning's masks holds beyond that. For a subclassed model without XLA the step's
    activations are not modelled: "total" is None (`not_modelled` says why).

    model: the model before checkpointing wrapped it; remat: what checkpointing.apply did.
    cpu_xla: the run is compiled by XLA for a CPU (16-bit activations cost more there).
    on_gpu: the estimate is of a GPU's memory, where the input pipeline's buffers and what the
    data source keeps (spec.held_bytes) are not: they are host memory.
    planned: where XLA compiles the step, what to compile for XLA's own plan; None: the rules
    (and, for the transformer under XLA, the constants fitted to XLA's plans).
    """
    if cfg.checkpointing.policy not in CHECKPOINTING:
        raise ValueError(
            f"checkpointing.policy={cfg.checkpointing.policy}: expected one of {CHECKPOINTING}"
        )
    # One float32 mask per pruned kernel, chosen as runner/techniques/pruning.py chooses them.
    schedule = schedule_of(cfg.pruning)
    kernels = pruning.select_kernels(model, cfg.pruning) if schedule.prunes else []
    parts = held(model, optimizer, cfg, spec, kernels, on_gpu)
    step = None
    if planned is not None and not executor_rules.replicated(cfg):
        try:
            step = xla_plan.step_parts(optimizer, cfg, spec, on_gpu, planned)
        except xla_plan.REFUSED:  # XLA cannot compile it: the rules' estimate, as without a plan
            pass
    if step is None:
        step = step_parts(model, optimizer, cfg, spec, cpu_xla, remat, on_gpu)
    if step is None:  # no total: a sum without the activations would read as one
        every = _gradient_bytes(model.trainable_variables, optimizer, cfg, False)
        return {**parts, "gradients": every, "total": None}
    own = sum(step.values())
    # What a choice step holds beyond the backward's moment (executor_rules.choice_bytes).
    threads = executor_rules.inter_op_threads()  # the masks' choices run at once
    choice = executor_rules.choice_bytes(kernels, schedule.choice_copies, threads, cpu_xla) - own
    # The allocator's rounding of a step without XLA (XLA's buffers are its plan's), and the
    # small tensors the job keeps in chunks of 256 bytes (small_tensors.py).
    waste = 0
    if not cpu_xla and "xla_plan" not in step:
        waste = int(ALLOCATOR_WASTE * own) + small_tensors.small_tensors_bytes(
            model, optimizer, cfg.accum
        )
    if "xla_plan" not in step:
        step["allocator"] = waste
    parts |= {**step, "mask_choice": max(0, choice)}
    return {**parts, "total": sum(parts.values())}


def held(model, optimizer, cfg, spec, kernels: list, on_gpu: bool) -> dict:
    """What a job holds for the whole run, beside its step: its variables and its data."""
    return {
        "params": resident.nbytes(model.weights),
        # Slots from the built optimizer itself, so any optimizer (and the loss-scale wrapper,
        # whose variables include the inner optimizer's) is counted as it is.
        "optimizer": resident.nbytes(optimizer.variables),
        # The train step (runner/techniques/accumulation.py) sums micro-batch gradients: one
        # running float32 sum beside the current micro-batch's gradients.
        "accumulation": executor_rules.float32_bytes(model.trainable_variables)
        if cfg.accum > 1
        else 0,
        "masks": executor_rules.float32_bytes(kernels),
        # The input pipeline's tables, arrays and shuffle buffer (runner/data/examples.py),
        # kept for the whole run in the allocator a CPU trains with.
        "data": 0 if on_gpu else spec.held_bytes,
    }
