"""The planner's prediction: a job's peak as a line in the micro-batch, its budget, and the
step-time ratio of its precision where tfmemlab's benchmarks measured one."""

import os
from dataclasses import dataclass, field

import keras
from omegaconf import DictConfig

from runner.config import takes_images, with_batch
from runner.core import machine
from runner.core.errors import PlanError
from runner.core.machine import cache_dir
from runner.core.units import parse_bytes
from runner.estimate import coverage, executor_rules, memory, xla_plan
from runner.estimate.memory import is_cpu_xla
from runner.feed.pipelines import build_data
from runner.measure import flops
from runner.measure.telemetry import nvidia_smi
from runner.techniques import checkpointing, precision
from runner.train import device
from runner.train.job import build_model
from runner.train.optimizer import build_optimizer, resolve_jit

CAP = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # the CPU allocator's limit, when one is set

# Step time of a precision against fp32 at the same batch, as tfmemlab's benchmarks measured
# it, by (device class, precision, model family, XLA): (ratio, where it was measured). A
# CPU's class is its kernels' (device_class): "cpu", a 2-core Xeon with AVX512_BF16/AMX,
# where TensorFlow runs oneDNN's; EMULATED_BF16_CPU, a 2-core Xeon with AVX512F and neither,
# where oneDNN emulates bfloat16; NO_BF16_CPU, a 2-core AMD EPYC without AVX512, where
# TensorFlow runs its own. One process per job. No GPU figure was measured (no GPU here): on
# a GPU the FLOPs alone are used, which ignores tensor cores' 16-bit speed-up.
NO_BF16_CPU = "cpu without AVX512"  # TensorFlow's own 16-bit kernels
EMULATED_BF16_CPU = "cpu with AVX512F, without AVX512_BF16/AMX"  # oneDNN's emulated bfloat16
UNMEASURED = "FLOPs only"  # time_from of a precision whose step-time ratio was not measured
MEASURED = {
    # bench precision_accum: MobileNetV2 96x96, batch 8, no XLA, one run (docs/findings.md).
    ("cpu", "bf16", "cnn", False): (1.26, "bench precision_accum, CPU, MobileNetV2"),
    ("cpu", "mixed", "cnn", False): (24.9, "bench precision_accum, CPU, MobileNetV2"),
    # bench checkpointing: transformer h=32, 256 tokens, dropout 0, no XLA.
    ("cpu", "bf16", "transformer", False): (1.30, "bench checkpointing, CPU, transformer"),
    # bench plan --time (docs/findings.md), 3 interleaved rounds of 5 timed steps: transformer
    # h=64, 2 layers, 128 tokens, batch 32, XLA (95% intervals 0.90-2.26 and 0.85-1.92: steps
    # of 65-105 ms move much); MobileNetV2 x0.35 at 64 px, micro-batch 8 x 4, bf16 2.283 and
    # fp32 1.365 of the same reference. bench precision_accum --repeats 3 read the transformer
    # (h=128, 4 layers, batch 8) at mixed 1.283 [0.994, 1.332] and bf16 1.114 [1.060, 1.114],
    # and MobileNetV2 at alpha 1.0, 96x96, batch 8 at bf16 4.396 [2.741, 4.452]: bfloat16's
    # cost grows with the model here, and 1.67 is the plan's own case's.
    (NO_BF16_CPU, "mixed", "transformer", True): (1.29, "bench plan --time, CPU, transformer"),
    (NO_BF16_CPU, "bf16", "transformer", True): (1.16, "bench plan --time, CPU, transformer"),
    (NO_BF16_CPU, "bf16", "cnn", False): (1.67, "bench plan --time, CPU, MobileNetV2"),
    # bench precision_accum --repeats 3: MobileNetV2 96x96, batch 8, no XLA: 2.048 [1.201,
    # 2.380]; TensorFlow's own float16 kernels, where oneDNN's took 24.9x.
    (NO_BF16_CPU, "mixed", "cnn", False): (2.05, "bench precision_accum, CPU, MobileNetV2"),
    # bench plan --time --repeats 3 --steps 6 on the Xeon with AVX512F (docs/findings.md), each
    # against fp32 at micro-batch 32: the transformer under XLA bf16 1.061 [1.018, 1.350];
    # MobileNetV2 x0.35 at 64 px bf16 1.029 [0.906, 1.914] (within noise), where TensorFlow's
    # own kernels took 1.67. Its float16 is TensorFlow's own, as without AVX512 (device_class).
    (EMULATED_BF16_CPU, "bf16", "transformer", True): (
        1.06,
        "bench plan --time, Xeon, transformer",
    ),
    (EMULATED_BF16_CPU, "bf16", "cnn", False): (1.03, "bench plan --time, Xeon, MobileNetV2"),
    # bench plan --time --repeats 3 --steps 6 on a 2-core Xeon with AMX and AVX512_BF16
    # (docs/findings.md), the transformer under XLA against fp32 at micro-batch 32: mixed
    # 1.222 [1.167, 1.243], bf16 1.134 [1.097, 1.153]; they had been FLOPs only on this class.
    ("cpu", "mixed", "transformer", True): (1.22, "bench plan --time, AMX Xeon, transformer"),
    ("cpu", "bf16", "transformer", True): (1.13, "bench plan --time, AMX Xeon, transformer"),
}


def budget(cfg: DictConfig, on_gpu: bool) -> tuple[int, str]:
    """(bytes, where the figure came from): plan.budget, else the GPU's total memory, else on a
    CPU TF_CPU_BFC_MEM_LIMIT_IN_MB (the allocator's limit); else a one-line error."""
    if cfg.plan.budget is not None:
        return parse_bytes(cfg.plan.budget), "plan.budget"
    if on_gpu and (total := _gpu_total_bytes()):
        return total, "the GPU's total memory (nvidia-smi)"
    limit = os.environ.get(CAP)
    if not on_gpu and limit:
        return int(limit) * 2**20, CAP
    raise PlanError(
        "plan.budget=null: on a CPU give the memory budget, e.g. plan.budget=8GiB (or set "
        f"{CAP}, the allocator's limit)"
    )


def _gpu_total_bytes() -> int | None:
    """The first GPU's total memory, per nvidia-smi, or None."""
    lines = (nvidia_smi("gpu=memory.total", timeout=20) or "").split()
    return int(float(lines[0])) * 2**20 if lines else None


def target_batch(cfg: DictConfig) -> int:
    """trainer.effective_batch_size, else the config's own data.batch_size x accum."""
    if cfg.trainer.effective_batch_size is not None:
        return int(cfg.trainer.effective_batch_size)
    return cfg.data.batch_size * (1 if cfg.accum == "auto" else cfg.accum)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Line:
    """A predicted peak, linear in the micro-batch: fixed + accumulation (accum > 1) +
    b x per_sample; `parts` the fixed part by name (bytes)."""

    fixed: float
    accumulation: float
    per_sample: float | None  # None: activations not modelled (a subclassed model): probe
    parts: dict = field(default_factory=dict)
    unmodelled: str = ""  # the layer kinds the estimate has no rule for: probed, not predicted
    # The estimate itself at these micro-batches (b: bytes above fixed and the sum), where it
    # is not linear in b: a convolution's im2col buffer grows with b up to its working set,
    # then stays (runner/estimate/conv_scratch.py).
    points: dict = field(default_factory=dict)

    def peak(self, b: int, accum: int) -> float:
        grows = self.points[b] if b in self.points else b * self.per_sample
        return self.fixed + (self.accumulation if accum > 1 else 0.0) + grows

    def largest_fit(self, effective: int, usable: float) -> int | None:
        """The largest divisor b of the effective batch whose peak is within `usable`."""
        fits = [b for b in divisors(effective) if self.peak(b, effective // b) <= usable]
        return max(fits) if fits else None


def device_info() -> tuple[bool, str]:
    """(whether it trains on a GPU, the device's name as runner.train.device describes it)."""
    gpus = device.setup()
    dev = device.resolve("auto", gpus)
    return dev.startswith("/GPU"), device.describe(dev, gpus)


def data_spec(cfg: DictConfig):
    """What the job's data looks like to its model (shapes, classes), without a batch."""
    return build_data(with_batch(cfg, 1, 1), takes_images(cfg)).spec


def estimate_line(
    cfg: DictConfig, spec, on_gpu: bool, name: str, ledger=None, usable: float | None = None
) -> tuple:
    """(Line, hardware FLOPs of a step at the target batch) of cfg's precision, checkpointing
    and pruning, from the analytic estimate of the model as the run builds it. Where XLA
    compiles the step, from XLA's own plans of it (runner/estimate/xla_plan.py), cached in
    cache_dir(), each read written down in `ledger` (an xla_plan.Ledger): at micro-batch 1 and
    at the target batch, the line through them (only the target batch's, where it fits
    `usable` bytes in one micro-batch)."""
    effective = target_batch(cfg)
    cfg = with_batch(cfg, 1, 1)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu)
    cpu_xla = is_cpu_xla(jit, name)
    keras.backend.clear_session()  # before the policy: clearing the session resets it
    with precision.policy(cfg.precision):
        built, model, remat = _built(cfg, spec)
        optimizer = precision.wrap_optimizer(build_optimizer(cfg.trainer, 10), cfg.precision)
        optimizer.build(model.trainable_variables)
        if jit:
            planned = xla_plan.Planned(model, xla_plan.device(on_gpu), cache_dir(), ledger)
            line = _planned_line(built, optimizer, cfg, spec, effective, remat, planned, usable)
            return line, _hardware(built, cfg, spec, effective, remat)
        one = memory.estimate_memory(built, optimizer, cfg, spec, cpu_xla, remat, on_gpu)
        two = memory.estimate_memory(
            built, optimizer, with_batch(cfg, 2, 2), spec, cpu_xla, remat, on_gpu
        )
        hardware = _hardware(built, cfg, spec, effective, remat)
    fixed = {k: one[k] for k in ("params", "gradients", "optimizer", "masks", "data")}
    unmodelled = coverage.unmodelled(built, 1, 4)[0] if memory.walked(cfg, built) else {}
    if one["total"] is None or unmodelled:  # the probes measure what it keeps per example
        said = ", ".join(f"{k} x{n}" for k, n in sorted(unmodelled.items()))
        return Line(sum(fixed.values()), two["accumulation"], None, fixed, said), hardware
    one_batch, two_batch = (e["activations"] + e["workspace"] + e["allocator"] for e in (one, two))
    per_sample = two_batch - one_batch
    # What does not grow with the micro-batch (a grouped convolution's XLA buffer) stays.
    fixed["workspace"] = max(0, one_batch - per_sample)
    line = Line(sum(fixed.values()), two["accumulation"], per_sample, fixed)
    with precision.policy(cfg.precision):  # the estimate at each micro-batch the plan weighs
        for b in divisors(effective):
            k = effective // b
            at = memory.estimate_memory(
                built, optimizer, with_batch(cfg, b, k), spec, cpu_xla, remat, on_gpu
            )
            line.points[b] = at["total"] - at["accumulation"] - line.fixed
    if len(line.points) > 1:  # the slope where the plan's large micro-batches are
        (b1, p1), (b2, p2) = sorted(line.points.items())[-2:]
        line.per_sample = (p2 - p1) / (b2 - b1)
    return line, hardware


def _built(cfg: DictConfig, spec) -> tuple:
    """(the model as the run builds it, what the step calls: checkpointing's wrapper, its
    RematInfo); under cfg's precision policy."""
    built = build_model(cfg.model, spec)
    model, remat = checkpointing.apply(built, cfg.checkpointing.policy, cfg.checkpointing.every)
    return built, model, remat


def step_flops(cfg: DictConfig, spec) -> float:
    """Hardware FLOPs of a step of cfg's job at the target batch (checkpointing's
    recomputation in): the step-time ratios' reference, with no plan of its memory."""
    effective = target_batch(cfg)
    cfg = with_batch(cfg, 1, 1)
    keras.backend.clear_session()
    with precision.policy(cfg.precision):
        built, _, remat = _built(cfg, spec)
        return _hardware(built, cfg, spec, effective, remat)


def _hardware(built, cfg, spec, effective: int, remat) -> float:
    """Hardware FLOPs of a step at the target batch (checkpointing's recomputation in)."""
    flops_cfg = with_batch(cfg, effective, 1)
    model_flops = flops.model_flops_per_step(built, flops_cfg, spec)
    return flops.hardware_flops_per_step(model_flops, built, flops_cfg, spec, remat)


def _planned_line(built, optimizer, cfg, spec, effective: int, remat, planned, usable) -> Line:
    """The line through XLA's plans of the step at micro-batch 1 and at the target batch, each
    an accum=1 step (its update in the same call: a micro-batch's call of an accumulating
    step holds no more), the accumulation sum beside it for accum > 1. Where the target
    batch's plan fits `usable` bytes (None: not asked) in one micro-batch, the plan at 1 is
    not compiled: the line is that one plan (through 0), and only its point is a figure."""
    at = {}
    for b in sorted({1, effective}, reverse=True):
        if b < effective and usable is not None and at[effective]["total"] <= usable:
            break
        job = with_batch(cfg, b, 1)
        at[b] = memory.estimate_memory(built, optimizer, job, spec, True, remat, False, planned)
    fixed = {k: at[effective][k] for k in ("params", "optimizer", "masks", "data")}
    base = sum(fixed.values())
    sums = executor_rules.float32_bytes(built.trainable_variables)
    line = Line(base, sums, None, fixed)
    line.points = {b: parts["total"] - base for b, parts in at.items()}
    (b1, p1), (b2, p2) = sorted(line.points.items())[0], sorted(line.points.items())[-1]
    line.per_sample = (p2 - p1) / (b2 - b1) if b2 > b1 else p2 / b2
    return line


def device_class(on_gpu: bool, precision_name: str) -> str:
    """MEASURED's device class: a 16-bit precision's speed on a CPU depends on the kernels its
    instructions get (with AVX512_BF16/AMX TensorFlow runs oneDNN's, which emulate float16 at
    25x fp32's time on MobileNetV2; with AVX512F alone, oneDNN's emulated bfloat16: 1.03x;
    without AVX512, its own: float16 at 2x, bfloat16 converted to float32 and back, 1.67x).
    Float16 takes TensorFlow's own kernels with AVX512F alone too: its class is NO_BF16_CPU
    there (the transformer's mixed under XLA: 1.29 stored on the EPYC, 5 of 6 rows of the
    Xeon's time check within 15% with it). fp32 is every class's reference."""
    if on_gpu:
        return "gpu"
    classes = {"onednn": "cpu", "onednn_emulated": EMULATED_BF16_CPU, "tensorflow": NO_BF16_CPU}
    return classes[machine.cpu_kernels(precision_name)]


def time_factor(cfg: DictConfig, on_gpu: bool, jit: bool) -> tuple[float, str]:
    """The measured step-time ratio of cfg's precision to fp32 on this device class, if any."""
    if cfg.precision.name == "fp32":
        return 1.0, "FLOPs"
    family = "transformer" if cfg.model.name == "transformer" else "cnn"
    key = (device_class(on_gpu, cfg.precision.name), cfg.precision.name, family, jit)
    found = MEASURED.get(key)
    if found is None:
        return 1.0, f"{UNMEASURED} (no step time measured here for this precision)"
    ratio, where = found
    return ratio, f"FLOPs x {ratio:g} measured ({where})"
