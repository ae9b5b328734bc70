"""The end-of-run summary: printed, and the run's description on its MLflow page."""

from dataclasses import dataclass, field

from runner.core.secrets import redact
from runner.measure.history import History
from runner.report.layer_report import summary_lines
from runner.report.pruning import pruning_summary
from runner.report.structured import structured_summary
from runner.track.client import ui_hint
from runner.track.tracker import WorkerTracker

# How the summary names mem/peak_reserved_bytes, by mem/reserved_source.
_RESERVED_LABEL = {"rss_delta": "process RSS +", "nvidia_smi": "GPU held ", "none": "held ?"}


@dataclass
class Outcome:
    """What a finished run has to say for itself."""

    where: str  # the device, or "<n> replicas (<strategy>)"
    history: History
    figures: dict
    sources: dict  # tags saying where the figures came from
    seconds: float  # wall time of the whole run
    notes: list[str] = field(default_factory=list)  # precision and BatchNorm notes
    table: list[dict] = field(default_factory=list)  # the layer profile's rows, if any


def _estimate(figures: dict, sources: dict) -> str:
    if "mem/estimate_bytes" not in figures:  # a subclassed model (estimate.NOT_MODELLED)
        return "estimate: activations not modelled"
    said = f"estimate {figures['mem/estimate_bytes'] / 2**20:.1f} MiB"
    if "not modelled:" in sources.get("mem/estimate_note", ""):  # coverage.note
        said += ", a lower bound"
    return said


def _steady(figures: dict) -> str:
    """The timed steps' p10-p90 and their width against the median: how steady the run was."""
    p10, p50, p90 = (figures[f"speed/step_time_s_p{q}"] for q in (10, 50, 90))
    return f"{p10 * 1e3:.1f}-{p90 * 1e3:.1f} ms, +-{50 * (p90 - p10) / p50:.0f}%"


def summary(cfg, tracker, outcome: Outcome) -> str:
    """The end-of-run summary: printed, and the run's description in the MLflow UI."""
    history, figures, sources = outcome.history, outcome.figures, outcome.sources
    dev, seconds, notes, table = outcome.where, outcome.seconds, outcome.notes, outcome.table
    losses, final = history.losses, history.evals[-1][1]
    lines = [
        f"tfmemlab: model={cfg.model.name} precision={cfg.precision.name} accum={cfg.accum} "
        f"on {dev}: {len(losses)} steps in {seconds:.1f} s"
        + (
            f" (resumed: steps {history.first_step}-{history.last_step}; the figures cover "
            "these only)"
            if history.first_step > 1
            else ""
        ),
        f"  train/loss {losses[0]:.4f} -> {losses[-1]:.4f}   val/loss {final['val/loss']:.4f}"
        f"   val/accuracy {final['val/accuracy']:.4f}",
    ]
    if "prune/sparsity" in figures:
        lines.append(pruning_summary(figures))
    if "prune/params_ratio" in figures:
        lines.append(structured_summary(figures))
    lines.append(
        f"  peak {figures['mem/peak_bytes'] / 2**20:.1f} MiB ({_estimate(figures, sources)}; "
        f"{_RESERVED_LABEL[sources['mem/reserved_source']]}"
        f"{figures['mem/peak_reserved_bytes'] / 2**20:.1f} MiB)   step "
        f"{figures['speed/step_time_s_p50'] * 1e3:.1f} ms p50 "
        f"(p10-p90 {_steady(figures)})   "
        f"{figures['speed/samples_per_s']:.1f} samples/s   compile "
        f"{figures['speed/compile_s']:.1f} s"
    )
    if "host/data_setup_rss_bytes" in figures:  # in memory or streamed: docs/data.md
        lines.append(
            f"  host: data setup (data={cfg.data.name}, to its first batch) process RSS "
            f"{figures['host/data_setup_rss_bytes'] / 2**20:+.1f} MiB"
        )
    if "mem/estimate_note" in sources:  # what the estimate leaves out (estimate.estimate_note)
        lines.append(f"  estimate: {sources['mem/estimate_note']}")
    if "mem/peak_scope" in sources:  # under tf.distribute; the estimate is one replica's
        lines.append(f"  peak of {sources['mem/peak_scope']}; the estimate is one replica's")
    if table:
        lines += summary_lines(figures, table)
    lines += [f"  note: {note}" for note in notes]
    if isinstance(tracker, WorkerTracker):
        lines.append("  MLflow: this worker's figures are in the chief's run")
        return "\n".join(lines)
    command, url = ui_hint(cfg.mlflow.tracking_uri, tracker.experiment_id, tracker.run_id)
    lines.append(f"  MLflow: run '{tracker.run_name}' in experiment '{cfg.mlflow.experiment}'")
    if command:
        lines.append(f"  open the UI: {command}")
    lines.append(f"  then: {url}")
    return redact("\n".join(lines))  # printed and the run's description: no login in it
