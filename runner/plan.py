"""Fit a memory budget (issue 17): the cheapest precision, checkpointing, micro-batch and accum
that reach the effective batch within a memory budget.

    python -m runner.plan [run.py overrides] plan.budget=8GiB    # estimate only: seconds
    python -m runner.plan ... plan.measure=true                  # rows that fit, probed
    python run.py accum=auto trainer.effective_batch_size=256 plan.budget=8GiB

The prediction is the analytic estimate (runner/measure/estimate.py), which is linear in the
micro-batch b: peak(b) = fixed + b x per_sample, plus the float32 accumulation sum when
accum > 1. The fixed part is params, gradients, optimizer slots and pruning masks. A row
fits when its prediction is within the budget less `plan.margin`.

The time column is a prediction too: the hardware FLOPs of an optimizer step (checkpointing's
recomputation included) against fp32 with no checkpointing, times the step-time ratio of the
precision that tfmemlab's benchmarks measured on this device class, model family and XLA
setting where there is one (`MEASURED`); its `time_from` column says which.

`accum=auto` measures instead of trusting the estimate: short probes (3 optimizer steps, each
in a fresh process, without a CPU allocator limit: see probe()) at two micro-batch sizes fit
peak(b) = fixed + b x per_sample, the largest b that divides the effective batch and is
predicted within the budget less the margin is confirmed by one more probe run as the job
will run (under the limit, if one is set), and the run trains with accum = effective / b.
"""

import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig, OmegaConf

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
PROBE_STEPS = 3

# Step time of a precision against fp32 at the same batch, as tfmemlab's benchmarks measured
# it, by (device class, precision, model family, XLA): (ratio, where it was measured). All on
# this project's 2-core Xeon CPU with AVX512_BF16/AMX, one process per job; float16 is
# emulated on a CPU. No GPU figure was measured (no GPU here): on a GPU the FLOPs alone are
# used, which ignores tensor cores' 16-bit speed-up.
UNMEASURED = "FLOPs only"  # time_from of a precision whose step-time ratio was not measured
MEASURED = {
    # bench precision_accum: MobileNetV2 96x96, batch 8, no XLA (README, Config groups).
    ("cpu", "bf16", "cnn", False): (1.26, "bench precision_accum, CPU, MobileNetV2"),
    ("cpu", "mixed", "cnn", False): (24.9, "bench precision_accum, CPU, MobileNetV2"),
    # bench checkpointing: transformer h=32, 256 tokens, dropout 0, no XLA.
    ("cpu", "bf16", "transformer", False): (1.30, "bench checkpointing, CPU, transformer"),
}


BYTES_ALLOWED = "bytes or a number with a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 8GiB"


class PlanError(ValueError):
    """The budget cannot be met or read; the message is one line."""


def parse_bytes(text, key: str = "plan.budget") -> int:
    """`8GiB`, `512MiB`, `2.5GB`, `1048576` -> bytes; a one-line error naming the key."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in UNITS):
        raise PlanError(f"{key}={text}: expected {BYTES_ALLOWED}")
    return int(float(match.group(1)) * UNITS[unit or "B"])


def mib(n: float) -> float:
    return n / 2**20


def _gpu_total_bytes() -> int | None:
    """The first GPU's total memory, per nvidia-smi, or None."""
    from runner.measure.telemetry import nvidia_smi

    lines = (nvidia_smi("gpu=memory.total", timeout=20) or "").split()
    return int(float(lines[0])) * 2**20 if lines else None


def budget(cfg: DictConfig, on_gpu: bool) -> tuple[int, str]:
    """(bytes, where the figure came from): plan.budget, else the GPU's total memory, else on a
    CPU TF_CPU_BFC_MEM_LIMIT_IN_MB (the allocator's limit); else a one-line error."""
    if cfg.plan.budget is not None:
        return parse_bytes(cfg.plan.budget), "plan.budget"
    if on_gpu and (total := _gpu_total_bytes()):
        return total, "the GPU's total memory (nvidia-smi)"
    limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    if not on_gpu and limit:
        return int(limit) * 2**20, "TF_CPU_BFC_MEM_LIMIT_IN_MB"
    raise PlanError(
        "plan.budget=null: on a CPU give the memory budget, e.g. plan.budget=8GiB (or set "
        "TF_CPU_BFC_MEM_LIMIT_IN_MB, the allocator's limit)"
    )


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
    per_sample: float
    parts: dict = field(default_factory=dict)

    def peak(self, b: int, accum: int) -> float:
        return self.fixed + (self.accumulation if accum > 1 else 0.0) + b * self.per_sample

    def largest_fit(self, effective: int, usable: float) -> int | None:
        """The largest divisor b of the effective batch whose peak is within `usable`."""
        fits = [b for b in divisors(effective) if self.peak(b, effective // b) <= usable]
        return max(fits) if fits else None


def with_batch(cfg: DictConfig, b: int, accum: int, **more) -> DictConfig:
    """A copy of cfg at micro-batch b and accum, with `more` (dotted keys) set."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out.data.batch_size, out.accum = b, accum
    for key, value in more.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def device_info() -> tuple[bool, str]:
    """(whether it trains on a GPU, the device's name as runner.device describes it)."""
    from runner import device

    gpus = device.setup()
    dev = device.resolve("auto", gpus)
    return dev.startswith("/GPU"), device.describe(dev, gpus)


def data_spec(cfg: DictConfig):
    """What the job's data looks like to its model (shapes, classes), without a batch."""
    from runner.config import IMAGE_MODELS
    from runner.data import build_data

    return build_data(with_batch(cfg, 1, 1), cfg.model.name in IMAGE_MODELS).spec


def estimate_line(cfg: DictConfig, spec, on_gpu: bool, name: str) -> tuple:
    """(Line, hardware FLOPs of a step at the target batch) of cfg's precision, checkpointing
    and pruning, from the analytic estimate of the model as the run builds it."""
    import keras

    from runner.measure import estimate, flops, report
    from runner.step import build_optimizer, resolve_jit
    from runner.techniques import checkpointing, precision
    from runner.train import build_model

    keras.backend.clear_session()
    effective = target_batch(cfg)
    cfg = with_batch(cfg, 1, 1)
    jit = resolve_jit(cfg.trainer.jit_compile, cfg.model.name, on_gpu)
    cpu_xla = report.is_cpu_xla(jit, name)
    with precision.policy(cfg):
        built = build_model(cfg, spec)
        model, remat = checkpointing.apply(built, cfg.checkpointing.policy, cfg.checkpointing.every)
        optimizer = precision.wrap_optimizer(build_optimizer(cfg, 10), cfg)
        optimizer.build(model.trainable_variables)
        one = estimate.estimate_memory(built, optimizer, cfg, spec, cpu_xla, remat)
        two = estimate.estimate_memory(
            built, optimizer, with_batch(cfg, 2, 2), spec, cpu_xla, remat
        )
        flops_cfg = with_batch(cfg, effective, 1)
        model_flops = flops.model_flops_per_step(built, flops_cfg, spec)
        hardware = flops.hardware_flops_per_step(model_flops, built, flops_cfg, spec, remat)
    fixed = {k: one[k] for k in ("params", "gradients", "optimizer", "masks")}
    per_sample = (two["activations"] + two["workspace"]) - (one["activations"] + one["workspace"])
    line = Line(sum(fixed.values()), two["accumulation"], per_sample, fixed)
    return line, hardware


def _reference_flops(cfg, spec, on_gpu: bool, name: str) -> float:
    """Hardware FLOPs of a step of fp32 with no checkpointing at the target batch."""
    reference = _job(cfg, "fp32", "none")
    return estimate_line(reference, spec, on_gpu, name)[1]


def _device_class(on_gpu: bool) -> str:
    return "gpu" if on_gpu else "cpu"


def time_factor(cfg: DictConfig, on_gpu: bool, jit: bool) -> tuple[float, str]:
    """The measured step-time ratio of cfg's precision to fp32 on this device class, if any."""
    if cfg.precision.name == "fp32":
        return 1.0, "FLOPs"
    family = "transformer" if cfg.model.name == "transformer" else "cnn"
    found = MEASURED.get((_device_class(on_gpu), cfg.precision.name, family, jit))
    if found is None:
        return 1.0, f"{UNMEASURED} (no step time measured here for this precision)"
    ratio, where = found
    return ratio, f"FLOPs x {ratio:g} measured ({where})"


def with_option(cfg: DictConfig, group: str, option: str) -> DictConfig:
    """cfg with conf/<group>/<option>.yaml in place of its option of that group."""
    from runner.config import CONF_DIR

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out[group] = OmegaConf.merge(out[group], OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    return out


def _job(cfg: DictConfig, precision: str, policy: str) -> DictConfig:
    return with_option(with_option(cfg, "precision", precision), "checkpointing", policy)


def _supported(name: str, on_gpu: bool) -> bool:
    """Whether the device runs the precision: float16 and bfloat16 on a GPU need compute
    capability 7.0 and 8.0; a CPU emulates what it lacks (runner/techniques/precision.py)."""
    if not on_gpu or name == "fp32":
        return True
    import tensorflow as tf

    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    major = (details.get("compute_capability") or (0, 0))[0]
    return major >= (8 if name == "bf16" else 7)


@dataclass
class Row:
    precision: str
    checkpointing: str
    micro_batch: int | None
    accum: int | None
    predicted_MiB: float | None
    fits: bool
    time_ratio: float
    time_from: str
    measured_MiB: float | None = None
    note: str = ""

    def command(self) -> str:
        return (
            f"precision={self.precision} checkpointing={self.checkpointing} "
            f"data.batch_size={self.micro_batch} accum={self.accum}"
        )


def _cheapest_first(row: Row) -> tuple:
    """Rows that fit, by predicted time; at equal times a time that is fp32's or measured
    before a guess (a precision with no measured ratio), then fewer accumulation steps (FLOPs
    do not see that small micro-batches use a device less well), then the lower peak."""
    guessed = row.time_from.startswith(UNMEASURED)
    return (
        not row.fits,
        row.time_ratio,
        guessed,
        row.accum or math.inf,
        row.predicted_MiB or math.inf,
    )


def table(cfg: DictConfig) -> tuple[list[Row], int, str, float]:
    """One row per precision x checkpointing policy: at the target batch, the largest
    micro-batch predicted to fit, its accum, peak and step-time ratio to fp32/none. Returns
    (rows sorted cheapest first, the budget, where it came from, the usable bytes)."""
    from runner import step

    on_gpu, name = device_info()
    total, source = budget(cfg, on_gpu)
    usable = total * (1 - cfg.plan.margin)
    effective = target_batch(cfg)
    spec = data_spec(cfg)
    rows, base_flops = [], None
    for precision in cfg.plan.precisions:
        if not _supported(precision, on_gpu):
            continue
        for policy in cfg.plan.policies:
            job = _job(cfg, precision, policy)
            try:
                line, hardware = estimate_line(job, spec, on_gpu, name)
            except ValueError as err:  # a policy the model cannot take (no block boundaries)
                rows.append(
                    Row(precision, policy, None, None, None, False, math.inf, "-", note=str(err))
                )
                continue
            if base_flops is None:  # the time ratios' reference: fp32, no checkpointing
                base_flops = _reference_flops(cfg, spec, on_gpu, name)
            jit = step.resolve_jit(job.trainer.jit_compile, job.model.name, on_gpu)
            factor, time_from = time_factor(job, on_gpu, jit)
            b = line.largest_fit(effective, usable)
            k = effective // b if b else None
            predicted = line.peak(b, k) if b else line.peak(1, effective)
            rows.append(
                Row(
                    precision,
                    policy,
                    b,
                    k,
                    mib(predicted),
                    b is not None,
                    hardware / base_flops * factor,
                    time_from,
                )
            )
    rows.sort(key=_cheapest_first)
    return rows, total, source, usable


# ---- probes: a few optimizer steps in a fresh process, measuring the real peak --------------


CAP = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


def _in_fresh_process(function, *args, capped: bool = True):
    """function(*args) in a fresh Python process (spawned): TensorFlow keeps memory for the
    life of a process, so what one probe allocates must not count in another, nor in the
    run that follows the plan. capped=False: without the CPU allocator's limit, if set."""
    saved = os.environ.get(CAP)
    if not capped:
        os.environ.pop(CAP, None)
    try:
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(1, maxtasksperchild=1) as pool:
            return pool.apply(function, args)
    finally:
        if saved is not None:
            os.environ[CAP] = saved


def _probe_in_child(container: dict, folder: str) -> dict:
    """Runs in a fresh process: PROBE_STEPS optimizer steps of the job, its measured peak."""
    os.chdir(folder)  # the probe's run directory goes to the throw-away folder
    _quiet()
    from runner import import_tensorflow_quietly

    import_tensorflow_quietly()
    import tensorflow as tf

    from runner.train import run

    try:
        figures = run(OmegaConf.create(container))
    except tf.errors.ResourceExhaustedError:
        return {"peak_bytes": None, "oom": True}
    return {"peak_bytes": int(figures["mem/peak_bytes"]), "oom": False}


def _quiet() -> None:
    """A probe's own summary (and TensorFlow's logs) would read as the run's: drop them."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _estimate_in_child(container: dict) -> dict:
    """Runs in a fresh process: the estimate's line for the job (nothing of it stays behind
    in the process that trains)."""
    _quiet()
    from runner import import_tensorflow_quietly

    import_tensorflow_quietly()
    cfg = OmegaConf.create(container)
    on_gpu, name = device_info()
    spec = data_spec(cfg)
    line, _ = estimate_line(cfg, spec, on_gpu, name)
    return asdict(line)


def probe(cfg: DictConfig, b: int, accum: int, capped: bool = True) -> dict:
    """The measured peak of cfg at micro-batch b (None: out of memory), from PROBE_STEPS
    optimizer steps in a fresh process logged to a throw-away store. accum is at most 2: one
    accumulation sum is alive whatever accum > 1 is.

    capped=False runs it without TF_CPU_BFC_MEM_LIMIT_IN_MB: under a tight limit the CPU
    allocator's pool is small, a chunk is split only for requests under half its size, and
    the peak counts the rounding (measured: a transformer at micro-batch 16 read 16.5 MiB
    under a 48 MiB limit and 9.6 MiB without it, at 64 46.8 and 37.2 MiB). Uncapped, the
    peak is what the tensors need, and grows linearly with b."""
    k = min(accum, 2)
    with tempfile.TemporaryDirectory() as tmp:
        job = with_batch(
            cfg,
            b,
            k,
            **{
                "trainer.max_steps": PROBE_STEPS,
                "trainer.eval_batches": 1,
                "trainer.checkpoint_every": 0,
                "trainer.resume": None,
                "trainer.progress": False,
                "profile.layers": False,
                "mlflow.tracking_uri": f"sqlite:///{tmp}/probe.db",
                "mlflow.experiment": "probe",
                "mlflow.run_name": f"probe b={b}",
                "mlflow.system_metrics": False,
                "data.train_samples": max(cfg.data.train_samples, b * k),
            },
        )
        if job.pruning.schedule != "none":  # masks chosen within the probe's few steps
            job.pruning.begin_step, job.pruning.end_step, job.pruning.frequency = 0, None, 2
        result = _in_fresh_process(_probe_in_child, OmegaConf.to_container(job), tmp, capped=capped)
    limit = os.environ.get(CAP) if capped else None
    return {"micro_batch": b, "accum": k, **result, "cpu_limit_MiB": limit}


# ---- accum=auto -----------------------------------------------------------------------------


def _size(n: float) -> str:
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{mib(n):.1f} MiB"


def _too_small(line: Line, total: int, source: str, usable: float, effective: int) -> PlanError:
    parts = ", ".join(f"{k} {_size(v)}" for k, v in line.parts.items() if v)
    accumulation = line.accumulation if effective > 1 else 0
    if accumulation:
        parts += f", accumulation sum {_size(accumulation)}"
    return PlanError(
        f"the budget of {_size(total)} ({source}) is below what this job keeps whatever its "
        f"micro-batch: {_size(line.fixed + accumulation)} ({parts}; {_size(usable)} usable "
        "after plan.margin). Shrink it with a smaller model (model.*), trainer.optimizer=sgd "
        "(no slots; adam keeps two float32 slots per weight), or give a larger budget; "
        "precision does not shrink it here (Keras keeps float32 variables, gradients and slots "
        "under mixed policies)"
    )


def _probe_sizes(candidates: list[int], guess: int) -> tuple[int, int]:
    """Two micro-batch sizes below the estimate's guess, about a quarter and half of it."""
    below = [b for b in candidates if b <= guess] or candidates[:1]
    low = max([b for b in below if b <= guess / 4] or below[:1])
    high = max(
        [b for b in below if b <= guess / 2 and b > low]
        or [b for b in candidates if b > low][:1]
        or [low]
    )
    return low, high


def auto(cfg: DictConfig, log=print) -> tuple[DictConfig, dict]:
    """accum=auto: cfg with the micro-batch and accum chosen by measurement (module
    docstring), and the plan's record (for plan.json). PlanError when nothing fits."""
    import tensorflow as tf

    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    total, source = budget(cfg, on_gpu)
    usable = total * (1 - cfg.plan.margin)
    effective = target_batch(cfg)
    line = Line(**_in_fresh_process(_estimate_in_child, OmegaConf.to_container(cfg)))
    if line.fixed + (line.accumulation if effective > 1 else 0) > usable:
        raise _too_small(line, total, source, usable, effective)
    candidates = divisors(effective)
    guess = line.largest_fit(effective, usable) or 1
    low, high = _probe_sizes(candidates, guess)
    log(
        f"tfmemlab: accum=auto: effective batch {effective}, budget {mib(total):.1f} MiB "
        f"({source}; {mib(usable):.1f} MiB usable); the estimate says micro-batch {guess}; "
        f"probing {low} and {high}"
    )
    # The fit: what the tensors need (no CPU allocator limit, see probe()).
    probes = [probe(cfg, b, effective // b, capped=False) for b in dict.fromkeys((low, high))]
    measured = [p for p in probes if not p["oom"]]
    estimate_slope = line.per_sample
    if len(measured) == 2:
        (b1, p1), (b2, p2) = ((p["micro_batch"], p["peak_bytes"]) for p in measured)
        slope = (p2 - p1) / (b2 - b1)
        fixed = p1 - slope * b1
    elif measured:  # one size only (the effective batch allows no other): the estimate's slope
        slope = estimate_slope
        fixed = measured[0]["peak_bytes"] - slope * measured[0]["micro_batch"]
    else:
        raise PlanError(
            f"accum=auto: the probes ran out of memory at micro-batch {low} (and {high}), "
            f"where the estimate predicts {_size(line.peak(low, effective // low))} within the "
            f"budget of {_size(total)} ({source}): TensorFlow needs more than the estimate "
            "counts here; give a larger budget, or set data.batch_size and accum yourself"
        )
    # Probes with accum > 1 hold the accumulation sum; a micro-batch of the whole effective
    # batch (accum 1) does not.
    with_sum = all(p["accum"] > 1 for p in measured)
    fitted = Line(fixed - (line.accumulation if with_sum else 0), line.accumulation, slope)
    disagree = abs(slope - estimate_slope) / max(abs(estimate_slope), 1.0)
    if disagree > 0.25:
        log(
            f"tfmemlab: accum=auto: the measured slope ({mib(slope):.3f} MiB per example) and "
            f"the estimate's ({mib(estimate_slope):.3f}) differ by {disagree:.0%}; the "
            "measurement is used"
        )
    choice = fitted.largest_fit(effective, usable)
    confirmations = []
    while choice is not None:  # confirmed as the run will train: under the limit, if any
        check = probe(cfg, choice, effective // choice)
        confirmations.append(check)
        if not check["oom"] and check["peak_bytes"] <= total:
            break
        smaller = [b for b in candidates if b < choice]
        choice = max(smaller) if smaller else None
    if choice is None:
        smallest = confirmations[-1] if confirmations else probes[0]
        seen = (
            "ran out of memory" if smallest["oom"] else f"peaked at {_size(smallest['peak_bytes'])}"
        )
        raise PlanError(
            f"accum=auto: no micro-batch fits the budget of {_size(total)} ({source}): at "
            f"micro-batch {smallest['micro_batch']} the job {seen}, and the fit predicts "
            f"{_size(fitted.peak(1, effective))} at micro-batch 1; give a larger budget, or "
            "shrink the job (checkpointing, a smaller model)"
        )
    accum = effective // choice
    record = {
        "effective_batch_size": effective,
        "budget_bytes": total,
        "budget_from": source,
        "margin": cfg.plan.margin,
        "usable_bytes": usable,
        "estimate": {"line": asdict(line), "micro_batch": guess},
        "fit": {
            "fixed_bytes": fitted.fixed,
            "per_sample_bytes": slope,
            "slope_vs_estimate": disagree,
        },
        "probes": probes + confirmations,
        "micro_batch": choice,
        "accum": accum,
        "predicted_peak_bytes": fitted.peak(choice, accum),
        "measured_peak_bytes": confirmations[-1]["peak_bytes"],
    }
    log(
        f"tfmemlab: accum=auto: data.batch_size={choice} accum={accum} (effective "
        f"{effective}); predicted peak {mib(record['predicted_peak_bytes']):.1f} MiB, measured "
        f"{mib(record['measured_peak_bytes']):.1f} MiB"
        + (
            f" under {CAP}={confirmations[-1]['cpu_limit_MiB']} (a small pool rounds more)"
            if confirmations[-1]["cpu_limit_MiB"]
            else ""
        )
        + f", budget {mib(total):.1f} MiB"
    )
    return with_batch(cfg, choice, accum), record


def log_plan(tracker, record: dict, run_dir) -> None:
    """The decision and its evidence in the run: plan/* metrics, and plan.json in the run
    directory and among the run's artifacts."""
    tracker.log_metrics(
        {
            "plan/micro_batch": record["micro_batch"],
            "plan/accum": record["accum"],
            "plan/predicted_peak_bytes": record["predicted_peak_bytes"],
            "plan/budget_bytes": record["budget_bytes"],
        },
        step=0,
    )
    tracker.set_tags({"plan": "accum=auto"})
    path = run_dir / "plan.json"
    path.write_text(json.dumps(record, indent=2))
    tracker.log_artifact(path)


# ---- python -m runner.plan ------------------------------------------------------------------


def _format(rows: list[Row], measured: bool) -> str:
    from runner.bench import table as fixed_width

    columns = ["precision", "checkpointing", "micro_batch", "accum", "predicted_MiB", "fits"]
    columns += ["measured_MiB"] if measured else []
    columns += ["time_ratio", "time_from"] + (["note"] if any(r.note for r in rows) else [])
    shown = [{**asdict(r), "fits": "yes" if r.fits else "no"} for r in rows]
    for r in shown:
        r["time_ratio"] = None if math.isinf(r["time_ratio"]) else r["time_ratio"]
    return fixed_width(shown, columns)


def main(argv: list[str]) -> list[Row]:
    from runner.cli import check_command_line
    from runner.config import compose_config

    check_command_line(argv)
    cfg = compose_config(argv)
    from runner import import_tensorflow_quietly

    import_tensorflow_quietly()
    import tensorflow as tf

    # Counting a CNN's FLOPs goes through a TensorFlow 1 graph utility that warns each time.
    tf.get_logger().setLevel("ERROR")
    try:
        rows, total, source, usable = table(cfg)
    except PlanError as err:
        raise SystemExit(f"error: {err}") from None
    effective = target_batch(cfg)
    fitting = [r for r in rows if r.fits]
    if fitting:
        best = fitting[0]
        print(
            f"cheapest that fits: {best.command()} (predicted peak {best.predicted_MiB:.1f} "
            f"MiB of {mib(total):.1f}, time {best.time_ratio:.2f}x fp32/none)"
        )
    else:
        print(f"nothing fits in {mib(total):.1f} MiB at effective batch {effective}")
    print(
        f"model={cfg.model.name}, effective batch {effective} (trainer.effective_batch_size), "
        f"budget {mib(total):.1f} MiB ({source}), {mib(usable):.1f} MiB usable after "
        f"plan.margin={cfg.plan.margin}; predicted peaks are the analytic estimate"
    )
    if cfg.plan.measure:
        for row in fitting:
            job = _job(cfg, row.precision, row.checkpointing)
            result = probe(job, row.micro_batch, row.accum)
            row.measured_MiB = None if result["oom"] else mib(result["peak_bytes"])
            row.note = "out of memory" if result["oom"] else ""
    print(_format(rows, cfg.plan.measure))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
