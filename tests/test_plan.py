"""Fit a memory budget (issue 17): runner.plan's table and accum=auto, with real TensorFlow,
real probes in fresh processes and a real MLflow store."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.config import compose_config
from runner.core.errors import ConfigError, DiskFull, Interrupted, PlanError
from runner.core.machine import CACHE_ENV
from runner.core.units import parse_bytes
from runner.plan.__main__ import main
from runner.plan.line import divisors
from runner.plan.probe import probe
from tests.conftest import (
    MEMORY_BOUND,
    NO_MODEL,
    REPO,
    TINY,
    TINY_DATA,
    TINY_TRAINER,
    onednn_off_result,
    run_cli,
    tiny_overrides,
)


def test_budgets_are_read_in_bytes_and_units():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2.5GB") == 2_500_000_000
    assert parse_bytes("1048576") == 2**20
    assert parse_bytes(64) == 64
    for bad in ("8G", "lots", "-1MiB", ""):
        with pytest.raises(PlanError, match=f"plan.budget={bad}: expected bytes or a number"):
            parse_bytes(bad)
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("data.seq_len", 8, "at most 4"),
        DiskFull("/runs/x/ckpt-3", "No space left on device", 2**20, "kept ckpt-2"),
        Interrupted(15, 7, Path("/runs/x")),
    ],
)
def test_an_error_comes_back_whole_from_a_probe_process(error):
    """A probe's error reaches accum=auto pickled (runner/core/process.py): one rebuilt from
    its message alone raised in the pool's result thread, and the parent waited forever."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


def _plan(args: list[str]):
    """`python -m runner.plan ARGS` as a user types it (for what only a real process shows)."""
    return subprocess.run(
        [sys.executable, "-m", "runner.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _plan_here(args: list[str], capsys) -> str:
    """runner.plan's main in this process (the probes it starts are still fresh processes)."""
    main(args)
    return capsys.readouterr().out


def test_bad_plan_input_is_one_line_from_a_real_process():
    result = _plan(["plan.budget=8G"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    expected = "error: plan.budget=8G: not allowed; expected bytes or a number"
    assert result.stderr.strip().startswith(expected), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["plan.margin=1.5"], "error: plan.margin=1.5: not allowed; expected a number in [0, 1)"),
        (["accum=0"], "error: accum=0: not allowed; expected an integer >= 1, or auto"),
        (["accum=many"], "error: accum=many: not allowed; expected an integer >= 1, or auto"),
        (
            ["plan.attention=[standard,flash]"],
            "error: plan.attention=flash: not allowed; expected a list of standard, chunked",
        ),
        ([], "error: plan.budget=null: on a CPU give the memory budget, e.g. plan.budget=8GiB"),
    ],
)
def test_bad_plan_input_is_one_line(args, expected):
    # What Python prints for the SystemExit, and its exit status 1, are the same in a process.
    with pytest.raises(SystemExit) as exit_:
        main(args)
    message = str(exit_.value.code)
    assert message.startswith(expected) and len(message.splitlines()) == 1, message


def test_the_plan_reads_a_model_of_ones_own_from_config_dir(capsys, monkeypatch):
    """`python -m runner.plan --config-dir DIR` composes the user's model YAML as run.py does
    (examples/conf/model/unet.yaml): one row, the estimate of a tiny U-Net, in this process."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # my_models, as PYTHONPATH gives it
    args = ["--config-dir", str(REPO / "examples" / "conf"), "model=unet", "data.image_size=8"]
    one_row = ["plan.precisions=[fp32]", "plan.policies=[none]"]
    budget = ["trainer.effective_batch_size=16", "plan.budget=64MiB"]
    stdout = _plan_here([*args, *one_row, *budget], capsys)
    assert "model=unet, effective batch 16" in stdout
    (row,) = _rows(stdout)
    assert (row["precision"], row["checkpointing"], row["fits"]) == ("fp32", "none", "yes")
    assert 0 < float(row["predicted_MiB"]) < 64


def _rows(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.split()[:2] == ["precision", "checkpointing"]
    )
    header = lines[start].split()
    rows = []
    for line in lines[start + 1 :]:
        cells = line.split(None, len(header) - 1)
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def test_the_plan_predicts_what_the_run_estimates_and_names_the_cheapest_fit(store, capsys):
    """Every precision x checkpointing row, cheapest first; the first line names the cheapest
    row that fits; a row's prediction is the estimate the run itself logs at that micro-batch
    and accum; the next larger micro-batch would not have fit."""
    overrides = [*MEMORY_BOUND, "model.layers=2", "trainer.effective_batch_size=64"]
    stdout = _plan_here([*overrides, "plan.budget=40MiB"], capsys)
    rows = _rows(stdout)
    assert {(r["precision"], r["checkpointing"]) for r in rows} == {
        (p, c) for p in ("fp32", "mixed", "bf16") for c in ("none", "selective", "blocks", "sqrt")
    }
    fitting = [r for r in rows if r["fits"] == "yes"]
    # By predicted time; at equal times a measured (or fp32's) time before a guess, then fewer
    # accumulation steps.
    keys = [
        (float(r["time_ratio"]), r["time_from"].startswith("FLOPs only"), int(r["accum"]))
        for r in fitting
    ]
    assert fitting and keys == sorted(keys)
    best = fitting[0]
    first = stdout.splitlines()[0]
    assert first.startswith(
        f"cheapest that fits: precision={best['precision']} checkpointing="
        f"{best['checkpointing']} model.attention={best['attention']} "
        f"data.batch_size={best['micro_batch']} accum={best['accum']}"
    )
    assert {r["attention"] for r in rows} == {"standard"}  # plan.attention's default
    base = next(r for r in rows if (r["precision"], r["checkpointing"]) == ("fp32", "none"))
    assert float(base["time_ratio"]) == 1.0
    blocks = next(r for r in rows if (r["precision"], r["checkpointing"]) == ("fp32", "blocks"))
    assert float(blocks["time_ratio"]) > 1.0  # the blocks' forward again, in FLOPs
    # A precision's time is fp32's FLOPs times the step-time ratio measured for it, if any.
    bf16 = next(r for r in rows if (r["precision"], r["checkpointing"]) == ("bf16", "none"))
    measured = re.match(r"FLOPs x ([0-9.]+) measured \(bench ", bf16["time_from"])
    assert measured or bf16["time_from"].startswith("FLOPs only (no step time measured")
    factor = float(measured.group(1)) if measured else 1.0
    assert float(bf16["time_ratio"]) == pytest.approx(factor, rel=1e-3)

    # The run at the planned micro-batch and accum estimates what the plan predicted.
    from runner.train import run

    b, k = int(base["micro_batch"]), int(base["accum"])
    assert b * k == 64 and 1 < b < 64  # the budget makes the choice, not the edges
    figures = run(
        compose_config(
            [
                *overrides,
                f"data.batch_size={b}",
                f"accum={k}",
                "trainer.max_steps=1",
                f"mlflow.tracking_uri={store}",
            ]
        )
    )
    assert figures["mem/estimate_bytes"] / 2**20 == pytest.approx(
        float(base["predicted_MiB"]), rel=1e-3
    )
    bigger = min(d for d in divisors(64) if d > b)
    figures = run(
        compose_config(
            [
                *overrides,
                f"data.batch_size={bigger}",
                f"accum={64 // bigger}",
                "trainer.max_steps=1",
                f"mlflow.tracking_uri={store}",
            ]
        )
    )
    assert figures["mem/estimate_bytes"] > 0.9 * 40 * 2**20  # over the budget less the margin


# In a fresh process with oneDNN's operations off: the CNN then takes TensorFlow's own
# convolution kernels on every CPU (with them on, float16 goes to oneDNN on CPUs with
# AVX512_FP16 or AMX_FP16, and the line is straight).
_NOT_LINEAR = r"""
import json, sys
from runner.config import compose_config
from runner.plan.line import data_spec, device_info, estimate_line
from runner.train import run
cfg = compose_config(json.loads(sys.argv[1]))
on_gpu, name = device_info()
line, _ = estimate_line(cfg, data_spec(cfg), on_gpu, name)
figures = run(cfg)
points = {str(k): v for k, v in line.points.items()}
print("RESULT " + json.dumps({"points": points, "peak": line.peak(8, 1),
                              "estimate": figures["mem/estimate_bytes"]}))
"""


def test_the_plans_peak_is_the_estimate_at_the_micro_batch_where_that_is_not_linear(
    store, tmp_path
):
    """A float16 CNN on TensorFlow's own convolution kernels holds an im2col buffer that grows
    with the micro-batch up to its working set, then stays: the plan's peak at a micro-batch
    is the estimate the run logs there. A line through micro-batches 1 and 2 put MobileNetV2
    x0.35 at 64 px, batch 32, at 852 MiB for 105; the line's slope alone, without the estimate
    at the micro-batch, read 0.41x at 16."""
    overrides = [
        *tiny_overrides("mobilenet", store), "precision=mixed", "data.image_size=64",
        "trainer.effective_batch_size=8", "data.batch_size=8", "trainer.max_steps=1",
    ]  # fmt: skip
    r = onednn_off_result(_NOT_LINEAR, json.dumps(overrides), cwd=tmp_path)
    points = {int(k): v for k, v in r["points"].items()}
    assert sorted(points) == divisors(8)
    assert points[2] - points[1] > 2 * (points[8] - points[4]) / 4  # bends
    assert r["peak"] == pytest.approx(r["estimate"], rel=1e-3)


def test_a_budget_below_the_fixed_part_is_one_line_without_probing(tmp_path):
    result = run_cli(
        [
            *tiny_overrides("transformer", f"sqlite:///{tmp_path}/m.db"),
            "accum=auto",
            "trainer.effective_batch_size=8",
            "plan.budget=4KiB",
        ],
        tmp_path,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(
        "error: the budget of 4 KiB (plan.budget) is below what this job keeps whatever its "
        "micro-batch: "
    )
    assert "params " in line and "optimizer " in line and "trainer.optimizer=sgd" in line
    assert "probing" not in result.stdout and "MLflow: run" not in result.stdout


def test_under_xla_the_plan_is_xlas_own_plan_of_the_step_read_once(
    store, capsys, tmp_path, monkeypatch
):
    """The tiny transformer, compiled by XLA (trainer.jit_compile, auto's on a CPU): each row's
    prediction is XLA's own plan of the step (runner/estimate/xla_plan.py), the figure the run
    then logs as its estimate. Not in the cache, the rows are computed in 2 fresh processes at
    once (runner/plan/row.py); a row whose target batch fits in one micro-batch reads that
    plan alone. The plans are cached, and the plan says how many it read."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # none of the plans compiled yet
    overrides = [*TINY["transformer"], *TINY_DATA, f"mlflow.tracking_uri={store}"]
    overrides += ["trainer.jit_compile=true", "trainer.effective_batch_size=8"]
    two = ["plan.precisions=[fp32,bf16]", "plan.policies=[none]", "plan.budget=64MiB"]
    stdout = _plan_here([*overrides, *two], capsys)
    assert "predicted peaks are XLA's own plans of the step" in stdout
    assert "XLA's plans: 2 read in " in stdout, stdout  # micro-batch 8 of each row
    assert "by 2 processes at once, 0 from the cache" in stdout, stdout
    rows = {r["precision"]: r for r in _rows(stdout)}
    assert {(r["micro_batch"], r["accum"]) for r in rows.values()} == {("8", "1")}
    # a budget the target batch does not fit in one micro-batch: micro-batch 1 is planned too
    fp32 = ["plan.precisions=[fp32]", "plan.policies=[none]"]
    tight = float(rows["fp32"]["predicted_MiB"]) / 0.9 - 0.01
    narrow = _plan_here([*overrides, *fp32, f"plan.budget={tight:.2f}MiB"], capsys)
    assert "XLA's plans: 2 read in " in narrow and "1 from the cache" in narrow, narrow
    (row,) = _rows(narrow)
    assert row["accum"] != "1", narrow
    again = _plan_here([*overrides, *two], capsys)
    assert "2 from the cache" in again and "processes" not in again, again
    assert _rows(again) == _rows(stdout)
    # The processes compiled at LLVM -O0 (row.FAST_CODEGEN): bf16's plan compiled here, at
    # the default level, is the same buffer assignment
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "here"))
    _plan_here([*overrides, "plan.precisions=[bf16]", *two[1:]], capsys)
    (here,) = (tmp_path / "here").glob("xla-plan-*.json")
    apart = json.loads((tmp_path / "cache" / here.name).read_text())
    assert [{**c, "seconds": 0} for c in json.loads(here.read_text())] == [
        {**c, "seconds": 0} for c in apart
    ]
    from runner.train import run

    # The run's estimate is the row's figure: its own plan, in bfloat16 (not fp32's).
    run_cfg = [*overrides, "precision=bf16", "data.batch_size=8", "trainer.max_steps=1"]
    figures = run(compose_config([*run_cfg, *TINY_TRAINER[1:]]))
    assert figures["mem/estimate/xla_plan_bytes"] > 0
    predicted = {p: float(r["predicted_MiB"]) for p, r in rows.items()}
    assert predicted["bf16"] != predicted["fp32"], predicted
    assert figures["mem/estimate_bytes"] / 2**20 == pytest.approx(predicted["bf16"], abs=0.01)


def test_a_model_with_a_layer_the_rules_lack_is_probed_not_predicted(capsys, monkeypatch):
    """Without XLA, a layer kind with no rule makes the row's peak a measured one: the U-Net of
    examples/conf with UpSampling2D's rule taken away (runner/estimate/coverage.py RULED)."""
    from runner.estimate import coverage

    monkeypatch.setattr(coverage, "RULED", coverage.RULED - {"UpSampling2D"})
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    monkeypatch.setenv("PYTHONPATH", str(REPO / "examples"))  # the probes import my_models
    args = ["--config-dir", str(REPO / "examples" / "conf"), "model=unet", "data.image_size=8"]
    one_row = ["plan.precisions=[fp32]", "plan.policies=[none]"]
    budget = ["trainer.effective_batch_size=16", "plan.budget=64MiB"]
    stdout = _plan_here([*args, *one_row, *budget], capsys)
    (row,) = _rows(stdout)
    assert "probed, not predicted (not modelled: UpSampling2D x2)" in row["note"], row


def test_a_transformers_plan_has_a_row_per_attention_kind_and_chunked_fits_more(capsys):
    """plan.attention=[standard,chunked]: at 512 tokens the chunked core keeps O(s) where the
    standard one keeps a*s^2*b, so its largest micro-batch is larger; its command names it."""
    overrides = [*MEMORY_BOUND, "data.seq_len=512", "model.attention_block=64"]
    one = ["plan.precisions=[fp32]", "plan.policies=[none]", "plan.attention=[standard,chunked]"]
    budget = ["trainer.effective_batch_size=64", "plan.budget=64MiB"]
    stdout = _plan_here([*overrides, *one, *budget], capsys)
    rows = {r["attention"]: r for r in _rows(stdout)}
    assert set(rows) == {"standard", "chunked"}
    standard, chunked = (int(rows[k]["micro_batch"]) for k in ("standard", "chunked"))
    assert chunked > standard, rows
    assert "model.attention=chunked" in stdout.splitlines()[0], stdout


@pytest.mark.slow
def test_plan_measure_probes_each_row_that_fits_and_shows_it_beside_the_prediction(capsys):
    stdout = _plan_here(
        [
            *MEMORY_BOUND,
            "model.layers=2",
            "trainer.effective_batch_size=64",
            "plan.budget=40MiB",
            "plan.precisions=[fp32]",
            "plan.policies=[none,blocks]",
            "plan.measure=true",
        ],
        capsys,
    )
    rows = _rows(stdout)
    assert [(r["precision"], r["checkpointing"]) for r in rows] == [
        ("fp32", "none"),
        ("fp32", "blocks"),
    ]
    for row in rows:
        assert row["fits"] == "yes"
        ratio = float(row["measured_MiB"]) / float(row["predicted_MiB"])
        assert 0.5 < ratio < 2, row  # the same job measured: MiB beside MiB


# Six fresh processes or more (the run, the estimate, its probes, the probe of twice the
# micro-batch): 93.6 s of CPU measured for this test alone, pytest's start included.
@pytest.mark.slow
def test_accum_auto_fits_a_user_unet_in_the_budget_with_its_techniques_held(
    tmp_path, store, monkeypatch
):
    """A model of one's own (examples/conf/model/unet.yaml, --config-dir) under the CPU
    allocator's limit, in a fresh process, as the limit must be set before TensorFlow starts:
    under these techniques (oneDNN's kernels, pinned by conftest) 128 images of 16 px peaked
    at 18.4 MiB and 256 at 33.8 MiB (measured), so a budget of 24 MiB makes accum=auto split
    the 256, and its probes import the user's module in processes of their own. With
    techniques that are not the defaults (blocks, pruning), to show they are held fixed while
    it searches; float32, as oneDNN has bfloat16 convolutions only on CPUs with AVX512_BF16
    (elsewhere TensorFlow's own kernels hold 57 MiB at micro-batch 16). Small images and two
    optimizer steps: the cost is the processes' start (TensorFlow and MLflow imports, about
    9 s of CPU each), not the steps."""
    budget = 24
    examples = REPO / "examples"
    pythonpath = os.pathsep.join(filter(None, [str(examples), os.environ.get("PYTHONPATH")]))
    env = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(budget), "PYTHONPATH": pythonpath}
    technique = [
        "precision=fp32",
        "checkpointing=blocks",
        "pruning=polynomial",
        "pruning.frequency=2",
    ]
    job = [
        "model=unet",
        *technique,
        "data.image_size=16",
        "data.train_samples=256",
        "data.val_samples=8",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        *NO_MODEL,
        f"mlflow.tracking_uri={store}",
    ]
    result = run_cli(
        [
            "--config-dir",
            str(examples / "conf"),
            *job,
            "accum=auto",
            "trainer.effective_batch_size=256",
            f"plan.budget={budget}MiB",
            "trainer.max_steps=2",  # pruning needs two steps
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        env,
        900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [ln for ln in result.stdout.splitlines() if "accum=auto: data.batch_size=" in ln]
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("tfmemlab").experiment_id])
    assert run.info.status == "FINISHED"
    params, metrics = run.data.params, run.data.metrics
    b, k = int(params["data.batch_size"]), int(params["accum"])
    assert params["model.name"] == "unet"
    assert b * k == 256 and k > 1, line  # the effective batch, split: it does not fit whole
    assert params["effective_batch_size"] == "256"
    assert f"accum=auto: data.batch_size={b} accum={k} (effective 256)" in line
    assert (metrics["plan/micro_batch"], metrics["plan/accum"]) == (b, k)
    assert metrics["plan/budget_bytes"] == budget * 2**20
    # The techniques were held fixed while it searched.
    assert params["precision.name"] == "fp32"
    assert params["checkpointing.policy"] == "blocks"
    assert params["pruning.schedule"] == "polynomial"
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert len(plan["probes"]) >= 3 and all("peak_bytes" in p for p in plan["probes"])
    # Its measured peak is under the budget, in the run and in the confirming probe ...
    assert metrics["mem/peak_bytes"] <= budget * 2**20
    assert plan["probes"][-1]["micro_batch"] == b
    assert plan["probes"][-1]["peak_bytes"] <= budget * 2**20
    # ... and twice the micro-batch is not within the budget less plan.margin, what accum=auto
    # aims at: checked by a probe of its own. On a CPU with AMX one fresh-clone run measured
    # 23.0 MiB at twice: under the budget, over its usable 21.6.
    monkeypatch.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", str(budget))
    monkeypatch.setenv("PYTHONPATH", pythonpath)  # the probe's process imports my_models
    monkeypatch.syspath_prepend(str(examples))
    cfg = compose_config(job, str(examples / "conf"))
    twice = probe(cfg, 2 * b, max(1, 256 // (2 * b)))
    assert plan["usable_bytes"] == pytest.approx(budget * 2**20 * 0.9)  # plan.margin's default
    assert twice["oom"] or twice["peak_bytes"] > plan["usable_bytes"], twice


def test_16_bit_measured_time_is_looked_up_by_the_cpus_instructions():
    """A 16-bit precision's step-time ratio differs with the CPU's kernels (MobileNetV2 with
    AVX512_BF16/AMX, oneDNN's: bf16 1.26x fp32, float16 24.9x; with AVX512F alone, oneDNN's
    emulated bfloat16: 1.03x; without AVX512, TensorFlow's own: bf16 1.67x, float16 2.05x):
    the plan reads the ratio measured on its own kind of CPU."""
    from runner.core.machine import cpu_has_bf16, cpu_onednn_bf16, cpu_onednn_fp16
    from runner.plan.line import EMULATED_BF16_CPU, MEASURED, NO_BF16_CPU, device_class

    emulated = EMULATED_BF16_CPU if cpu_onednn_bf16() else NO_BF16_CPU
    assert device_class(False, "bf16") == ("cpu" if cpu_has_bf16() else emulated)
    # float16 takes oneDNN's kernels where TensorFlow gives it float16 (AVX512_FP16/AMX_FP16)
    assert device_class(False, "mixed") == ("cpu" if cpu_onednn_fp16() else NO_BF16_CPU)
    assert device_class(True, "bf16") == device_class(True, "mixed") == "gpu"
    for precision in ("bf16", "mixed"):
        with_amx = MEASURED["cpu", precision, "cnn", False][0]
        assert with_amx != MEASURED[NO_BF16_CPU, precision, "cnn", False][0], precision
    emulated_bf16 = MEASURED[EMULATED_BF16_CPU, "bf16", "cnn", False][0]
    assert len({with_amx, emulated_bf16, MEASURED[NO_BF16_CPU, "bf16", "cnn", False][0]}) == 3


def test_time_probes_time_the_jobs_own_factors():
    """plan.time_probes (runner/plan/timing.py), in fresh processes: the tiny transformer at 2
    samples in one micro-batch and in two of 1, and under `blocks` alone. At one sample a
    micro-batch is mostly its fixed cost (its ops dispatched, the weights read, the gradients
    added), so the second adds to the step where FLOPs say nothing: 0.68-2.33x the step in
    three runs alone on an AMD EPYC, 0.36x in a CI run beside the other worker (a bound on a
    time is noise's, so the test asks only that the second micro-batch was timed and cost
    something: without the split probe extra_s is 0)."""
    from runner.plan.timing import time_probes

    cfg = compose_config(tiny_overrides("transformer"))
    timed = time_probes(cfg, 2, ["fp32"], ["none", "blocks"], rounds=1)
    assert timed["micro_batch"] == 1 and timed["step_s"] > 0
    assert timed["extra_s"] > 0, timed
    assert timed["precision"] == {} and set(timed["policy"]) == {"blocks"}
    assert timed["policy"]["blocks"] > 0


def test_the_plans_time_is_built_from_the_timed_factors():
    """A row's time: its policy's and precision's timed ratios multiplied, plus (k - 1) x the
    extra a micro-batch adds over the step of the whole batch in one (scaled from the probes'
    2m samples); factors not timed stay FLOPs and the stored ratios."""
    from runner.plan.table import table
    from runner.plan.timing import accumulation_ratio

    # 0.05 s a micro-batch past the first, over 0.2 s for 16 samples: 0.4 s for 32 in one.
    timed = {"extra_s": 0.05, "step_s": 0.2, "micro_batch": 8, "precision": {}, "policy": {}}
    assert accumulation_ratio(timed, 4, 32) == pytest.approx(3 * 0.05 / 0.4)
    assert accumulation_ratio(timed, 1, 32) == accumulation_ratio(None, 4, 32) == 0
    budget = [*MEMORY_BOUND, "model.layers=2", "trainer.effective_batch_size=64"]
    budget += ["plan.budget=40MiB", "plan.precisions=[fp32,bf16]"]
    plain, *_ = table(compose_config(budget))
    before = {(r.precision, r.checkpointing): r for r in plain}
    assert any(r.fits and r.accum > 1 for r in plain)
    assert not any("timed" in r.time_from for r in plain)
    timed = {**timed, "micro_batch": 32, "precision": {"bf16": 1.5}, "policy": {"blocks": 1.1}}
    timed["attention"] = "standard"
    for row in table(compose_config(budget), timed=timed)[0]:
        old = before[row.precision, row.checkpointing]
        assert (row.micro_batch, row.accum) == (old.micro_batch, old.accum)
        if not row.fits:
            continue
        # blocks timed, other policies their FLOPs (fp32's rows before); bf16 timed
        flops = before["fp32", row.checkpointing].time_ratio
        policy = 1.1 if row.checkpointing == "blocks" else flops
        expected = policy * (1.5 if row.precision == "bf16" else 1) + (row.accum - 1) * 0.25
        assert row.time_ratio == pytest.approx(expected), row
        assert row.time_from.startswith("timed on the job"), row
        assert ("by FLOPs" in row.time_from) == (row.checkpointing not in ("none", "blocks"))
        assert (f"+ {row.accum - 1} micro-batch" in row.time_from) == (row.accum > 1)
