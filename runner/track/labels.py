"""What sets a run apart from the baseline: its label (`mixed`, `accum=4`,
`checkpointing=blocks`) and the keys that make a ratio to the baseline compare unlike things
(runner/track/compare.py's `differs` column)."""

from mlflow.entities import Run

# Params a ratio needs equal to the baseline's (issue 13: accumulation was once compared at 4x
# the baseline's batch). The micro-batch may differ: accumulation changes it on purpose, and
# the effective batch is what must match.
LIKE_FOR_LIKE = ("effective_batch_size", "params_total", "model.", "data.")
MICRO_BATCH = "data.batch_size"
# The parameter count follows from the model: a sweep that varies the model varies it too.
FOLLOWS = {"params_total": "model"}
# Group keys that name a choice: when one differs, its label part stands for the whole group.
CHOICES = {
    "model.name": "model={}",
    "data.name": "data={}",
    "precision.name": "{}",  # fp32, mixed, bf16
    "checkpointing.policy": "checkpointing={}",
    "pruning.schedule": "pruning={}",
}
# Params that follow from others, or that say where a run went rather than what it did.
NOT_IN_LABELS = ("effective_batch_size", "params_total", "total_steps", "remat/policy")
NOT_IN_LABELS += ("mlflow.", "sweep.", "trainer.progress", "trainer.save_model")


def differs(params: dict, base: dict, varies=()) -> list[str]:
    """The keys that make a ratio to the baseline compare unlike things: those of
    LIKE_FOR_LIKE that differ, but for the groups or keys in `varies`."""
    if not params or not base:  # a run that failed before logging its config
        return []
    keys = (params.keys() | base.keys()) - {MICRO_BATCH}
    keys = {k for k in keys if k.startswith(LIKE_FOR_LIKE) and not _varied(k, varies)}
    return sorted(k for k in keys if params.get(k) != base.get(k))


def _varied(key: str, varies) -> bool:
    key = FOLLOWS.get(key, key)
    return any(key == v or key.startswith(f"{v}.") for v in varies)


def labels(runs: list[Run], base: Run | None, varies=()) -> list[str]:
    """Each run named by what differs from the baseline, unique within the list; the baseline
    says its own value of what the runs vary on purpose (`model=ResNet50 (baseline)`)."""
    out: list[str] = []
    for run in runs:
        if base is None or not run.data.params:
            label = run.info.run_name
        elif run is base:
            params = base.data.params
            own = [
                f.format(params[k])
                for k, f in CHOICES.items()
                if k in params and _varied(k, varies)
            ]
            label = " ".join([*own, "(baseline)"]) if own else "baseline"
        else:
            label = label_for(run.data.params, base.data.params)
        if label in out:  # e.g. a job repeated on purpose: same config as an earlier one
            num = run.data.tags.get("job_num")
            label += f" (job {num})" if num else f" (run {run.info.run_id[:8]})"
        out.append(label)
    return out


def label_for(params: dict, base: dict) -> str:
    """`mixed`, `accum=4`, `checkpointing=blocks`, ...: the params that differ from base."""
    keys = {
        k
        for k in params.keys() | base.keys()
        if params.get(k) != base.get(k) and not k.startswith(NOT_IN_LABELS)
    }
    parts = []
    for key, form in CHOICES.items():
        if key in keys:
            parts.append(form.format(params.get(key, "-")))
            group = key.split(".")[0] + "."
            keys = {k for k in keys if not k.startswith(group)}
    if "accum" in keys:  # the micro-batch follows from accum at the baseline's effective batch
        same = params.get("effective_batch_size") == base.get("effective_batch_size")
        keys = keys - {MICRO_BATCH} if same else keys | {"effective_batch_size"}
    parts += [f"{k}={params.get(k, '-')}" for k in sorted(keys, key=lambda k: (k != "accum", k))]
    return " ".join(parts) or "baseline"
