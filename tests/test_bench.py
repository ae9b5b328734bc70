"""The GPU check's own code, run on the CPU at a tiny size, so that the one run on a GPU
machine does not fail on a bug a CPU could have caught."""

import contextlib
import io
import re

import pytest

import runner.bench
from runner.bench import gpu_check, noise
from runner.bench import layers as layers_bench
from runner.bench.noise import NOISE
from tests.conftest import NO_MODEL, TINY, TINY_DATA
from tests.test_telemetry import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_a_machine_without_a_gpu():
    with pytest.raises(SystemExit, match="gpu_check needs a GPU"):
        gpu_check.main([])


def _jobs_in_this_process(monkeypatch) -> None:
    """A benchmark's jobs run here, one after another, not each in a fresh process: what these
    tests check is the printing and the verdict, which read whatever figures the jobs give; a
    fresh process costs ~10 s of CPU to import TensorFlow and MLflow (the jobs' isolation is
    the runner's, runner/core/process.py, and the plan benchmark's probes still run apart).
    What a job prints stays its own, as a fresh process's output is: capsys sees the
    benchmark's."""

    def here(function, *args):
        with contextlib.redirect_stdout(io.StringIO()):
            return function(*args)

    monkeypatch.setattr(runner.bench, "in_fresh_process", here)


@pytest.mark.slow
def test_gpu_check_compares_each_precision_with_fp32(capsys, monkeypatch):
    _jobs_in_this_process(monkeypatch)
    tiny = [*TINY["transformer"], *TINY_DATA, "trainer.max_steps=3", "trainer.device=cpu"]
    tiny += NO_MODEL
    results = gpu_check.compare(tiny)
    out = capsys.readouterr().out
    assert list(results) == ["fp32", "mixed", "bf16"]
    # Each job ran under its own policy: only float16 has loss scaling and counts skips.
    assert ["precision/skipped_steps" in r for r in results.values()] == [False, True, False]
    for r in results.values():
        assert all(r[k] > 0 for k in ("mem/peak_bytes", "speed/step_time_s_p50"))
    header = out.splitlines()[0].split()
    assert header == ["precision", *gpu_check.KEYS]
    for p in ("mixed", "bf16"):
        line = re.search(
            rf"^{p}\s+/ fp32: peak (\d+\.\d\d) \(target <= 0.75\).* (ok|MISSED)$", out, re.M
        )
        assert line, out
        ratio = results[p]["mem/peak_bytes"] / results["fp32"]["mem/peak_bytes"]
        # The printed figure is the ratio to 2 places: a ratio of 0.925 prints 0.93, which
        # approx(abs=0.005) refused (0.93 - 0.925 is a little over 0.005 in floats).
        assert line.group(1) == f"{ratio:.2f}"
        assert line.group(2) == ("ok" if ratio <= gpu_check.TARGET else "MISSED")
    assert re.search(r"^gpu_check: 3 jobs in \d+ s$", out, re.M)


@pytest.mark.slow
def test_layers_bench_prints_each_jobs_table_shares_and_check(capsys, monkeypatch):
    # The layers benchmark with its models at tiny sizes: each job's top-10 table, the
    # memory-bound shares and the sum of per-layer times against the step time, the verdict
    # matching the figures it prints.
    # The transformer only: MobileNetV2's 157 rows took minutes here (test_layers profiles it).
    # At h=256, 128 tokens, batch 4 the MLP's matmuls (73 FLOPs a byte in float32, 114 in
    # bfloat16, as the profile counts them) sit well above the CPU's ridge. A CPU with AMX put
    # its bfloat16 ridge at 48.5 alone and higher beside the other test worker (its bandwidth
    # timed under load): at h=128, 64 tokens (57 FLOPs a byte) every share read 100% there.
    small = [*TINY["transformer"], "model.h=256", "data.seq_len=128"]
    monkeypatch.setattr(layers_bench, "MODELS", {"transformer": small})
    _jobs_in_this_process(monkeypatch)
    tiny = [*TINY_DATA, "profile.repeats=1", "profile.steps=1"]
    results = layers_bench.main(tiny, steps=2)
    out = capsys.readouterr().out
    assert list(results) == ["transformer fp32", "transformer bf16"]
    for name, r in results.items():
        block = out.split(f"== {name}:")[1].split("== ")[0]
        header = block.splitlines()[1].split()
        assert header == layers_bench.COLUMNS
        assert len(block.splitlines()) >= 2 + 10  # the top 10 rows
        assert 0 < r["layers/memory_bound_time_frac"] < 1  # both kinds of layer present
        shares = re.search(r"memory-bound layers: ([\d.]+)% of FLOPs, ([\d.]+)% of time", block)
        assert float(shares.group(2)) == pytest.approx(
            100 * r["layers/memory_bound_time_frac"], abs=0.05
        )
        check = re.search(r"= ([\d.]+) \(target 0.7-1.3: (ok|MISSED)\)", block)
        ratio = r["layers/sum_over_step_time"]
        assert float(check.group(1)) == pytest.approx(ratio, abs=0.0005)
        assert check.group(2) == ("ok" if 0.7 <= ratio <= 1.3 else "MISSED")


@pytest.mark.slow
def test_plan_bench_prints_predicted_beside_measured_and_its_verdict(capsys, monkeypatch):
    from runner.bench import plan as plan_bench

    small = [
        "model=transformer",
        "trainer.jit_compile=false",  # XLA's compile was most of each probe's time
        "model.h=16",
        "model.layers=2",
        "model.heads=2",
        "data.seq_len=16",
        "data.vocab_size=16",
    ]
    monkeypatch.setattr(plan_bench, "MODELS", {"transformer": small})
    # One row of the matrix, at two micro-batches: a probe each, in a fresh process (the
    # policies and precisions are each a probe more; test_plan measures none and blocks).
    monkeypatch.setattr(plan_bench, "PRECISIONS", ("fp32",))
    monkeypatch.setattr(plan_bench, "POLICIES", ("blocks",))
    monkeypatch.setattr(plan_bench, "BATCHES", (2, 8))
    rows = plan_bench.main(["data.train_samples=64", "data.val_samples=8"])
    out = capsys.readouterr().out
    assert [(r["checkpointing"], r["micro_batch"]) for r in rows] == [("blocks", 2), ("blocks", 8)]
    for r in rows:  # measured by a probe, divided as printed
        assert r["measured_MiB"] > 0
        assert r["predicted/measured"] == pytest.approx(r["predicted_MiB"] / r["measured_MiB"])
    assert rows[1]["measured_MiB"] > rows[0]["measured_MiB"]  # a larger micro-batch, more
    assert "|predicted/measured - 1|: worst " in out and "(target: every one <= 15%" in out


@pytest.mark.slow
def test_plan_time_check_divides_each_rows_measured_time_by_the_references(capsys, monkeypatch):
    # The planner's time column against measured step times (runner/bench/plan_time.py) at a
    # tiny size, its jobs in this process: what is checked is how the table and the pick's
    # verdict are made from the runs' figures, whatever those are.
    from runner.bench import plan as plan_bench
    from runner.bench import plan_time
    from runner.core.bootstrap import median
    from runner.plan import timing

    _jobs_in_this_process(monkeypatch)
    # The time factors' probes in one round, not three: each is a fresh process (~10 s of CPU),
    # and what is checked here is the table made from them (test_plan times them).
    monkeypatch.setattr(timing, "TIME_ROUNDS", 1)
    tiny = [*TINY["transformer"], "trainer.effective_batch_size=8"]
    monkeypatch.setattr(plan_time, "MODELS", {"transformer": tiny})
    plan = ["plan.policies=[none,blocks]", "plan.precisions=[fp32]"]
    monkeypatch.setattr(plan_time, "CASES", [("transformer", "1GiB", plan)])
    out = plan_bench.main(["--time", "--repeats", "2", "--steps", "3", *NO_MODEL])
    printed = capsys.readouterr().out
    assert "== plan time check: 2 jobs x 2 interleaved rounds, 3 steps" in printed
    results, rows = out["results"], out["rows"]
    # The rows' order is the timed probes' (blocks' probe can come out faster than none's at
    # this size on a 2-core machine), so each row is found by its job, not its rank.
    by_policy = {r["job"].split()[1]: r for r in rows}
    assert sorted(by_policy) == ["checkpointing=blocks", "checkpointing=none"]
    assert all(r["job"].startswith("precision=fp32 ") for r in rows)
    predicted = [float(r["predicted"].split()[0]) for r in rows]
    assert predicted == sorted(predicted)  # the plan's order: cheapest first
    none = by_policy["checkpointing=none"]
    assert float(none["predicted"].split()[0]) == 1.0  # the reference's own factor, not a guess
    step = {job: median([r[plan_time.STEP] for r in runs]) for job, runs in results.items()}
    reference = step[f"transformer {none['job']}"]  # fp32/none at the target batch: itself
    assert all(len(runs) == 2 for runs in results.values())
    for r in rows:
        measured = step[f"transformer {r['job']}"] / reference
        predicted = float(r["predicted"].split()[0])
        assert r["predicted/measured"] == pytest.approx(predicted / measured, rel=2e-3)
        assert r["verdict"] == ("ok" if abs(r["predicted/measured"] - 1) <= 0.15 else "MISSED")
    assert none["measured"].startswith("1.000 [1.000, 1.000]")
    fastest = min(rows, key=lambda r: step[f"transformer {r['job']}"])["job"]
    (pick,) = out["picks"]
    assert pick.startswith(f"transformer 1GiB: the plan's pick ({rows[0]['job']})")
    if fastest == rows[0]["job"]:
        assert pick.endswith("is the measured fastest: ok")
    else:
        assert f"the time of the measured fastest ({fastest})" in pick
    assert pick in printed


def test_the_picks_verdict_is_taken_on_its_interval():
    from runner.bench import plan_time

    def runs(*times):
        return [{plan_time.STEP: t} for t in times]

    slower = {"m a": runs(2.0, 2.1, 2.0, 2.1, 2.0), "m b": runs(1.0, 1.1, 1.0, 1.1, 1.0)}
    assert plan_time._pick_line("c", "a", "b", slower, "m").endswith(": MISSED")
    alike = {"m a": runs(1.0, 1.3, 0.9, 1.2, 1.0), "m b": runs(1.1, 0.9, 1.2, 1.0, 1.0)}
    assert plan_time._pick_line("c", "a", "b", alike, "m").endswith(": ok (within noise)")
    assert plan_time._pick_line("c", "a", "a", alike, "m").endswith("measured fastest: ok")
    once = {"m a": runs(1.01), "m b": runs(1.0)}  # one repeat: no interval, no benefit of doubt
    assert plan_time._pick_line("c", "a", "b", once, "m").endswith(": MISSED")


@pytest.mark.slow
def test_distribution_bench_prints_each_job_and_the_per_replica_check(capsys, monkeypatch):
    # The distribution benchmark at a tiny size: one device, mirrored on 2 logical CPUs and 2
    # local workers at one global batch; the verdict is the one its printed figures give.
    from runner.bench import distribution

    monkeypatch.setattr(distribution, "MODEL", TINY["transformer"])
    monkeypatch.setattr(distribution, "GLOBAL", 8)
    monkeypatch.setattr(distribution, "REPLICAS", (2,))
    rows = distribution.main(["data.val_samples=8"], steps=3)
    out = capsys.readouterr().out
    assert [r["job"] for r in rows] == ["1 device", "mirrored x2", "2 workers"]
    assert [r["batch_per_replica"] for r in rows] == [8, 4, 4]
    assert [r["of"] for r in rows] == ["one replica", "all 2 replicas", "one replica"]
    assert all(r["peak_MiB"] > 0 and r["step_s"] > 0 for r in rows)
    assert out.splitlines()[0].split() == [*distribution.COLUMNS, "peak/1", "device"]
    line = re.search(
        r"^per-replica peak at 2 replicas .*: ([\d.]+), ([\d.]+) MiB; largest / 1 device at the "
        r"same global batch of 8 = (\d\.\d\d) \(target <= 0.6\): (ok|MISSED)$",
        out,
        re.M,
    )
    assert line, out
    largest = max(float(line.group(1)), float(line.group(2)))
    ratio = largest / rows[0]["peak_MiB"]
    assert float(line.group(3)) == pytest.approx(ratio, abs=0.02)
    assert line.group(4) == ("ok" if float(line.group(3)) <= 0.6 else "MISSED")


@pytest.mark.slow
def test_attention_bench_prints_pairs_verdict_and_longest_sequences(capsys, monkeypatch):
    # The attention benchmark's side-by-side part and its budget search at tiny sizes: the
    # side-by-side jobs run in this process (what is checked is the table and the verdict);
    # the budget's probes run in fresh processes, which alone obey the allocator's limit.
    # At h=16, 4 heads, 1 layer, batch 4, no XLA, under 32 MiB: standard attention fit at 256
    # tokens and ran out of memory at 512; chunked (block 256) fit at 512. From 512, the search
    # bisects down for standard (2 probes) and stops at the ceiling for chunked (1 probe: each
    # is a fresh process, about 15 s).
    from runner.bench import attention, attention_budget, attention_pairs

    _jobs_in_this_process(monkeypatch)
    model = [o for o in TINY["transformer"] if not o.startswith("data.seq_len")]
    tiny = [*model, "model.heads=4", "model.attention_block=256", *TINY_DATA, *NO_MODEL]
    args = ["--only", "side", "--only", "budget", "--repeats", "2", "--steps", "3", "--seq", "64"]
    args += ["--limit-mib", "32", "--start", "512", "--ceiling", "512"]
    out = attention.main([*args, *tiny])
    printed = capsys.readouterr().out
    side = out["side"]
    assert list(out) == ["side", "budget"]
    assert [(r["job"], r["runs"]) for r in side["rows"]] == [("standard", 2), ("chunked", 2)]
    assert list(side["results"]) == ["standard #1", "chunked #1", "standard #2", "chunked #2"]
    block = printed.split("== chunked vs standard attention, 64 tokens:")[1].splitlines()
    assert block[1].startswith("load average (1 min) of the machine: ")
    assert block[2].split() == attention_pairs.COLUMNS
    std, chk = side["rows"]
    assert chk["peak/base"] == pytest.approx(chk["peak_MiB"] / std["peak_MiB"])
    low, high = map(float, chk["step_min-max"].split("-"))
    assert low - 0.0005 <= chk["step_s"] <= high + 0.0005  # printed to 3 decimals
    line = re.search(
        r"^chunked / standard: peak ([\d.]+)x .* step time ([\d.]+)x .*: (\w+)$", printed, re.M
    )
    assert line, printed
    ok = chk["peak/base"] <= 0.35 and chk["time/base"] <= 1.3
    assert line.group(3) == ("ok" if ok else "MISSED")
    assert attention_pairs.verdict((0.35, 1.3), 0.36, 1.0).endswith("MISSED")
    assert attention_pairs.verdict((0.35, 1.3), 0.3, 1.31).endswith("MISSED")
    assert attention_pairs.verdict((0.35, 1.3), 0.3, 1.2).endswith("ok")
    # The budget: each kind's longest from its probes, chunked's longer.
    lengths, probes = out["budget"]["lengths"], out["budget"]["probes"]
    assert lengths["standard"] == 256, probes
    assert lengths["chunked"] == 512, probes
    assert [(p["attention"], p["s"], p["fits"]) for p in probes] == [
        ("standard", 512, False), ("standard", 256, True), ("chunked", 512, True)
    ], probes  # fmt: skip
    ceiling = " (chunked at the ceiling: it may go further)"
    verdict = r"2.00x \(target >= 4\): MISSED"
    assert re.search(
        rf"^longest: standard 256, chunked 512 tokens{re.escape(ceiling)}: {verdict}$",
        printed,
        re.M,
    ), printed
    # The search itself: a doubling, then a bisection to the block.
    assert attention_budget.longest(lambda s: s <= 1000, 128, 128, 16384) == 896
    assert attention_budget.longest(lambda s: s <= 100, 128, 128, 16384) == 0
    assert attention_budget.longest(lambda s: True, 128, 128, 1000) == 512


@pytest.mark.slow
def test_checkpointing_bench_interleaves_its_repeats_and_prints_intervals(
    capsys, monkeypatch, store
):
    # One group at a tiny size, 2 repeats: the jobs ran in rounds (every job once, then every
    # job again: the order of their runs' start times in MLflow), and each ratio is printed as
    # `ratio [lo, hi]`, the paired bootstrap of the repeats returned, under a note saying what
    # the brackets are.
    from mlflow import MlflowClient

    from runner.bench import checkpointing

    _jobs_in_this_process(monkeypatch)
    tiny = ["model.h=16", "model.heads=2", "data.seq_len=8", "data.vocab_size=16"]
    tiny += [*TINY_DATA, *NO_MODEL, f"mlflow.tracking_uri={store}"]
    results = checkpointing.main(["--only", "L2 no XLA", "--repeats", "2", *tiny], steps=2)
    out = capsys.readouterr().out
    jobs = ["default L2 no XLA | checkpointing=none", "default L2 no XLA | checkpointing=blocks"]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    order = [r.info.run_name for r in sorted(runs, key=lambda r: r.info.start_time)]
    assert order == [f"{job} (repeat {r})" for r in (0, 1) for job in jobs]
    assert list(results) == jobs and all(len(runs) == 2 for runs in results.values())
    blocks, none = results[jobs[1]], results[jobs[0]]
    for key in ("mem/peak_bytes", "speed/step_time_s_p50"):
        r = noise.ratio(blocks, none, key)
        printed = str(r)
        assert re.fullmatch(r"\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\]( within noise)?", printed)
        assert printed.endswith("within noise") == (r.interval[0] <= 1 <= r.interval[1])
        assert printed in out.splitlines()[2], out
    assert re.search(r"target peak <= 0.75: (ok|met only within noise|MISSED)$", out, re.M)
    assert "95% bootstrap interval of the ratio of medians over 2 interleaved rounds" in out


def test_a_verdict_is_taken_on_the_far_end_of_each_interval():
    # No TensorFlow: a median that meets its target with an interval that does not is only
    # within noise; without an interval the single ratio decides, as with one run per job.
    from runner.bench.checkpointing import _verdict

    met, noisy, missed = noise.Ratio(0.69, (0.66, 0.695)), noise.Ratio(0.69, (0.66, 0.72)), 0.71
    assert noise.verdict([(met, 0.7)]) == "ok"
    assert str(noisy) == "0.690 [0.660, 0.720]"
    assert str(noise.Ratio(1.02, (0.9, 1.1))) == "1.020 [0.900, 1.100] within noise"
    assert noise.verdict([(noisy, 0.7)]) == "met only within noise"
    assert noise.verdict([(noise.Ratio(0.69), 0.7)]) == "ok"
    assert noise.verdict([(noise.Ratio(missed, (0.69, 0.73)), 0.7)]) == "MISSED"
    time = noise.Ratio(1.2, (1.1, 1.3))
    assert (
        _verdict((0.7, 1.25), met, time)
        == "target peak <= 0.7, time <= 1.25: met only within noise"
    )
    assert _verdict((0.7, None), met, time) == "target peak <= 0.7: ok"


@pytest.mark.parametrize("bad", [["--repeats"], ["--repeats", "0"], ["--repeats", "two"]])
def test_repeats_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(SystemExit, match=rf"^error: --repeats {bad[1:] and bad[1] or None}: "):
        noise.take_repeats(["model.h=16", *bad])
    assert noise.take_repeats(["--repeats", "3", "model.h=16"]) == (3, ["model.h=16"])


def test_a_bad_override_is_one_line_before_any_benchmark_job_starts(monkeypatch):
    """Every job's overrides are checked before the first starts: a typo in the last job is one
    line naming the key, not a crash of the pool after the first jobs ran."""
    started = []
    monkeypatch.setattr(runner.bench, "in_fresh_process", lambda *a: started.append(a))
    jobs = {"good": ["model.h=16"], "typo": ["model.hh=3"]}
    with pytest.raises(SystemExit, match=r"^error: model\.hh=3: unknown key") as exit_:
        runner.bench.run_rounds(jobs, ["precision=fp32"], 2)
    assert "\n" not in str(exit_.value) and not started


def test_a_benchmarks_help_is_its_docstring_without_tensorflow(capsys):
    from runner.bench import __main__ as bench_main

    bench_main.main(["memory", "--help"])
    assert capsys.readouterr().out.startswith("Transformer peak memory vs batch size")


def test_the_deploy_benchs_targets_are_the_issues_each_on_what_it_names():
    """python -m runner.bench deploy's verdicts (no TensorFlow): each target divides what the
    issue divides, sizes by the dense float32 file, and the int8 latency's verdict is taken
    on its interval's far end."""
    from runner.bench.deploy import _targets

    def job(f32, gzip, **more):
        base = {"deploy/float32/file_bytes": f32, "deploy/float32/file_gzip_bytes": gzip}
        agreed = {"deploy/float32/agreement": 1.0, "deploy/float32/max_logit_diff": 5e-4}
        return {**base, **agreed, "deploy/keras/logit_scale": 10.0, **more}

    int8 = {"deploy/int8/file_bytes": 34, "deploy/int8/val_accuracy": 0.80}
    figures = {
        "mobilenet dense": job(100, 90, **int8, **{"deploy/keras/val_accuracy": 0.815}),
        # gzip 40/90 = 0.444; sparse 101 >= 100; int8 gzip 19 of the dense file 100 = 0.19
        "mobilenet pruned80": job(
            100, 40, **{"deploy/sparse/file_bytes": 101, "deploy/int8/file_gzip_bytes": 19}
        ),
        "transformer dense": job(100, 90, **{"deploy/float32/max_logit_diff": 1.1e-3}),
        "transformer pruned80": job(100, 41, **{"deploy/dynamic_int8/file_gzip_bytes": 21}),
    }

    def timed(f32, dyn):
        return {
            ("transformer dense", "float32"): {"latency_b1_p50_ms": 1.0, "per_round": {
                "latency_b1_p50_ms": f32}},
            ("transformer dense", "dynamic_int8"): {"latency_b1_p50_ms": 0.69, "per_round": {
                "latency_b1_p50_ms": dyn}},
        }  # fmt: skip

    lines = _targets(figures, timed([1.0, 1.0, 1.0], [0.69, 0.69, 0.72]))
    verdicts = {line.split(": ", 1)[1].split(" (")[0]: line.split(":")[0] for line in lines}
    assert verdicts == {
        "mobilenet float32 LiteRT agreement 100.00%, max |logit diff| 0.0005": "ok",
        "transformer float32 LiteRT agreement 100.00%, max |logit diff| 0.0011": "MISSED",
        "mobilenet int8 file 0.340x float32": "MISSED",
        "mobilenet int8 val accuracy 0.8000 vs Keras 0.8150": "ok",
        "transformer dynamic_int8 batch-1 latency 0.69x [0.69, 0.72] float32": NOISE,
        "mobilenet pruned 80% float32 gzip 0.444x dense": "ok",
        "mobilenet pruned 80% sparse file 1.010x dense float32": "MISSED",
        "mobilenet pruned 80% + int8 gzip 0.190x dense float32 file": "ok",
        "transformer pruned 80% float32 gzip 0.456x dense": "MISSED",
        "transformer pruned 80% + dynamic_int8 gzip 0.210x dense float32 file": "MISSED",
    }
    fast = _targets(figures, timed([1.0, 1.0, 1.0], [0.69, 0.69, 0.695]))
    assert any(line.startswith("ok: transformer dynamic_int8") for line in fast)


def test_the_structured_benchs_targets_are_the_issues_each_on_what_it_names():
    """python -m runner.bench structured's verdicts (no TensorFlow): step time and peak of the
    structured job over the dense job's, paired by repeat, each verdict on the interval's far
    end; LiteRT latency by round; accuracy within 2 points on digits."""
    from runner.bench.structured import _targets

    def reps(step, peak, acc=0.9):
        return [
            {"speed/step_time_s_p50": s, "mem/peak_bytes": p, "val/accuracy": acc}
            for s, p in zip(step, peak, strict=True)
        ]

    runs = {
        "mobilenet dense": reps([1.0, 1.0], [100, 100], 0.95),
        # step 0.55 and 0.62: median 0.585 meets 0.6, the far end 0.62 does not
        "mobilenet structured": reps([0.55, 0.62], [60, 60], 0.925),
        "transformer dense": reps([2.0, 2.0], [100, 100]),
        "transformer structured": reps([1.4, 1.4], [85, 85]),  # peak 0.85 > 0.8
    }
    row = {"latency_b1_p50_ms": 1.0, "per_round": {"latency_b1_p50_ms": [1.0, 1.0, 1.0]}}
    timed = {
        ("mobilenet dense", "float32"): row,
        ("mobilenet structured", "float32"): {
            "latency_b1_p50_ms": 0.5, "per_round": {"latency_b1_p50_ms": [0.5, 0.5, 0.55]}},
    }  # fmt: skip
    lines = _targets(runs, timed)
    verdicts = {line.split(": ", 1)[1].split(" (")[0]: line.split(":")[0] for line in lines}
    assert verdicts == {
        "mobilenet structured step time 0.585 [0.550, 0.620] dense": NOISE,
        "mobilenet structured step peak 0.600 [0.600, 0.600] dense": "ok",
        "mobilenet structured float32 LiteRT batch-1 latency 0.50x [0.50, 0.55] dense": "ok",
        "transformer structured step time 0.700 [0.700, 0.700] dense": "ok",
        "transformer structured step peak 0.850 [0.850, 0.850] dense": "MISSED",
        "mobilenet structured val accuracy 0.9250 vs dense 0.9500": "MISSED",
    }
