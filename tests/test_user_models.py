"""Models of one's own (issue 28): a `_target_` in a model YAML of the user's config folder,
and `model=keras_app`. The real conf/ with examples/conf beside it, as `--config-dir` adds it;
tiny sizes and a few steps; each bad input answered in one line."""

import os
import shutil
import signal
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from models.spec import KERAS_APPLICATIONS, DataSpec
from runner.cli import check_command_line
from runner.config import compose_config
from runner.core.errors import Interrupted, ModelError
from runner.techniques import pruning
from runner.train.batchnorm import initial_share
from runner.train.pipeline import run
from runner.train.usermodel import build_target
from tests.conftest import REPO, run_cli
from tests.test_resume import final_state

EXAMPLES = REPO / "examples"
TINY = [
    "data.image_size=8",
    "data.batch_size=4",
    "trainer.max_steps=3",
    "trainer.progress=false",
    "trainer.save_model=false",
]
SYNTHETIC = ["data.train_samples=64", "data.val_samples=16"]
# A CLI run's environment: examples/ importable (its my_models.py), as a user's PYTHONPATH.
EXAMPLES_ON_PATH = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
}


@pytest.fixture
def user_cfg(store, monkeypatch, tmp_path):
    """examples/conf beside conf/, examples/ importable, runs in a temp folder."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        data = [] if "data=digits" in overrides else SYNTHETIC
        extra = [*TINY, *data, f"mlflow.tracking_uri={store}", *overrides]
        return compose_config(extra, config_dir=EXAMPLES / "conf")

    return make


# Pairwise over model x precision and precision x accum (every pair once), with the U-Net's
# policies none/blocks each at accum 1 and 4 (none at accum 1 in the BatchNorm test below): the
# U-Net (functional, skip connections) and the subclassed model (images, and tokens once).
CASES = [
    ("unet", "fp32", 4, "blocks", ["trainer.save_model=true"]),
    ("unet", "mixed", 1, "blocks", []),
    ("unet", "bf16", 4, "none", []),
    ("subclassed", "fp32", 1, "none", ["trainer.save_model=true"]),
    ("subclassed", "mixed", 4, "none", []),
    ("subclassed", "bf16", 1, "none", ["model.input_kind=tokens", "data.seq_len=8"]),
]


@pytest.mark.parametrize(("model", "precision", "accum", "policy", "extra"), CASES)
def test_own_models_train_under_each_technique(
    user_cfg, store, model, precision, accum, policy, extra
):
    cfg = user_cfg(
        f"model={model}", f"precision={precision}", f"accum={accum}", f"checkpointing={policy}",
        *extra,
    )  # fmt: skip
    result = run(cfg)
    assert result["steps"] == 3 and np.isfinite(result["train/final_loss"])
    run_ = MlflowClient(tracking_uri=store).get_run(result["run_id"])
    assert run_.data.params["model.name"] == {"unet": "unet", "subclassed": "TinyNet"}[model]
    if model == "unet":  # a functional graph: the estimate's graph rules reach it
        assert result["mem/estimate/activations_bytes"] > 0
        assert result["mem/estimate_bytes"] > 0
        assert (result.get("remat/segments") or 0) == (2 if policy == "blocks" else 0)
    else:  # subclassed: no activations figure, a tag saying why
        assert "mem/estimate_bytes" not in result
        assert "mem/estimate/activations_bytes" not in result
        assert "not modelled" in run_.data.tags["mem/estimate_note"]
        assert result["mem/estimate/params_bytes"] > 0
    if "trainer.save_model=true" in extra:  # kept whole, or (no get_config) its weights
        run_dir = Path(run_.data.tags["run_dir"])
        if model == "unet":
            assert (run_dir / "model.keras").is_file() and run_.data.tags["model_uri"]
        else:
            assert (run_dir / "model.weights.h5").is_file()
            assert "no get_config" in run_.data.tags["model_note"]
            assert "model_uri" not in run_.data.tags


def test_under_xla_a_subclassed_cnn_is_estimated_by_xlas_own_plan(tmp_path, store):
    # Without XLA a subclassed model's activations are not modelled (no total: above). Compiled
    # by XLA, its step is XLA's to plan whatever its layers (runner/estimate/xla_plan.py): the
    # estimate is the plan's, beside the allocator's peak of the same run. CNNs under XLA were
    # "not fitted" before (seed 29's draws: 0.82-1.58 of the rules' estimate).
    # A fresh process, as a user runs it: in a CI suite worker, after other tests in the same
    # process (whose allocator pool it shares: runner/core/process.py), the peak read 51.1 MiB
    # against the plan's 31.5 (1.62); alone, 0.95-1.05.
    job = ["model=subclassed", "trainer.jit_compile=true", "data.image_size=48"]
    job += ["data.batch_size=32", *SYNTHETIC, f"mlflow.tracking_uri={store}"]
    done = run_cli(
        ["--config-dir", str(EXAMPLES / "conf"), *TINY, *job, f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        EXAMPLES_ON_PATH,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=store)
    (run_,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    result, tags = run_.data.metrics, run_.data.tags
    assert result["mem/estimate/xla_plan_bytes"] > 0
    assert "mem/estimate/gradients_bytes" not in result  # among the plan's buffers
    ratio = result["mem/peak_bytes"] / result["mem/estimate_bytes"]
    assert 0.95 <= ratio <= 1.05, {k: v for k, v in result.items() if k.startswith("mem/")}
    assert tags["mem/estimate_source"].startswith("xla_plan"), tags
    assert "mem/estimate_note" not in tags


def test_subclassed_model_refuses_graph_checkpointing_in_one_line(user_cfg):
    with pytest.raises(ModelError, match=r"checkpointing=blocks: .*subclassed.*none"):
        run(user_cfg("model=subclassed", "checkpointing=blocks"))


def test_keras_app_trains_a_light_application_by_name(user_cfg):
    cfg = user_cfg(
        "model=keras_app", "model.name=MobileNetV3Small", "data.image_size=32",
        "trainer.max_steps=2",
    )  # fmt: skip
    result = run(cfg)
    assert result["steps"] == 2 and np.isfinite(result["train/final_loss"])


def test_keras_app_list_is_keras_applications_own():
    own = [n for n in dir(keras.applications) if n[0].isupper()]
    assert sorted(KERAS_APPLICATIONS) == sorted(own)


def test_short_batchnorm_run_says_statistics_are_unsettled_and_recalibration_helps(user_cfg):
    """At momentum 0.99, 0.99^40 = 67% of the initial statistics remain after 40 updates. On a
    short U-Net run on real digits, re-estimating the statistics on training batches lowers
    val/loss (measured: 2.83 -> 1.62 at the last of three evaluations). It changes nothing in
    training (BatchNorm trains on batch statistics): its batches come from a copy of the
    training pipeline, as a second iterator of the training split itself would reorder the
    epochs after it (the losses of the 3rd epoch differed). 33 steps, 3 epochs of ~11."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(momentum=0.99)])
    assert initial_share(model, 40) == pytest.approx(0.669, abs=1e-3)
    assert initial_share(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), 40) is None
    base = ["model=unet", "data=digits", "data.batch_size=8", "data.val_fraction=0.95"]
    base += ["trainer.max_steps=33", "trainer.eval_every=11", "trainer.eval_batches=4"]
    base += ["trainer.lr=0.01"]
    plain = run(user_cfg(*base))
    client = MlflowClient(tracking_uri=user_cfg().mlflow.tracking_uri)
    assert "have not settled" in client.get_run(plain["run_id"]).data.tags["mlflow.note.content"]
    recalibrated = run(user_cfg(*base, "trainer.bn_recalibrate=8"))
    assert recalibrated["val/loss"] < plain["val/loss"]
    losses = [
        [m.value for m in sorted(client.get_metric_history(r["run_id"], "train/loss"), key=_step)]
        for r in (plain, recalibrated)
    ]
    assert len(losses[0]) == 33
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def _step(metric) -> int:
    return metric.step


def test_pruning_picks_a_user_models_kernels_by_type(user_cfg):
    cfg = user_cfg("model=unet", "pruning=constant")
    model = build_target(cfg.model, DataSpec("image", (8, 8, 3), 10))
    chosen = {v.path for v in pruning.select_kernels(model, cfg.pruning)}
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    # every conv kernel but the first (it sees raw pixels), and the Dense head's
    assert chosen == {layer.kernel.path for layer in convs[1:]} | {"head/kernel"}


# --- bad input: one line each ----------------------------------------------------------

BUILDERS = """
import keras

def raises(spec):
    raise RuntimeError("filters must be even")

def not_a_model(spec):
    return "a model"

def wrong_classes(spec):
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.GlobalAveragePooling2D()(inputs)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes + 1)(x))

def wrong_input(spec):
    inputs = keras.Input((64, 64, 3))
    x = keras.layers.GlobalAveragePooling2D()(inputs)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))

def softmax_head(spec):
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.GlobalAveragePooling2D()(inputs)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, activation="softmax")(x))
"""


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("bad_builders.raises", r"failed to build: RuntimeError: filters must be even"),
        ("bad_builders.not_a_model", r"returned str, not a keras.Model"),
        ("bad_builders.wrong_classes", r"outputs shape \(11,\), the data needs \(10,\)"),
        ("bad_builders.wrong_input", r"takes inputs of shape \(64, 64, 3\), the data gives"),
        ("bad_builders.softmax_head", r"outputs probabilities .*takes logits"),
    ],
)
def test_a_bad_builder_is_one_line(tmp_path, monkeypatch, target, message):
    (tmp_path / "bad_builders.py").write_text(BUILDERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = OmegaConf.create({"_target_": target, "name": "mine"})
    with pytest.raises(ModelError, match=message) as err:
        build_target(model, DataSpec("image", (8, 8, 3), 10))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("files", "args", "printed"),
    [
        (
            {"model/mine.yaml": "_target_: nowhere.build\n"},
            ["model=mine"],
            "error: model._target_=nowhere.build: no module named 'nowhere' in the current "
            "directory or on PYTHONPATH",
        ),
        (
            {"model/mine.yaml": "_target_: my_models.unit\n"},
            ["model=mine"],
            "error: model._target_=my_models.unit: module 'my_models' "
            f"({EXAMPLES / 'my_models.py'}) has no 'unit'; did you mean unet?",
        ),
        (
            {"model/mine.yaml": "_target_: my_models.unet\nfilters: [8\nblocks: 2\n"},
            ["model=mine"],
            "error: {dir}/model/mine.yaml:3: malformed YAML (expected ',' or ']', but got ':'; "
            "while parsing a flow sequence from line 2)",
        ),
        (
            {},
            ["model=keras_app", "model.name=resnet50"],
            "error: model.name=resnet50: not a keras.applications model; close: ResNet50, "
            "ResNet50V2, ResNet152, ResNet101",
        ),
    ],
)
def test_bad_input_on_the_command_line_is_one_line(tmp_path, monkeypatch, files, args, printed):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    conf = tmp_path / "myconf"
    (conf / "model").mkdir(parents=True)
    for name, text in files.items():
        (conf / name).write_text(textwrap.dedent(text))
    with pytest.raises(SystemExit) as exit_:
        check_command_line(["--config-dir", str(conf), *args])
    assert exit_.value.code == printed.format(dir=conf)


@pytest.mark.parametrize(
    ("model", "technique"),
    [("unet", ["accum=2", "checkpointing=blocks"]), ("subclassed", ["precision=mixed"])],
)
def test_a_user_model_stopped_by_sigterm_resumes_bitwise_equal(
    user_cfg, tmp_path, monkeypatch, model, technique
):
    """The functional U-Net (BatchNorm statistics, accumulators, rebuilt segments) and the
    subclassed model (float16 loss scale) stopped by a real SIGTERM after step 3 of 6 and
    resumed from their run directories end with every variable and optimizer slot equal to an
    uninterrupted run's, bit for bit (trainer.deterministic)."""
    from run import _one_job
    from runner.train.checkpoint import TrainState

    job = [f"model={model}", *technique, "trainer.max_steps=6", "trainer.checkpoint_every=1"]
    job += ["trainer.deterministic=true"]
    whole = run(user_cfg(*job))
    save = TrainState.save

    def save_then_signal(state, step):
        path = save(state, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run: it stops after step 3
        return path

    with monkeypatch.context() as patch:
        patch.setattr(TrainState, "save", save_then_signal)
        with pytest.raises(Interrupted):
            run(user_cfg(*job))
    runs = tmp_path / "outputs" / "runs"
    (stopped,) = [d for d in runs.iterdir() if d.name != whole["run_id"]]
    client = MlflowClient(tracking_uri=user_cfg().mlflow.tracking_uri)
    assert client.get_run(stopped.name).info.status == "KILLED"
    _one_job(user_cfg(*job, f"trainer.resume={stopped}"))
    resumed = client.get_run(stopped.name)
    assert resumed.info.status == "FINISHED" and resumed.data.tags["resumed_from_step"] == "3"
    expected, got = final_state(runs / whole["run_id"]), final_state(stopped)
    assert expected.keys() == got.keys() and len(got) > 10
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow  # three processes (the sweep, two jobs): about 45 s of CPU
def test_a_sweep_of_user_models_runs_each_job_apart_from_the_users_folder(tmp_path, store):
    """`python run.py -m --config-dir myconf model=unet,subclassed` from the folder that holds
    the user's module, not on PYTHONPATH: each job's fresh process (sweep.isolate) composes
    the user's YAML and imports the module as the sweep's process does."""
    shutil.copytree(EXAMPLES / "conf", tmp_path / "myconf")
    shutil.copy(EXAMPLES / "my_models.py", tmp_path)
    result = run_cli(
        ["-m", "--config-dir", "myconf", "model=unet,subclassed", *TINY, *SYNTHETIC]
        + [f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path,
        {"PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    jobs = {r.data.params.get("model.name"): r for r in runs if "model.name" in r.data.params}
    assert jobs.keys() == {"unet", "TinyNet"}
    assert all(r.info.status == "FINISHED" for r in jobs.values())
    pids = {r.data.tags.get("pid") for r in jobs.values()}
    assert len(pids) == 2 and None not in pids, pids  # each in a process of its own


@pytest.mark.slow  # one fresh process (its CPU split into two logical devices): about 20 s
def test_a_user_model_mirrored_on_two_devices_equals_one_device(user_cfg, tmp_path, store):
    """The subclassed model (on tokens: no BatchNorm, whose per-replica statistics would
    differ by design) under MirroredStrategy on 2 logical CPUs, 4 examples a replica, ends
    with the weights of one device at 8 (SGD, so a gradient off by a factor shows)."""
    job = ["model=subclassed", "model.input_kind=tokens", "data.seq_len=8", "trainer.max_steps=4"]
    job += ["trainer.checkpoint_every=4", "trainer.optimizer=sgd", "trainer.lr=0.5"]
    job += ["trainer.momentum=0.0", *SYNTHETIC]
    one = run(user_cfg(*job, "data.batch_size=8"))
    two_dir = tmp_path / "two"
    result = run_cli(
        ["--config-dir", str(EXAMPLES / "conf"), *TINY, *job, "data.batch_size=4"]
        + ["distribution=mirrored", "distribution.logical_cpus=2"]
        + [f"mlflow.tracking_uri={store}", f"hydra.run.dir={two_dir}"],
        tmp_path,
        EXAMPLES_ON_PATH,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(tracking_uri=store)
    (two,) = [r for r in client.search_runs([client.get_run(one["run_id"]).info.experiment_id])
              if r.info.run_id != one["run_id"]]  # fmt: skip
    assert two.data.params["replicas"] == "2" and two.data.tags["distribution"] == "mirrored"
    single = final_state(Path(client.get_run(one["run_id"]).data.tags["run_dir"]))
    mirrored = final_state(two_dir)
    weights = [n for n in single if n.startswith("model/")]
    assert len(weights) >= 4
    for name in weights:
        np.testing.assert_allclose(mirrored[name], single[name], rtol=0, atol=1e-5, err_msg=name)
