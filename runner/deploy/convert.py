"""The kept Keras model as each deployment variant: a SavedModel (`model.export`) and LiteRT
flatbuffers converted from it with `tf.lite.TFLiteConverter` (still in TF 2.21; Keras 3.15's
own `export(format="litert")` goes through the same converter).

- float32: the converter's defaults.
- float16: weights stored float16 (`target_spec.supported_types=[tf.float16]`), computed float32.
- dynamic_int8: weights int8, activations float (`Optimize.DEFAULT`, no representative data).
- int8: full-integer, inputs and outputs int8, activations calibrated on the representative
  batches the caller gives (the job's own training split, runner/deploy/job.py). A model of
  integer inputs (token ids) has nothing to quantize at its input: not converted, said why.
- sparse: `Optimize.EXPERIMENTAL_SPARSITY`, which stores weights that are >= 30% zeros in a
  sparse format (tensorflow/lite/python/lite.py); made only for a pruned model or one whose
  kernels are mostly zeros, since on a dense model it is the float32 file again.

A variant the converter refuses is a row with the converter's reason in one line, not a failed
run: the other variants are still converted and measured.
"""

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from runner.core.errors import error_line
from runner.core.start import quiet_stderr

SPARSE_AT = 0.3  # the converter's EXPERIMENTAL_SPARSITY encodes weights >= 30% zeros
LITERT = ("float32", "float16", "dynamic_int8", "int8", "sparse")


@dataclass
class Converted:
    """One variant: its file (a .tflite, or the SavedModel's folder), or why there is none."""

    variant: str
    path: Path | None = None
    reason: str | None = None  # one line: the converter's reason, or why it was not tried
    seconds: float = 0.0


def reason(err: BaseException) -> str:
    """The converter's reason in one line: the ops LiteRT lacks when that is it (its message
    is pages of MLIR locations), else the message's first line."""
    text = str(err)
    select = re.search(r"TF Select ops: ([^\n]+)", text)
    if select:
        return f"{type(err).__name__}: ops LiteRT's builtins lack: {select.group(1).strip()}"
    return error_line(err)[:300]


def kernel_zeros(model) -> float:
    """The share of zeros among the model's kernels (weights of rank >= 2)."""
    zeros = total = 0
    for weight in model.weights:
        if len(weight.shape) >= 2:
            value = np.asarray(weight)
            zeros += int(np.count_nonzero(value == 0))
            total += value.size
    return zeros / total if total else 0.0


def export(model, folder: Path) -> Converted:
    """The Keras model as a SavedModel (Keras 3 `model.export`: its serving signature)."""
    started = time.perf_counter()
    logger = logging.getLogger("tensorflow")  # its INFO "Assets written to: ..." under Hydra
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        model.export(str(folder), verbose=False)
    finally:
        logger.setLevel(level)
    return Converted("saved_model", folder, None, time.perf_counter() - started)


def _settings(variant: str, calibration: Callable[[], Iterable] | None):
    """What the converter is told for `variant` (applied to a TFLiteConverter)."""

    def apply(converter) -> None:
        if variant == "sparse":
            converter.optimizations = [tf.lite.Optimize.EXPERIMENTAL_SPARSITY]
        elif variant != "float32":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if variant == "float16":
            converter.target_spec.supported_types = [tf.float16]
        if variant == "int8":
            converter.representative_dataset = calibration
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8

    return apply


def not_tried(variant: str, model, pruned: bool) -> str | None:
    """Why `variant` is not converted for this model, or None."""
    if variant == "int8" and any(not x.dtype.startswith("float") for x in model.inputs):
        kinds = ", ".join(sorted({x.dtype for x in model.inputs}))
        return f"not converted: full-integer int8 quantizes float inputs; this model takes {kinds}"
    if variant == "sparse" and not pruned:
        zeros = kernel_zeros(model)
        if zeros < SPARSE_AT:
            return (
                f"not converted: the kernels are {zeros:.1%} zeros and the model was not pruned "
                f"(EXPERIMENTAL_SPARSITY encodes weights >= {SPARSE_AT:.0%} zeros)"
            )
    return None


def to_litert(
    saved_model: Path, variant: str, out: Path, calibration: Callable[[], Iterable] | None = None
) -> Converted:
    """The SavedModel converted to the LiteRT `variant`, written to `out`; a refusal is the
    returned row's reason."""
    started = time.perf_counter()
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    _settings(variant, calibration)(converter)
    try:
        with quiet_stderr():  # the converter's C++ notices; a refusal is raised, not printed
            flatbuffer = converter.convert()
    except Exception as err:  # the converter's errors (ConverterError and others): one line
        return Converted(variant, None, reason(err), time.perf_counter() - started)
    out.write_bytes(flatbuffer)
    return Converted(variant, out, None, time.perf_counter() - started)
