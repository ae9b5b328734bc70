"""The planner's time column against measured step times (issue 30).

    python -m runner.bench plan --time [--repeats N] [--steps S] [overrides...]

For each case (a model and a budget, CASES) the plan's table is computed as `python -m
runner.plan plan.time_probes=true` computes it (runner/plan/table.py): the job's time
factors (runner/plan/timing.py) are timed first, so every row's prediction is built from its
precision's and policy's factors, each timed alone, and accumulation's cost. Every row that
fits is then trained for S optimizer steps at its micro-batch and accum, each in a fresh
process, beside the reference its time_ratio is relative to (fp32, no checkpointing, the
target batch in one micro-batch), in N interleaved rounds (runner/bench/noise.py). A job
that several cases share (the same row under two budgets) runs once per round.

Per row: the predicted time_ratio, the measured one (the ratio of the two jobs' median step
times, with its interval), and predicted/measured (target: within 15%). Per case: whether the
plan's first row is the measured fastest, or within the noise of it (the interval of its
time over the fastest row's holds 1).
"""

from runner.bench import run_rounds, table
from runner.bench.noise import Ratio, note, ratio
from runner.config import compose_config
from runner.core.bootstrap import median
from runner.plan.row import Row
from runner.plan.table import table as plan_table
from runner.plan.table import timings

TOLERANCE = 0.15  # predicted/measured time ratio within 15%
STEP = "speed/step_time_s_p50"
# Small enough that every row trains in seconds here.
MODELS = {
    "transformer": [
        "model=transformer", "model.h=64", "model.layers=2", "data.seq_len=128",
        "data.vocab_size=256", "trainer.effective_batch_size=32",
    ],
    "mobilenet": [
        "model=mobilenet", "model.version=v2", "model.alpha=0.35", "data.image_size=64",
        "trainer.effective_batch_size=32",
    ],
}  # fmt: skip
POLICIES = "plan.policies=[none,selective,blocks]"
# (model, budget, the plan's own overrides): a budget where every row fits at the target
# batch and tight ones where rows split it (their predicted peaks: `python -m runner.plan`).
# MobileNetV2 without float16, which a CPU emulates (25x fp32's time with oneDNN's kernels,
# 2x with TensorFlow's own: runner/plan/line.py MEASURED): its rows would be most of the time.
CASES = [
    ("transformer", "48MiB", [POLICIES]),
    ("transformer", "1GiB", [POLICIES]),
    ("mobilenet", "80MiB", [POLICIES, "plan.precisions=[fp32,bf16]"]),
]
COLUMNS = [
    "case", "rank", "job", "predicted", "measured", "predicted/measured", "step_s", "verdict",
]  # fmt: skip


def _train(model: str, command: str, steps: int, samples: int) -> list[str]:
    """A row's job: the model's overrides, the row's command, `steps` optimizer steps."""
    return [
        *MODELS[model],
        *command.split(),
        f"trainer.max_steps={steps}",
        f"data.train_samples={samples * steps}",
        "data.val_samples=8",
        "trainer.eval_batches=1",
        "trainer.save_model=false",
    ]


def plans(extra: list[str]) -> dict[str, tuple[str, list[Row]]]:
    """Each case's name: its model and its plan's rows that fit, cheapest first, as
    `python -m runner.plan plan.time_probes=true` orders them (the job's time factors timed
    once per model: the cases of a model share their reference job and rows)."""
    out, timed = {}, {}
    for model, budget, plan in CASES:
        cfg = compose_config([*MODELS[model], *plan, f"plan.budget={budget}", *extra])
        if model not in timed:
            timed[model] = timings(cfg)
            print(f"{model}: time factors timed on the job: {timed[model]}")
        rows, *_ = plan_table(cfg, timed=timed[model])
        out[f"{model} {budget}"] = (model, [r for r in rows if r.fits])
    return out


def main(extra: list[str], repeats: int, steps: int) -> dict:
    cases = plans(extra)
    jobs: dict[str, list[str]] = {}  # by model and command: a job two cases share runs once
    references = {}  # model -> its reference's job
    for model, rows in cases.values():
        samples = int(compose_config(MODELS[model]).trainer.effective_batch_size)
        attention = rows[0].attention if rows else ""
        reference = Row("fp32", "none", samples, 1, None, True, 1.0, "", attention=attention)
        references[model] = f"{model} {reference.command()}"
        for row in [reference, *rows]:
            jobs[f"{model} {row.command()}"] = _train(model, row.command(), steps, samples)
    print(f"== plan time check: {len(jobs)} jobs x {repeats} interleaved rounds, {steps} steps")
    results = run_rounds(jobs, extra, repeats)
    out_rows, picks = [], []
    for name, (model, rows) in cases.items():
        base = results[references[model]]
        measured = {r.command(): ratio(results[f"{model} {r.command()}"], base, STEP) for r in rows}
        for rank, row in enumerate(rows, 1):
            m = measured[row.command()]
            off = row.time_ratio / m.value
            out_rows.append({
                "case": name, "rank": rank, "job": row.command(),
                "predicted": f"{row.time_ratio:.3f} ({row.time_from.split(' (')[0]})",
                "measured": str(m), "predicted/measured": off,
                "step_s": median([r[STEP] for r in results[f"{model} {row.command()}"]]),
                "verdict": "ok" if abs(off - 1) <= TOLERANCE else "MISSED",
            })  # fmt: skip
        fastest = min(measured, key=lambda c: measured[c].value)
        picks.append(_pick_line(name, rows[0].command(), fastest, results, model))
    print(table(out_rows, COLUMNS))
    print(note(repeats))
    for line in picks:
        print(line)
    return {"rows": out_rows, "picks": picks, "results": results}


def _pick_line(name: str, first: str, fastest: str, results: dict, model: str) -> str:
    """Whether the plan's first row is the measured fastest, or within noise of it."""
    if first == fastest:
        return f"{name}: the plan's pick ({first}) is the measured fastest: ok"
    versus: Ratio = ratio(results[f"{model} {first}"], results[f"{model} {fastest}"], STEP)
    if versus.interval is not None and versus.interval[0] <= 1:
        verdict = "ok (within noise)"
    else:
        verdict = "MISSED"
    return (
        f"{name}: the plan's pick ({first}) takes {versus} the time of the measured fastest "
        f"({fastest}): {verdict}"
    )
