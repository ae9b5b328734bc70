"""sweep.repeats (issue 30): one real sweep of two jobs, two repeats each, in fresh processes,
then resumed; the tests read it: the runs' nesting and tags in MLflow, the interleaved order,
each job's aggregate figures, and the comparison's intervals and marks."""

import csv
import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from runner.core.bootstrap import ratio_interval
from runner.report.sweep_plots import pareto
from runner.sweep.repeats import JOBS_FILE
from runner.sweep.state import SWEEP_FILE
from runner.track import compare, spread
from runner.track.client import scratch_store
from tests.conftest import run_cli, tiny_overrides

KEYS = {"step_s": "speed/step_time_s_p50", "samples_per_s": "speed/samples_per_s"}


@pytest.fixture(scope="module")
def repeated(tmp_path_factory):
    """An A/A sweep (trainer.seed=1,2) with sweep.repeats=2: four runs of the tiny model, each
    in a fresh process (about 50 CPU-seconds), then `sweep.resume` of the finished sweep.
    Yields (client, parent run id, sweep dir, the resume's process)."""
    folder = tmp_path_factory.mktemp("repeats")
    store = scratch_store(folder)
    sweep_dir = folder / "sweep"
    args = ["-m", "sweep.repeats=2", "trainer.seed=1,2", *tiny_overrides("transformer", store)]
    result = run_cli([*args, f"hydra.sweep.dir={sweep_dir}"], folder, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = run_cli([f"sweep.resume={sweep_dir}"], folder, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    parent = json.loads((sweep_dir / SWEEP_FILE).read_text())["parent_run_id"]
    return MlflowClient(tracking_uri=store), parent, sweep_dir, resumed


def _jobs(client, parent):
    """The sweep's job runs, and each one's repeats by repeat number."""
    jobs = compare.sweep_runs(client, parent)
    return jobs, [spread.repeats(client, job) for job in jobs]


@pytest.mark.slow
def test_each_job_is_a_child_of_the_sweep_and_its_repeats_are_its_children(repeated):
    client, parent, sweep_dir, _ = repeated
    jobs, repeats = _jobs(client, parent)
    assert [j.data.tags["job_num"] for j in jobs] == ["0", "1"]  # one row per job
    assert all(j.data.tags["mlflow.parentRunId"] == parent for j in jobs)
    assert [j.data.tags["repeats"] for j in jobs] == ["2", "2"]
    assert [j.info.run_name for j in jobs] == ["baseline", "trainer.seed=2"]
    for job, runs in zip(jobs, repeats, strict=True):
        assert [r.data.tags["repeat"] for r in runs] == ["0", "1"]
        assert [r.info.run_name for r in runs] == [
            f"{job.info.run_name} (repeat {i})" for i in (0, 1)
        ]
        assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {job.info.run_id}
        assert {r.data.params["trainer.seed"] for r in runs} == {job.data.params["trainer.seed"]}
    listed = json.loads((sweep_dir / JOBS_FILE).read_text())
    assert [j["run_id"] for j in listed] == [j.info.run_id for j in jobs]


@pytest.mark.slow
def test_repeats_run_interleaved(repeated):
    client, parent, sweep_dir, _ = repeated
    _, repeats = _jobs(client, parent)
    runs = sorted((r for rs in repeats for r in rs), key=lambda r: r.info.start_time)
    order = [(r.data.params["trainer.seed"], r.data.tags["repeat"]) for r in runs]
    assert order == [("1", "0"), ("2", "0"), ("1", "1"), ("2", "1")]  # A B A B
    # Hydra's job folders in the same order: folder 1 is job B's first repeat.
    run_id = json.loads((sweep_dir / "1" / "run.json").read_text())["run_id"]
    assert run_id == repeats[1][0].info.run_id


@pytest.mark.slow
def test_a_jobs_run_holds_its_repeats_medians_and_spread(repeated):
    client, parent, _, _ = repeated
    jobs, repeats = _jobs(client, parent)
    for job, runs in zip(jobs, repeats, strict=True):
        assert job.info.status == "FINISHED" and job.data.tags["repeats_finished"] == "2/2"
        for key in ("speed/step_time_s_p50", "speed/samples_per_s", "mem/peak_bytes"):
            values = [r.data.metrics[key] for r in runs]
            assert job.data.metrics[key] == pytest.approx(np.median(values))
            lo, hi = np.percentile(values, [10, 90])
            assert job.data.metrics[f"{key}_lo"] == pytest.approx(lo)
            assert job.data.metrics[f"{key}_hi"] == pytest.approx(hi)


@pytest.mark.slow
def test_each_ratio_has_its_interval_over_both_jobs_repeats_and_its_mark(repeated):
    client, parent, sweep_dir, _ = repeated
    _, repeats = _jobs(client, parent)
    with open(sweep_dir / "comparison.csv") as f:
        base, job = list(csv.DictReader(f))
    assert (base["repeats"], job["repeats"]) == ("2", "2")
    markdown = (sweep_dir / "comparison.md").read_text()
    for column, key in KEYS.items():
        values = [[r.data.metrics[key] for r in runs] for runs in repeats]
        lo, hi = ratio_interval(values[1], values[0], paired=True)  # round by round
        assert lo < hi  # from both repeats of each job, not one
        assert float(job[f"{column}/base_lo"]) == pytest.approx(lo)
        assert float(job[f"{column}/base_hi"]) == pytest.approx(hi)
        noise = "within noise" if lo <= 1 <= hi else "beyond noise"
        assert job[f"{column}/base_noise"] == noise
        shown = f"{float(job[f'{column}/base']):.4g} [{lo:.3g}, {hi:.3g}]"
        shown += " within noise" if noise == "within noise" else ""
        assert f"| {shown} |" in markdown
        assert base[f"{column}/base_noise"] == ""  # the baseline is no ratio to judge
    # The sweep's description holds the same table; each job's run says its own ratios.
    assert "95% bootstrap interval" in client.get_run(parent).data.tags["mlflow.note.content"]
    note = client.get_run(repeats[1][0].data.tags["repeat_of"]).data.tags["mlflow.note.content"]
    assert "2 repeats, interleaved" in note and "step_s/base " in note


@pytest.mark.slow
def test_a_resumed_sweep_skips_its_finished_repeats(repeated):
    client, parent, _, resumed = repeated
    _, repeats = _jobs(client, parent)
    for num, run in enumerate(r for pair in zip(*repeats, strict=True) for r in pair):
        assert f"job {num}: its run {run.info.run_id} FINISHED: skipped" in resumed.stdout
    experiment = client.get_run(parent).info.experiment_id
    assert len(client.search_runs([experiment], f"tags.sweep_id = '{parent}'")) == 2 + 4


@pytest.mark.slow
def test_the_pareto_plot_draws_each_jobs_spread(repeated):
    client, parent, _, _ = repeated
    jobs = compare.sweep_runs(client, parent)
    rows = compare.rows(jobs, None, (), spread.finished(client, jobs))
    (ax,) = pareto(rows).axes
    assert len(ax.containers) == 2  # one error bar (peak and samples/s) per job
