"""`measure_kept(cfg, tracker, run_dir)`: the model a run kept (`<run dir>/model.keras`)
converted to each variant of `deploy.variants`, each measured in a fresh process, compared with
the Keras model and recorded into the run. Called at the end of a finished run with
deploy=litert (runner/train/pipeline.py) and by `python -m runner.deploy` for a run already
trained: both measure the file the run kept, not the model in memory.

The reference is the Keras model's own outputs, computed here (in the parent) on the
validation inputs every variant is then run on: agreement is never a variant against itself.
int8's calibration batches are the first `deploy.calibration_batches` batches of the job's own
training split, drawn through the job's data pipeline (runner/feed/pipelines.py's twin, in the
order training drew them) and hashed as the run's data/train_digest was
(runner/track/datasets.py), so `deploy/calibration_digest` shows they are the job's data.
"""

import gzip
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from runner.config import takes_images
from runner.core.machine import cpu_model
from runner.core.process import in_fresh_process
from runner.deploy import child, convert, report, rounds
from runner.deploy.target import no_model
from runner.feed.pipelines import Data, build_data
from runner.schedules import schedule_of
from runner.track.datasets import Tap
from runner.track.model import FILE, load_file

FOLDER = "deploy"  # in the run directory: the SavedModel, the .tflite files, deploy.md


def _validation(data: Data, batches: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The validation split's inputs and targets (its first `batches` batches, as evaluated)."""
    pairs = list(itertools.islice(iter(data.val), batches))
    inputs = np.concatenate([np.asarray(x) for x, _ in pairs])
    return inputs, np.concatenate([np.asarray(y) for _, y in pairs])


def _predict(model, inputs: np.ndarray, batch: int) -> np.ndarray:
    """The Keras model's outputs (logits) on `inputs`, float32."""
    chunks = [model(inputs[i : i + batch], training=False) for i in range(0, len(inputs), batch)]
    return np.concatenate([np.asarray(c, dtype=np.float32) for c in chunks])


def _calibration(data: Data, batches: int):
    """int8's representative data: the job's first training batches (inputs only, float32),
    through a Tap that hashes them as the run's training digest was hashed."""
    tap = Tap(iter(data.twin()))

    def representative():
        for inputs, _ in itertools.islice(tap, batches):
            yield [np.asarray(inputs, dtype=np.float32)]

    return representative, tap


def compare(outputs: np.ndarray, reference: np.ndarray, targets: np.ndarray) -> dict:
    """Accuracy on the targets, top-1 agreement with the reference (the Keras model's
    outputs) and the largest absolute logit difference from it."""
    top = outputs.argmax(-1)
    return {
        "val_accuracy": float(np.mean(top == targets)),
        "agreement": float(np.mean(top == reference.argmax(-1))),
        "max_logit_diff": float(np.max(np.abs(outputs - reference))),
    }


def _sizes(path: Path) -> dict:
    """A file's (or folder's) bytes, raw and each file gzipped."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    raw = sum(f.stat().st_size for f in files)
    return {
        "file_bytes": raw,
        "file_gzip_bytes": sum(len(gzip.compress(f.read_bytes())) for f in files),
    }


def _measurement(done: convert.Converted, inputs_file: Path, settings: dict):
    """The variant's measurement, to run in a fresh process (TensorFlow there for the
    SavedModel only)."""
    saved = done.variant == "saved_model"
    function = child.measure_saved_model if saved else child.measure_litert
    return lambda: in_fresh_process(
        function, str(done.path), str(inputs_file), settings, tensorflow=saved
    )


def _variant(name: str, model, cfg: DictConfig, folder: Path, calibration) -> convert.Converted:
    """The variant `name` converted (or why not), from the SavedModel in `folder`."""
    # zeros in the kernels: magnitude pruning's (pruning=structured leaves them dense)
    why = convert.not_tried(name, model, schedule_of(cfg.pruning).prunes)
    if why is not None:
        return convert.Converted(name, None, why)
    saved = folder / "saved_model"
    if name == "saved_model":
        return convert.Converted(name, saved)
    return convert.to_litert(saved, name, folder / f"{name}.tflite", calibration)


def measure_kept(cfg: DictConfig, tracker, run_dir: Path, data: Data | None = None) -> dict:
    """Measure the run's kept model as deployed (module docstring); returns the metrics. A run
    that kept no model is said so in one line, and nothing is measured."""
    why = no_model(run_dir)
    if why is not None:
        print(f"tfmemlab: deploy: {why}", flush=True)
        tracker.set_tags({"deploy/skipped": why})
        return {}
    d = cfg.deploy
    model = load_file(run_dir / FILE, cfg.precision.policy)
    data = data or build_data(cfg, takes_images(cfg))
    inputs, targets = _validation(data, cfg.trainer.eval_batches)
    reference = _predict(model, inputs, d.batch_size)
    threads = d.threads or len(os.sched_getaffinity(0))
    kept = ("batch_size", "repeats", "warmup", "warmup_s", "min_time_s", "rounds")
    settings = {"threads": threads, **{k: d[k] for k in kept}}
    settings["calibration_batches"] = d.calibration_batches
    folder = run_dir / FOLDER
    shutil.rmtree(folder, ignore_errors=True)  # a measurement again: this one's files only
    folder.mkdir(parents=True)
    accuracy = compare(reference, reference, targets)["val_accuracy"]  # against itself: no more
    scale = float(np.max(np.abs(reference)))  # what a logit difference is measured against
    keras_row = {**_sizes(run_dir / FILE), "val_accuracy": accuracy, "logit_scale": scale}
    rows = {report.KERAS: {**keras_row, "status": f"the reference; logits up to {scale:.3g}"}}
    print(report.line(report.KERAS, rows[report.KERAS], rows, d.batch_size), flush=True)
    representative, tap = _calibration(data, d.calibration_batches)
    print(f"tfmemlab: deploy: converting {', '.join(d.variants)} ({threads} threads)", flush=True)
    convert.export(model, folder / "saved_model")
    converted = {name: _variant(name, model, cfg, folder, representative) for name in d.variants}
    for name, done in converted.items():
        rows[name] = {"convert_s": done.seconds, "status": done.reason}
        if done.path is not None:
            rows[name].update(_sizes(done.path))
    with tempfile.TemporaryDirectory() as tmp:
        inputs_file = Path(tmp) / "inputs.npy"
        np.save(inputs_file, inputs)
        jobs = {n: _measurement(c, inputs_file, settings) for n, c in converted.items() if c.path}
        print(f"tfmemlab: deploy: measuring {len(jobs)} variant(s) in {d.rounds} round(s)")
        measured = rounds.measure(jobs, d.rounds)
    for name, figures in measured.items():
        if isinstance(figures, str):
            rows[name]["status"] = figures
            continue
        row = rounds.combine(figures)
        rows[name].update({**row, **compare(row.pop("outputs"), reference, targets)})
        rows[name]["status"] = "measured"
    rounds.add_ratios(rows)
    for name in d.variants:
        print(report.line(name, rows[name], rows, d.batch_size), flush=True)
    tags = {"deploy/threads": threads, "deploy/cpu": cpu_model()}
    if rows.get("sparse", {}).get("status") == "measured":
        note = report.xnnpack_sparse()
        print(f"tfmemlab: deploy: {note}", file=sys.stderr, flush=True)
        tags["deploy/xnnpack_sparse"] = note
    drawn = tap.left < Tap(iter(())).left  # the converter drew calibration batches
    calibration = tap.digests["train"] if drawn else None
    if calibration is not None:
        tags["deploy/calibration_digest"] = calibration
    train = _train_digest(tracker)
    header = report.header(settings, calibration, train)
    return report.record(tracker, rows, folder, header, tags, d.batch_size)


def _train_digest(tracker) -> str | None:
    """The run's own data/train_digest tag (runner/track/datasets.py), when it has one."""
    try:
        return tracker.client.get_run(tracker.run_id).data.tags.get("data/train_digest")
    except Exception:  # a lost server: the calibration's digest is logged without it
        return None
