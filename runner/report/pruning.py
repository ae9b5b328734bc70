"""The pruning figures of a run (issue 6): sparsity, the compressed weights file, the per-kernel
table as an artifact, and the dense baseline's accuracy beside it. The pruned model is the
run's model.keras (runner/track/model.py): its masks belong to the Pruner, so it is kept
stripped, its zeros in its kernels."""

import csv
from pathlib import Path

from runner.measure.history import History
from runner.techniques.pruning import Pruner, gzip_weights_bytes
from runner.track.tracker import Tracker

# Params that do not change what is trained: a dense baseline may differ in these.
_NOT_COMPARED = ("pruning.", "mlflow.", "trainer.progress", "trainer.save_model")


def dense_baseline(tracker: Tracker, val_accuracy: float) -> dict[str, float]:
    """The latest finished dense run of this experiment with the same params except pruning.*
    (same model, data, seed and steps): its val/accuracy beside this run's, if there is one.
    None is looked for while the tracking server is lost (Tracker.lost)."""
    if tracker.lost is not None:
        return {}
    client = tracker.client
    run = client.get_run(tracker.run_id)

    def compared(params: dict) -> dict:
        return {k: v for k, v in params.items() if not k.startswith(_NOT_COMPARED)}

    dense_runs = client.search_runs(
        [run.info.experiment_id],
        "params.`pruning.schedule` = 'none' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=200,
    )
    for dense in dense_runs:
        same_job = compared(dense.data.params) == compared(run.data.params)
        if same_job and "val/accuracy" in dense.data.metrics:
            tracker.set_tags({"prune/dense_run_id": dense.info.run_id})
            accuracy = dense.data.metrics["val/accuracy"]
            return {
                "prune/dense_val_accuracy": accuracy,
                "prune/val_accuracy_delta": val_accuracy - accuracy,
            }
    tracker.set_tags({"prune/dense_run_id": "none: run the same job with pruning=none"})
    return {}


def pruning_figures(
    pruner: Pruner | None, tracker: Tracker, run_dir: Path, history: History
) -> dict[str, float]:
    """prune/* figures, with the per-kernel table as an artifact (issue 6); none without
    pruning.

    prune/sparsity: zeros over all pruned kernels. prune/gzip_ratio: the gzip-compressed weights
    file (model.save_weights) of the model as built (dense) over that of the model at the end
    (pruned); embeddings, biases and norms are in both.
    """
    if pruner is None:
        return {}
    rows = pruner.table()
    run_dir.mkdir(parents=True, exist_ok=True)
    table = run_dir / "pruning_table.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tracker.log_artifact(table)
    for step, sparsity in pruner.updates:
        tracker.log_metrics({"prune/scheduled_sparsity": sparsity}, step)
    zeros, size = sum(r["zeros"] for r in rows), sum(r["size"] for r in rows)
    figures = {
        "prune/sparsity": zeros / size,
        "prune/pruned_params": zeros,
        "prune/gzip_ratio": pruner.dense_gzip_bytes / gzip_weights_bytes(pruner.model),
    }
    return {**figures, **dense_baseline(tracker, history.evals[-1][1]["val/accuracy"])}


def pruning_summary(figures: dict) -> str:
    line = (
        f"  pruned: sparsity {figures['prune/sparsity']:.3f} of the pruned kernels, weights "
        f"file {figures['prune/gzip_ratio']:.2f}x smaller gzipped"
    )
    if "prune/dense_val_accuracy" in figures:
        line += (
            f", dense baseline val/accuracy {figures['prune/dense_val_accuracy']:.4f} "
            f"({figures['prune/val_accuracy_delta']:+.4f})"
        )
    masks = figures["mem/estimate/masks_bytes"] / 2**20
    return line + f"; training memory not lowered (masks +{masks:.2f} MiB)"
