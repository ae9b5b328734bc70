"""Probes: a few optimizer steps of a job in a fresh process, measuring the real peak and the
step time (runner/plan/timing.py); and the estimate's line computed in a fresh process, so
that nothing of it stays in the one that trains.

A fresh process each (runner/core/process.py): TensorFlow keeps memory for the life of a
process, so what one probe allocates must not count in another, nor in the run that follows.
"""

import os
import tempfile
from dataclasses import asdict

from omegaconf import DictConfig, OmegaConf

from runner.config import with_batch
from runner.core.errors import PlanError
from runner.core.machine import CACHE_ENV, cache_dir
from runner.core.process import in_fresh_process
from runner.plan.line import CAP, Line, data_spec, device_info, divisors, estimate_line
from runner.track.client import scratch_store
from runner.train import pipeline

PROBE_STEPS = 3


def _quiet() -> None:
    """A probe's own summary (and TensorFlow's logs) would read as the run's: drop them."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _probe_in_child(container: dict, folder: str) -> dict:
    """Runs in a fresh process: PROBE_STEPS optimizer steps of the job, its measured peak."""
    import tensorflow as tf

    # The probe reads and adds to the job's cache of the CPU's calibrated peak FLOP/s and
    # bandwidth (cpu_peak.cache_dir) rather than calibrating again in its throw-away folder
    # (2-3 s a probe, measured).
    os.environ[CACHE_ENV] = str(cache_dir().resolve())
    os.chdir(folder)  # the probe's run directory goes to the throw-away folder
    _quiet()
    try:
        figures = pipeline.run(OmegaConf.create(container))
    except tf.errors.ResourceExhaustedError:
        return {"peak_bytes": None, "step_s": None, "oom": True}
    step_s = figures["speed/step_time_s_p50"]
    return {"peak_bytes": int(figures["mem/peak_bytes"]), "step_s": step_s, "oom": False}


def _estimate_in_child(container: dict) -> dict:
    """Runs in a fresh process: the estimate's line for the job."""
    _quiet()
    cfg = OmegaConf.create(container)
    on_gpu, name = device_info()
    line, _ = estimate_line(cfg, data_spec(cfg), on_gpu, name)
    return asdict(line)


def estimate_apart(cfg: DictConfig) -> Line:
    """The estimate's line for cfg, computed in a fresh process."""
    return Line(**in_fresh_process(_estimate_in_child, OmegaConf.to_container(cfg)))


def measured_line(cfg: DictConfig, line: Line, effective: int) -> tuple[Line, list]:
    """The line through the measured peaks at about a quarter and half of the effective batch
    (uncapped probes, accum 2 where the batch allows), for a job whose activations the
    estimate cannot model (a subclassed model); with one size, the line through zero."""
    below = [b for b in divisors(effective) if b <= max(1, effective // 2)]
    sizes = sorted({below[len(below) // 2], below[-1]})
    probes = [probe(cfg, b, effective // b, capped=False) for b in sizes]
    measured = [(p["micro_batch"], p["peak_bytes"], p["accum"]) for p in probes if not p["oom"]]
    if not measured:
        raise PlanError(
            f"the probes ran out of memory at micro-batch {', '.join(map(str, sizes))}, and the "
            "estimate cannot model this model's activations; give a larger budget"
        )
    (b1, p1, k1), (b2, p2, _) = measured[0], measured[-1]
    slope = (p2 - p1) / (b2 - b1) if b2 != b1 else p1 / b1
    fixed = p1 - slope * b1 - (line.accumulation if k1 > 1 else 0)
    return Line(fixed, line.accumulation, slope, line.parts), probes


def probe(
    cfg: DictConfig, b: int, accum: int, capped: bool = True, steps: int = PROBE_STEPS
) -> dict:
    """The measured peak of cfg at micro-batch b (None: out of memory) and its p50 step time,
    from `steps` optimizer steps in a fresh process logged to a throw-away store. accum is at
    most 2: one accumulation sum is alive whatever accum > 1 is.

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
                "trainer.max_steps": steps,
                "trainer.eval_batches": 1,
                "trainer.checkpoint_every": 0,
                "trainer.resume": None,
                "trainer.progress": False,
                "trainer.save_model": False,  # a probe's model is thrown away
                "profile.layers": False,
                "mlflow.tracking_uri": scratch_store(tmp, "probe.db"),
                "mlflow.experiment": "probe",
                "mlflow.run_name": f"probe b={b}",
                "mlflow.system_metrics": False,
                "data.train_samples": max(cfg.data.train_samples, b * k),
            },
        )
        if job.pruning.schedule != "none":  # masks chosen within the probe's few steps
            job.pruning.begin_step, job.pruning.end_step, job.pruning.frequency = 0, None, 2
        container = OmegaConf.to_container(job)
        unset = () if capped else (CAP,)
        result = in_fresh_process(_probe_in_child, container, tmp, unset=unset)
    limit = os.environ.get(CAP) if capped else None
    return {"micro_batch": b, "accum": k, **result, "cpu_limit_MiB": limit}
