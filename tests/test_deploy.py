"""deploy=litert (issue 49): the kept model converted for real (tf.lite's converter), each
variant run by the real LiteRT runtime (ai_edge_litert) in a fresh process, its figures in a
real SQLite MLflow store; and the deploy group's bad input.

One tiny pruned MobileNet run that measures every variant is shared by the tests that only read
it; the tests that change what is measured (a perturbed conversion, a token model, the command
on a run already trained) measure again in a folder of their own, or last, as said.
"""

import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.config.schema import DEPLOY_VARIANTS
from runner.deploy import child, convert, report, rounds
from runner.deploy import target as deploy_target
from runner.deploy.child import file_digest
from runner.deploy.job import measure_kept
from runner.track import model as track_model
from runner.track.client import scratch_store
from runner.track.tracker import Tracker
from runner.train import run
from tests.conftest import REPO, run_cli, tiny_overrides

# Quick settings: 3 timed calls after 1 (no time floors), batch 4, 2 rounds; 2 calibration
# batches (the 2 a digest hashes).
QUICK = ["deploy.batch_size=4", "deploy.repeats=3", "deploy.warmup=1", "deploy.rounds=2"]
QUICK += ["deploy.warmup_s=0", "deploy.min_time_s=0"]  # no time floors: counts alone
DEPLOY = ["deploy=litert", "trainer.save_model=true", "deploy.calibration_batches=2", *QUICK]
# BatchNorm statistics re-estimated before the model is kept: with the initial ones, 3 steps
# leave logits that hardly depend on the input, and a quantized model would pass for float32.
SETTLED = ["trainer.bn_recalibrate=2"]
# Pruned at 50% from step 2 (of 3), so the sparse variant is made too.
PRUNED = ["pruning=constant", "pruning.frequency=2"]
# Named here, not read from runner/deploy/report.py: a figure dropped there must fail here.
LITERT_FIGURES = {
    "file_bytes", "file_gzip_bytes", "convert_s", "load_ms", "latency_b1_p50_ms",
    "latency_b1_p90_ms", "latency_batch_p50_ms", "latency_batch_p90_ms", "rss_growth_bytes",
    "val_accuracy", "agreement", "max_logit_diff", "rounds",
}  # fmt: skip
# A LiteRT variant's latency ratios to float32 LiteRT, with their intervals over the rounds.
RATIO_FIGURES = {
    f"{ratio}{end}" for ratio in ("b1_vs_float32", "batch_vs_float32") for end in ("", "_lo", "_hi")
}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(store, result, run directory, MLflow run) of the shared run."""
    folder = tmp_path_factory.mktemp("deploy")
    store = scratch_store(folder)
    cfg = compose_config([*tiny_overrides("mobilenet", store), *PRUNED, *SETTLED, *DEPLOY])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = run(cfg)
    mlrun = MlflowClient(store).get_run(result["run_id"])
    return store, result, Path(mlrun.data.tags["run_dir"]), mlrun


@pytest.mark.slow
def test_float32_litert_predicts_what_keras_predicts(deployed):
    """Same top-1 on every validation example, logits within 1e-4 of their scale: the
    converter folds BatchNorm into the convolutions and sums in another order, so the
    settled tiny MobileNet's logits (up to ~10) differ by ~3e-4 (its SavedModel by ~6e-5);
    with the initial BatchNorm statistics they were within 1e-8, and so was no quantization."""
    _, result, _, _ = deployed
    scale = result["deploy/keras/logit_scale"]
    assert result["deploy/float32/agreement"] == 1.0
    assert result["deploy/float32/max_logit_diff"] <= 1e-4 * max(scale, 1.0)
    assert result["deploy/float32/val_accuracy"] == result["deploy/keras/val_accuracy"]
    # The bound tells float32 from a quantized model on these logits:
    assert result["deploy/dynamic_int8/max_logit_diff"] > 1e-2 * scale


@pytest.mark.slow
def test_every_variant_is_measured_and_every_figure_lands_in_the_run(deployed):
    store, _, run_dir, mlrun = deployed
    assert mlrun.info.status == "FINISHED"
    tags, metrics = mlrun.data.tags, mlrun.data.metrics
    for variant in DEPLOY_VARIANTS:
        assert tags[f"deploy/{variant}/status"] == "measured", variant
        wanted = LITERT_FIGURES | ({"tf_peak_bytes"} if variant == "saved_model" else set())
        wanted |= RATIO_FIGURES if variant not in ("saved_model", "float32") else set()
        assert {k for k in metrics if k.startswith(f"deploy/{variant}/")} == {
            f"deploy/{variant}/{figure}" for figure in wanted
        }
    assert tags["deploy/xnnpack_sparse"] == report.xnnpack_sparse()
    assert metrics["deploy/float32/rounds"] == 2
    for variant in ("float16", "dynamic_int8", "int8", "sparse"):  # medians' ratio, interval
        ratio = metrics[f"deploy/{variant}/b1_vs_float32"]
        assert ratio == pytest.approx(
            metrics[f"deploy/{variant}/latency_b1_p50_ms"]
            / metrics["deploy/float32/latency_b1_p50_ms"]
        )
        assert metrics[f"deploy/{variant}/b1_vs_float32_lo"] <= ratio
        assert ratio <= metrics[f"deploy/{variant}/b1_vs_float32_hi"]
    artifacts = {a.path for a in MlflowClient(store).list_artifacts(mlrun.info.run_id, "deploy")}
    assert artifacts == {f"deploy/{v}.tflite" for v in DEPLOY_VARIANTS if v != "saved_model"}
    table = (run_dir / "deploy" / "deploy.md").read_text()
    assert all(f"| {v} |" in table for v in ("keras", *DEPLOY_VARIANTS))
    # The logged model stays the Keras model.
    assert tags["model_uri"].startswith("models:/")
    assert (run_dir / track_model.FILE).is_file()


@pytest.mark.slow
def test_each_variant_is_measured_on_its_own_file(deployed):
    """The digest the fresh process took of the file it loaded is the variant's file's, and
    the files differ as their variants must (int8 smaller than float32)."""
    _, result, run_dir, mlrun = deployed
    folder = run_dir / "deploy"
    for variant in DEPLOY_VARIANTS:
        path = folder / ("saved_model" if variant == "saved_model" else f"{variant}.tflite")
        assert mlrun.data.tags[f"deploy/{variant}/sha256"] == file_digest(path), variant
    assert len({mlrun.data.tags[f"deploy/{v}/sha256"] for v in DEPLOY_VARIANTS}) == 6
    f32 = result["deploy/float32/file_bytes"]
    assert f32 == (folder / "float32.tflite").stat().st_size
    assert result["deploy/int8/file_bytes"] < 0.5 * f32
    assert result["deploy/float16/file_bytes"] < 0.6 * f32
    assert result["deploy/sparse/file_bytes"] < f32  # 50% zeros, sparse-encoded


@pytest.mark.slow
def test_int8_is_calibrated_on_the_jobs_own_training_batches(deployed):
    """The calibration batches hash to the run's training digest (its first batches, as the
    loop drew them: runner/track/datasets.py)."""
    _, _, _, mlrun = deployed
    tags = mlrun.data.tags
    assert tags["deploy/calibration_digest"] == tags["data/train_digest"]


def _perturbed_export(model, folder):
    """Export a copy whose last bias favours the class the Keras model predicts least."""
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    bias = [layer for layer in clone.layers if getattr(layer, "bias", None) is not None][-1].bias
    predicted = np.argmax(np.asarray(model(np.zeros((1, *model.input_shape[1:])))), -1)
    counts = np.bincount(predicted, minlength=bias.shape[0])
    bias.assign(bias + 1000.0 * (np.arange(bias.shape[0]) == np.argmin(counts)))
    return ORIGINAL_EXPORT(clone, folder)


ORIGINAL_EXPORT = convert.export


def _copy_run(run_dir: Path, into: Path) -> Path:
    """The run's model and run.json in a folder of their own (its deploy/ left alone)."""
    into.mkdir()
    for name in (track_model.FILE, "run.json"):
        shutil.copy(run_dir / name, into / name)
    return into


@pytest.mark.slow
def test_agreement_is_against_the_keras_model_not_the_variant(deployed, tmp_path, monkeypatch):
    """A float32 variant converted from a perturbed copy must disagree with the Keras model:
    agreement computed against the variant itself (or the SavedModel) would read 100%."""
    store, _, run_dir, _ = deployed
    copy = _copy_run(run_dir, tmp_path / "copy")
    cfg = compose_config([*tiny_overrides("mobilenet", store), *PRUNED, *DEPLOY])
    cfg.deploy.variants = ["float32"]
    monkeypatch.setattr(convert, "export", _perturbed_export)
    client = MlflowClient(scratch_store(tmp_path))
    throwaway = client.create_run(client.create_experiment("perturbed")).info.run_id
    figures = measure_kept(cfg, Tracker(client, throwaway), copy)
    assert figures["deploy/float32/agreement"] < 1.0
    assert figures["deploy/float32/max_logit_diff"] > 100.0


@pytest.mark.slow
def test_a_sweep_compares_the_variants_of_its_jobs(tmp_path, store):
    """`python run.py -m pruning=none,constant,structured deploy=litert` on the tiny
    transformer, as a user runs it: each job's float32 LiteRT predicts what its Keras model
    predicts (its position ids are a running count, which LiteRT's builtins run; `zeros +
    arange` lowered to an int32 BiasAdd they lack), its int8 row says why it is not tried
    (token inputs), and the sweep's report has the deployment table, divided by the
    baseline's float32 file, and the accuracy-against-latency-and-size picture. The
    structured job's files are of its smaller model: its float32 file is smaller than the
    baseline's, and it has no sparse file (its kernels are dense)."""
    args = ["-m", "pruning=none,constant,structured", "++pruning.frequency=2"]
    args += ["sweep.isolate=false"]
    args += [*tiny_overrides("transformer"), *DEPLOY, "deploy.variants=[float32,int8,sparse]"]
    args += ["deploy.rounds=1"]
    done = run_cli(args, cwd=tmp_path, env={"MLFLOW_TRACKING_URI": store})
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("sweep") == "parent")
    jobs = sorted((r for r in runs if r is not parent and r.data.tags.get("sweep") != "parent"),
                  key=lambda r: int(r.data.tags["job_num"]))  # fmt: skip
    for job in jobs:
        tags, metrics = job.data.tags, job.data.metrics
        assert job.info.status == "FINISHED"
        assert tags["deploy/int8/status"].startswith("not converted: full-integer int8")
        assert tags["deploy/float32/status"] == "measured"
        assert metrics["deploy/float32/agreement"] == 1.0
        bound = 1e-4 * metrics["deploy/keras/logit_scale"]
        assert metrics["deploy/float32/max_logit_diff"] <= bound
    dense, pruned, structured = (j.data.metrics for j in jobs)
    assert "deploy/sparse/file_bytes" not in dense and "deploy/sparse/file_bytes" in pruned
    assert "deploy/sparse/file_bytes" not in structured
    # The deployment table: every (job, variant), each divided by the baseline's float32 file.
    table = (tmp_path / "outputs" / "multirun").glob("*/*/deploy_comparison.csv")
    with next(table).open() as f:
        rows = {(r["job"], r["variant"]): r for r in csv.DictReader(f)}
    assert {v for j, v in rows if j == "baseline"} == {"keras", "float32", "int8", "sparse"}
    assert rows[("baseline", "sparse")]["status"].startswith("not converted: the kernels are")
    assert float(rows[("baseline", "float32")]["gzip/base"]) == 1.0
    gzip = float(rows[("pruning=constant", "float32")]["gzip/base"])
    assert gzip == pytest.approx(
        pruned["deploy/float32/file_gzip_bytes"] / dense["deploy/float32/file_gzip_bytes"]
    )
    assert gzip < 0.95, gzip  # half the kernels zero: the gzipped file is smaller
    # One head of two and half the MLP units removed: the float32 file itself is smaller,
    # as the run's smaller model (its params) says.
    small = rows[("pruning=structured", "float32")]
    assert float(small["file/base"]) == pytest.approx(
        structured["deploy/float32/file_bytes"] / dense["deploy/float32/file_bytes"]
    )
    assert float(small["file/base"]) < 0.9, small  # 0.84 read: the file has its own overhead
    assert structured["params/total"] < 0.8 * dense["params/total"]
    assert rows[("pruning=structured", "sparse")]["status"].startswith("not converted")
    assert "deployment: /base divides by the baseline job's (baseline) float32" in done.stdout
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/deploy_comparison.md", "report/deploy_pareto.png"} <= report


def test_rounds_run_round_robin_and_ratios_pair_them():
    """Round r measures every variant once, in order; a ratio's interval resamples each round's
    two measurements together, so a machine slow in one round and fast in another moves both
    (1.1x in every round: the interval is [1.1, 1.1], where resampled apart it is wide); a
    variant that fails is not measured again; rounds of different files are refused."""
    order = []

    def job(name, per_round):
        def measure():
            order.append(name)
            ms = per_round[sum(n == name for n in order) - 1]
            return {"sha256": name, "latency_b1_p50_ms": ms, "latency_batch_p50_ms": 2 * ms}

        return measure

    def fails():
        order.append("int8")
        raise RuntimeError("the runtime refused it\nat line 2")

    slow_and_fast = [1.0, 4.0, 2.0]
    jobs = {"float32": job("float32", slow_and_fast), "int8": fails}
    jobs["float16"] = job("float16", [1.1 * ms for ms in slow_and_fast])
    measured = rounds.measure(jobs, 3)
    assert order == ["float32", "int8", "float16", "float32", "float16", "float32", "float16"]
    assert measured["int8"] == "not measured: RuntimeError: the runtime refused it"
    rows = {name: rounds.combine(measured[name]) for name in ("float32", "float16")}
    assert rows["float16"]["latency_b1_p50_ms"] == pytest.approx(2.2)  # the rounds' median
    rounds.add_ratios(rows)
    f16 = rows["float16"]
    assert (f16["b1_vs_float32_lo"], f16["b1_vs_float32_hi"]) == pytest.approx((1.1, 1.1))
    assert rounds.ratio_text(f16, "b1_vs_float32") == "1.10x float32 [1.10, 1.10]"
    with pytest.raises(RuntimeError, match="different files"):
        rounds.combine([{"sha256": "a"}, {"sha256": "b"}])


def test_a_model_the_converter_refuses_is_its_reason_in_one_line(tmp_path):
    """A real refusal: positions made as `zeros + arange` (an int32 BiasAdd after TensorFlow's
    rewrites) are refused by the converter, and the row's reason names the op."""
    tokens = keras.Input((8,), dtype="int32")
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(8, dtype="int32")
    x = keras.layers.Embedding(16, 4)(tokens) + keras.layers.Embedding(8, 4)(positions)
    model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(x)))
    saved = convert.export(model, tmp_path / "saved_model").path
    done = convert.to_litert(saved, "float32", tmp_path / "float32.tflite")
    assert done.path is None and not (tmp_path / "float32.tflite").exists()
    assert done.reason == "ConverterError: ops LiteRT's builtins lack: BiasAdd", done.reason


def test_the_reasons_are_one_line():
    """A converter's pages of MLIR become the ops LiteRT lacks; a token model is not int8."""
    text = (
        "Could not translate MLIR.\n<unknown>:0: error: loc(...)\nTF Select ops: BiasAdd\nDetails"
    )
    assert convert.reason(RuntimeError(text)) == "RuntimeError: ops LiteRT's builtins lack: BiasAdd"
    tokens = keras.Input((8,), dtype="int32")
    model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.Embedding(16, 4)(tokens)))
    why = convert.not_tried("int8", model, pruned=False)
    assert why.startswith("not converted: full-integer int8") and "int32" in why
    assert "\n" not in why
    assert "0.0% zeros" in convert.not_tried("sparse", model, pruned=False)
    assert convert.not_tried("sparse", model, pruned=True) is None


def test_deploy_command_on_a_run_that_kept_no_model_is_one_line(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x", "config": {}}))
    done = subprocess.run(
        [sys.executable, "-m", "runner.deploy", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip() == (
        f"error: {tmp_path} kept no model (model.keras): it ran with trainer.save_model=false, "
        "or failed or was stopped before its last step"
    )


def test_the_files_named_before_tensorflow_loads_are_the_kept_ones():
    assert (deploy_target.FILE, deploy_target.WEIGHTS) == (track_model.FILE, track_model.WEIGHTS)


def test_deploy_none_imports_nothing_of_it():
    """The default run's pipeline imports neither runner.deploy nor the LiteRT runtime."""
    code = (
        "import sys\nimport runner.train.pipeline\n"
        "loaded = [m for m in ('runner.deploy', 'ai_edge_litert') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_deploy_command_logs_into_the_same_run(deployed):
    """`python -m runner.deploy models:/ID` (the model the shared run logged; last: it measures
    it again, int8 only): the same run, still FINISHED, calibrated on the same batches. A
    runs:/ URI and the models:/ URI name the same run directory."""
    store, _, run_dir, mlrun = deployed
    model_uri = mlrun.data.tags["model_uri"]
    for given in (f"runs:/{mlrun.info.run_id}", model_uri):
        target = deploy_target.locate(given, store, [])
        assert (target.run_id, target.run_dir) == (mlrun.info.run_id, run_dir), given
    with pytest.raises(deploy_target.DeployTargetError, match="^models:/m-nothing: "):
        deploy_target.locate("models:/m-nothing", store, [])
    args = ["-m", "runner.deploy", model_uri, "--tracking-uri", store]
    done = subprocess.run(
        [sys.executable, *args, "deploy.variants=[int8]", *QUICK],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tfmemlab: deploy int8: " in done.stdout
    after = MlflowClient(store).get_run(mlrun.info.run_id)
    assert after.info.status == "FINISHED"
    assert after.data.tags["deploy/calibration_digest"] == after.data.tags["data/train_digest"]
    history = MlflowClient(store).get_metric_history(mlrun.info.run_id, "deploy/int8/file_bytes")
    assert len(history) == 2  # the run's own measurement and the command's


def test_latency_warms_up_and_times_for_at_least_its_seconds_past_its_counts():
    """deploy.warmup_s and deploy.min_time_s: calls of a microsecond go on past the counts
    until the seconds are spent (a count alone timed sub-millisecond models while they were
    still settling); with no seconds, the counts alone."""
    calls = []

    def call(x):
        calls.append(time.perf_counter())
        return x

    settings = {"warmup": 2, "repeats": 3, "warmup_s": 0.05, "min_time_s": 0.1}
    child._latency(call, np.zeros(1), settings)
    assert len(calls) > 100 and calls[-1] - calls[0] >= 0.14
    calls.clear()
    child._latency(call, np.zeros(1), {**settings, "warmup_s": 0, "min_time_s": 0})
    assert len(calls) == 5
