"""The trained model, kept: `<run dir>/model.keras` and an MLflow logged model (Keras 3 flavour).

    python -m runner.track.model models:/MODEL_ID      # load a run's model, run its example
    python -m runner.track.model runs:/RUN_ID/model --tracking-uri sqlite:///outputs/mlflow.db

At the end of a run that finished its last step (trainer.save_model=true), the model as built
(not checkpointing's wrapper; they share the variables, so it holds the trained weights; a
pruned model's masks belong to the Pruner, so its zeros are in its kernels and nothing needs
stripping) is saved once in MLflow's Keras format, with a signature and an input example (the
first examples of the validation split), and its `.keras` file copied to the run directory.
The logged model is linked to the run as its output (the run page's "Logged models"), and its
URI is the run's tag `model_uri`. A subclassed model without get_config cannot be saved whole:
its weights are kept instead (model.weights.h5, and the tag `model_note`). A failed or
interrupted run keeps no model; a multi-worker
job's chief keeps it; a run whose tracking server is lost keeps the file only.

The explicit client writes what `mlflow.keras.log_model` would (its fluent API uses the global
tracking URI and active run, which tfmemlab does not set); the pip requirements are given,
not inferred (MLflow's inference loads the model again in a fresh process: seconds per run).
Loading needs tfmemlab's own layers (`custom_objects`) and the dtype policy the model was
built under (its layers take the global policy): `load` passes both.
"""

import argparse
import importlib
import inspect
import pkgutil
import shutil
import tempfile
from pathlib import Path

from runner.core.start import import_tensorflow

# Before keras and mlflow import TensorFlow: as a command (python -m runner.track.model) this
# module is the entry point, and TensorFlow's start-up lines are silenced as run.py's are.
tf = import_tensorflow()

import keras  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
from mlflow.entities import LoggedModelOutput, LoggedModelStatus  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.models import Model, infer_signature  # noqa: E402

from runner.core.secrets import move_login_to_env  # noqa: E402
from runner.track.client import add_tracking_uri  # noqa: E402
from runner.track.tracker import Tracker, WorkerTracker  # noqa: E402

NAME = "model"  # the logged model's name: runs:/<run id>/model
FILE = "model.keras"  # in the run directory
WEIGHTS = "model.weights.h5"  # instead, for a model Keras cannot save whole
EXAMPLES = 2  # examples in the input example


def custom_objects() -> dict[str, type]:
    """tfmemlab's own layers (every keras Layer class defined in a module of models/)."""
    import models

    found = {}
    for info in pkgutil.iter_modules(models.__path__):
        module = importlib.import_module(f"models.{info.name}")
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, keras.layers.Layer) and obj.__module__ == module.__name__:
                found[name] = obj
    return found


def input_example(val: tf.data.Dataset, n: int = EXAMPLES) -> np.ndarray:
    """The first `n` inputs of the validation split: the input example and the fixed batch."""
    inputs, _ = next(iter(val))
    return np.asarray(inputs)[:n]


def _requirements() -> list[str]:
    return [f"{m.__name__}=={m.__version__}" for m in (mlflow, keras, tf)]


def _log(tracker: Tracker, folder: Path, step: int) -> str:
    """The MLflow model in `folder` as a logged model of the run; returns its models:/ URI."""
    client, run_id = tracker.client, tracker.run_id
    logged = client.create_logged_model(tracker.experiment_id, name=NAME, source_run_id=run_id)
    try:
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=step)])
        client.log_model_artifacts(logged.model_id, str(folder))
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return f"models:/{logged.model_id}"


def keep_model(
    tracker: Tracker, model: keras.Model, run_dir: Path, example: np.ndarray, step: int
) -> str | None:
    """Save `model` to run_dir/model.keras and log it (see the module docstring); returns the
    logged model's URI, or None when nothing was logged (a non-chief worker logs and keeps
    nothing; a lost server: the file only)."""
    if isinstance(tracker, WorkerTracker):
        return None
    try:
        model.get_config()
    except NotImplementedError:  # a subclassed model without get_config cannot be saved whole
        return _keep_weights(tracker, model, run_dir)
    signature = infer_signature(example, np.asarray(model(example, training=False)))
    metadata = {"dtype_policy": keras.config.dtype_policy().name}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / NAME
        folder.mkdir()  # mlflow.keras.save_model writes the example before making it
        mlflow_model = Model(run_id=tracker.run_id or None, metadata=metadata)
        mlflow.keras.save_model(
            model,
            str(folder),
            mlflow_model=mlflow_model,
            signature=signature,
            input_example=example,
            pip_requirements=_requirements(),
            metadata=metadata,
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "data" / "model.keras", run_dir / FILE)
        uri = tracker.log_model(lambda: _log(tracker, folder, step))
    if uri is not None:
        tracker.set_tags({"model_uri": uri})
    return uri


def _keep_weights(tracker: Tracker, model: keras.Model, run_dir: Path) -> None:
    """A model Keras cannot save whole (a subclassed keras.Model without get_config): its
    weights in run_dir/model.weights.h5, logged as an artifact, and a note on how to use them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / WEIGHTS
    model.save_weights(path)
    note = (
        f"{type(model).__name__} has no get_config, so Keras cannot save it whole; its trained "
        f"weights are in {path} (and the run's artifacts): build it again with its builder, "
        "then model.load_weights(that file)"
    )
    print(f"tfmemlab: model: {note}", flush=True)
    tracker.set_tags({"model_note": note})
    tracker.log_artifact(path, NAME)
    return None


def load(uri: str) -> keras.Model:
    """A model kept by a run (models:/<id>, runs:/<run id>/model, or a local MLflow model
    folder), with tfmemlab's layers and under the dtype policy it was trained with."""
    info = mlflow.models.get_model_info(uri)
    policy = (info.metadata or {}).get("dtype_policy", "float32")
    return _under(policy, lambda: mlflow.keras.load_model(uri, custom_objects=custom_objects()))


def load_file(path: Path, policy: str) -> keras.Model:
    """A run's kept `model.keras` file (runner/deploy/ measures it), with tfmemlab's layers,
    under the dtype policy it was trained with (the run's precision.policy)."""
    return _under(policy, lambda: keras.saving.load_model(path, custom_objects=custom_objects()))


def _under(policy: str, load_model) -> keras.Model:
    """load_model() with `policy` as the global dtype policy (a model's layers take it)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return load_model()
    finally:
        keras.config.set_dtype_policy(previous)


def command_line() -> argparse.ArgumentParser:
    """The command line of `python -m runner.track.model`."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.track.model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("uri", help="models:/<model id> or runs:/<run id>/model")
    add_tracking_uri(parser)
    return parser


def main(argv: list[str] | None = None) -> np.ndarray:
    """Load the model and run it on its own input example; print what it gives."""
    args = command_line().parse_args(argv)
    mlflow.set_tracking_uri(move_login_to_env(args.tracking_uri))
    try:
        model = load(args.uri)
        with tempfile.TemporaryDirectory() as tmp:
            local = mlflow.artifacts.download_artifacts(args.uri, dst_path=tmp)
            example = Model.load(local).load_input_example(local)
    except MlflowException as err:  # no such run, model or folder: MLflow's words, one line
        raise SystemExit(f"error: {args.uri}: {str(err.message).splitlines()[0]}") from None
    outputs = np.asarray(model(np.asarray(example), training=False))
    print(f"{args.uri}: {model.name}, {model.count_params():,} parameters")
    print(f"input example {np.shape(example)} -> outputs {outputs.shape} {outputs.dtype}")
    return outputs


if __name__ == "__main__":
    main()
