"""pruning=structured's figures: what the removal took out (channel groups, params, FLOPs),
the layers it left whole, and the training step's peak and time measured before and after it.

FLOPs are one example's forward pass as the TensorFlow profiler counts them on the traced
graph (runner/measure/flops.py graph_forward_flops), of the large model at the removal (the
marker runner/train/removal.py writes) and of the small one here.
"""

import numpy as np

from runner.measure.flops import graph_forward_flops
from runner.measure.history import History
from runner.report.pruning import dense_baseline
from runner.techniques.structured import ChannelPruner
from runner.track.tracker import Tracker


def _measured(history: History, name: str) -> dict[str, float]:
    """The steady steps' peak and median time (the first step of each part traces)."""
    if not history.losses:
        return {}
    total = np.asarray(history.wait_s) + np.asarray(history.compute_s)
    steady = total[1:] if len(total) > 1 else total
    return {
        f"prune/{name}/step_peak_bytes": history.steady_peak,
        f"prune/{name}/step_time_s_p50": float(np.median(steady)),
        f"prune/{name}/steps": len(history.losses),
    }


def structured_figures(
    pruner: ChannelPruner, tracker: Tracker, history: History, marker: dict | None, spec
) -> dict[str, float]:
    """prune/* figures of a structured run, its untouched layers as the prune/untouched tag
    and its choices as prune/scheduled_fraction at their steps."""
    untouched = "; ".join(f"{name}: {why}" for name, why in pruner.untouched.items())
    tracker.set_tags({"prune/untouched": untouched or "none"})
    for step, fraction in pruner.choices:
        tracker.log_metrics({"prune/scheduled_fraction": fraction}, step)
    if marker is None:  # the run ended before its removal (not on a finished run)
        return {}
    step, before = marker["step"], marker["before"]
    params, flops = pruner.model.count_params(), graph_forward_flops(pruner.model, spec)
    figures = {
        "prune/removed_at_step": step,
        "prune/target_fraction": pruner.schedule.target_fraction,
        "prune/channel_groups": len(pruner.groups),
        "prune/groups_reduced": pruner.removed_groups(),
        "prune/params_before": before["params"],
        "prune/params_after": params,
        "prune/params_ratio": params / before["params"],
        "prune/flops_before": before["flops"],
        "prune/flops_after": flops,
        "prune/flops_ratio": flops / before["flops"],
        "prune/fine_tune_steps": history.last_step - step,
        **_measured(history.before(step), "before"),
    }
    after = history.after(step)
    if after is not history:
        figures.update(_measured(after, "after"))
    # the run's mem/* and speed/* (runner/train/pipeline.py measures them the same way)
    of = (
        "the smaller model's steps after the removal"
        if after is not history
        else (
            "all steps: fewer than two followed the removal (mem/estimate is the smaller model's)"
        )
    )
    tracker.set_tags({"prune/figures_cover": of})
    return {**figures, **dense_baseline(tracker, history.evals[-1][1]["val/accuracy"])}


def structured_summary(figures: dict) -> str:
    line = (
        f"  removed {figures['prune/target_fraction']:.0%} of {figures['prune/channel_groups']}"
        f" channel groups at step {figures['prune/removed_at_step']}: params "
        f"{figures['prune/params_ratio']:.2f}x, FLOPs {figures['prune/flops_ratio']:.2f}x; "
        f"{figures['prune/fine_tune_steps']} steps fine-tuned the smaller model"
    )
    if "prune/after/step_time_s_p50" in figures and "prune/before/step_peak_bytes" in figures:
        time = figures["prune/after/step_time_s_p50"] / figures["prune/before/step_time_s_p50"]
        peak = figures["prune/after/step_peak_bytes"] / figures["prune/before/step_peak_bytes"]
        line += f" (step time {time:.2f}x, step peak {peak:.2f}x the masked large model's)"
    if "prune/dense_val_accuracy" in figures:
        line += (
            f", dense baseline val/accuracy {figures['prune/dense_val_accuracy']:.4f} "
            f"({figures['prune/val_accuracy_delta']:+.4f})"
        )
    return line
