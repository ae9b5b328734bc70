"""XLA's own memory plan of a job's train step, read from the compiled step without running it:
the estimate wherever XLA compiles the step (`trainer.jit_compile`), for any model and any
device XLA compiles for.

XLA assigns every buffer of a compiled program before it runs (its buffer assignment:
tensorflow/compiler/xla/service/buffer_assignment.h). tf.function's
`experimental_get_compiler_ir(*args)(stage="optimized_hlo_proto_serialized")` compiles the step
as the run compiles it and returns the optimized HloProto, whose `buffer_assignment` lists each
allocation with its size and what it is:
- an entry computation parameter: a variable the call reads (weights, optimizer slots,
  accumulation sums) or its input micro-batch, which exist before the call and after it;
- maybe-live-out, not a parameter: the call's results;
- the rest: its temporaries, packed by XLA's heap simulation into the bytes the call adds while
  it runs (the activations, gradients and workspace, as XLA schedules and shares them).
The allocations' sizes sum to the "Total bytes used" of XLA's buffer-assignment dump
(XLA_FLAGS=--xla_dump_to), which the allocator's measured peak matched within 0.8 MiB in 62
transformer jobs (docs/memory-budget.md). A step that accumulates is two calls (a micro-batch's,
the update's: runner/techniques/accumulation.py): the larger of the two is its peak.

Compiling takes seconds (the default transformer at micro-batch 32: about 3 s on a 2-core CPU),
so the plans are cached on disk by what decides them (cached).
"""

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import keras
import tensorflow as tf
from omegaconf import OmegaConf
from tensorflow.compiler.xla.service import hlo_pb2

from runner.estimate import resident
from runner.techniques.accumulation import make_train_step


@dataclass(frozen=True)
class CallPlan:
    """One compiled call's buffers (bytes)."""

    parameters: int  # the variables it reads and its inputs: alive before and after it
    outputs: int  # its results (not aliasing a parameter)
    temporaries: int  # what it adds while it runs
    seconds: float  # how long the compile took

    @property
    def added(self) -> int:
        """Bytes the call adds to what was alive before it: its temporaries and results."""
        return self.outputs + self.temporaries


def read(function, args: tuple, device: str | None = None) -> CallPlan:
    """XLA's plan of `function` (a tf.function compiled with jit_compile) called on `args`."""
    start = time.perf_counter()
    ir = function.experimental_get_compiler_ir(*args)
    raw = ir(stage="optimized_hlo_proto_serialized", device_name=device)
    allocations = hlo_pb2.HloProto.FromString(raw).buffer_assignment.buffer_allocations
    parameters = outputs = temporaries = 0
    for a in allocations:
        if a.is_entry_computation_parameter:
            parameters += a.size
        elif a.maybe_live_out:
            outputs += a.size
        elif not a.is_thread_local:  # thread-local: a fused loop's registers, not the heap
            temporaries += a.size
    return CallPlan(parameters, outputs, temporaries, time.perf_counter() - start)


def example_batch(spec, batch: int) -> tuple[tf.Tensor, tf.Tensor]:
    """A micro-batch of zeros as the pipeline feeds the step one (models/spec.py DataSpec):
    float32 images or int32 tokens, and a class an example or, per token, one a position."""
    dtype = tf.int32 if spec.kind == "tokens" else tf.float32
    x = tf.zeros((batch, *spec.input_shape), dtype)
    y = tf.zeros((batch, *spec.input_shape[:1]) if spec.per_token else (batch,), tf.int32)
    return x, y


def plan_step(trained, optimizer, spec, accum: int, batch: int, device: str | None = None):
    """The plans of a job's train step at micro-batch `batch` (one per compiled call), built as
    runner/train/pipeline.py builds it: `trained` is the model the step calls (checkpointing's
    wrapper), the loss the run's. Pruning's mask choice is not in it (the estimate counts it
    apart: executor_rules.choice_bytes)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(trained, optimizer, loss_fn, accum, jit_compile=True)
    return [read(fn, args, device) for fn, args in step.calls(*example_batch(spec, batch))]


def _layer_config(layer) -> str:
    try:
        return json.dumps(layer.get_config(), sort_keys=True, default=str)
    except (NotImplementedError, TypeError, ValueError):
        return type(layer).__name__  # a layer without get_config: its kind


def fingerprint(model) -> list:
    """What a model's program is made of, as far as Keras can say: each layer's kind and
    settings (get_config), and each weight's path, shape and dtype. A checkpointing wrapper or
    a user's own layer may not serialize as a whole model; their layers still do."""
    layers = [_layer_config(layer) for layer in model._flatten_layers(include_self=False)]
    weights = [(w.path, tuple(w.shape), str(w.dtype)) for w in model.weights]
    return [type(model).__name__, layers, weights]


def key(trained, optimizer, accum: int, batch: int, device: str | None) -> dict:
    """What decides a step's plan: the model (its fingerprint), the optimizer's kind and
    settings, accum, the micro-batch, the device and TensorFlow's version."""
    settings = json.dumps(optimizer.get_config(), sort_keys=True, default=str)
    return {
        "model": fingerprint(trained), "optimizer": type(optimizer).__name__,
        "settings": settings, "accum": accum, "batch": batch, "device": device or "cpu",
        "tf": tf.__version__,
    }  # fmt: skip


def cached(folder: Path | None, what: dict, compute) -> tuple[list[CallPlan], bool]:
    """(compute()'s plans, whether they came from the cache), kept as folder/xla-plan-<hash of
    `what`>.json: a plan is XLA's for that model, optimizer, batch and device."""
    if folder is None:
        return compute(), False
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(folder) / f"xla-plan-{digest}.json"
    if path.exists():
        return [CallPlan(**c) for c in json.loads(path.read_text())], True
    plans = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: a process reading the cache beside it (the suite's workers
    # share one) never finds half a file
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps([asdict(p) for p in plans]))
    os.replace(part, path)
    return plans, False


def device(on_gpu: bool) -> str | None:
    """The device XLA compiles a job's step for: the first GPU, or (None) the CPU."""
    return "/device:GPU:0" if on_gpu else None


class NotCompiled(Exception):
    """A plan not in the cache, asked for by a Ledger that leaves compiling to its caller."""


@dataclass
class Ledger:
    """The plans a caller read (runner.plan's table): each read's (seconds, from the cache).
    compile=False: a plan not in the cache raises NotCompiled instead of being compiled here
    (the caller compiles it elsewhere: runner/plan/row.py). processes: how many processes
    read them at once, and wall_s, how long that took (None: one process, one after another)."""

    reads: list[tuple[float, bool]] = field(default_factory=list)
    compile: bool = True
    processes: int = 1
    wall_s: float | None = None

    @property
    def seconds(self) -> float:
        """How long reading the plans took."""
        return self.wall_s if self.wall_s is not None else sum(s for s, _ in self.reads)


@dataclass(frozen=True)
class Planned:
    """What XLA's plan of a job's step is read from: the model the step calls (checkpointing's
    wrapper), the device XLA compiles for (None: the CPU) and the folder its plans are cached
    in (None: not cached)."""

    trained: keras.Model
    device: str | None = None
    cache: Path | None = None
    ledger: Ledger | None = None  # where each plan read is written down, if given


# A step XLA cannot compile (an op without an XLA kernel) or a model it cannot trace here.
REFUSED = (tf.errors.OpError, ValueError, NotImplementedError, TypeError)


# The config groups that decide a step's program beside the model's layers.
CONFIG_KEYS = ("model", "precision", "checkpointing")


def plans(optimizer, cfg, spec, planned: Planned) -> tuple[list[CallPlan], bool]:
    """XLA's plans of the job's step calls at its micro-batch, and whether they were cached."""
    b, accum, trained = cfg.data.batch_size, cfg.accum, planned.trained
    what = key(trained, optimizer, accum, b, planned.device)
    # what the layers do not say: how the step is rebuilt (selective checkpointing wraps
    # calls, not layers) and what it is fed
    config = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in CONFIG_KEYS}
    what |= {"config": config, "spec": repr(spec)}
    ledger = planned.ledger

    def compute():
        if ledger is not None and not ledger.compile:
            raise NotCompiled
        return plan_step(trained, optimizer, spec, accum, b, planned.device)

    start = time.perf_counter()
    found, hit = cached(planned.cache, what, compute)
    if ledger is not None:
        ledger.reads.append((time.perf_counter() - start, hit))
    return found, hit


def step_parts(optimizer, cfg, spec, on_gpu: bool, planned: Planned) -> dict:
    """The step's own parts from XLA's plan of it: the input micro-batches the pipeline holds,
    and "xla_plan", what the step's larger call adds while it runs (its activations, gradients
    and workspace, as XLA packs them; they are not told apart)."""
    calls, _ = plans(optimizer, cfg, spec, planned)
    inputs = resident.inputs_bytes([spec.input_shape], cfg.data.batch_size, on_gpu)
    return {"inputs": inputs, "xla_plan": max(c.added for c in calls)}
