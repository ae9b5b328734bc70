"""BatchNorm in a run: what its statistics mean after accumulation and after a short run, and
re-estimating them on training batches before evaluation (trainer.bn_recalibrate).

Evaluation normalises with the moving statistics, which start at mean 0, variance 1 and move
towards the batches' by (1 - momentum) per update, one update per micro-batch. After n updates
a share momentum^n of the initial values remains (0.99^40 = 67%), so a short run's val loss
and accuracy say little about the model: the summary says so when that share is noticeable.
"""

import keras

SHARE_SHOWN = 0.05  # the initial statistics' share above which a run's notes mention it


def batchnorm_layers(model) -> list:
    """Every BatchNormalization layer in the model, nested ones included."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def accum_note(cfg, model) -> str | None:
    """accum > 1 on a model with BatchNorm: its statistics see micro-batches, not the batch."""
    if cfg.accum > 1 and batchnorm_layers(model):
        return (
            f"model={cfg.model.name} has BatchNorm, whose statistics update on every "
            f"micro-batch of {cfg.data.batch_size}: accum={cfg.accum} matches a batch of "
            f"{cfg.data.batch_size * cfg.accum} in its gradients, not in its BatchNorm "
            "statistics."
        )
    return None


def initial_share(model, updates: int) -> float | None:
    """The share of the moving statistics still at their initial values after `updates`
    micro-batches, for the slowest BatchNorm (highest momentum); None without BatchNorm."""
    layers = batchnorm_layers(model)
    if not layers:
        return None
    return max(float(layer.momentum) for layer in layers) ** updates


def short_run_note(cfg, model, updates: int) -> str | None:
    """The summary's warning that val figures use unsettled BatchNorm statistics, if they do."""
    share = initial_share(model, updates)
    if share is None or share <= SHARE_SHOWN:
        return None
    momentum = max(float(layer.momentum) for layer in batchnorm_layers(model))
    if cfg.trainer.bn_recalibrate:
        return (
            f"BatchNorm statistics re-estimated on {cfg.trainer.bn_recalibrate} training "
            f"micro-batches before each evaluation (trainer.bn_recalibrate); the moving "
            f"averages alone would still hold {share:.0%} of their initial values "
            f"(momentum {momentum:g}, {updates} updates)."
        )
    return (
        f"val figures use BatchNorm moving statistics that have not settled: after {updates} "
        f"updates (micro-batches) at momentum {momentum:g}, {share:.0%} of them is still the "
        "initial mean 0 / variance 1. Read val/accuracy as this short run's, not the model's "
        "quality; trainer.bn_recalibrate=N re-estimates them on N training batches first."
    )


def recalibrate(model, batches, n: int) -> None:
    """Reset every BatchNorm's moving mean and variance and re-estimate them as the plain
    average over n training micro-batches run in training mode (momentum i/(i+1) at the i-th,
    counted from 0), without touching any other weight; momentum is restored after."""
    layers = batchnorm_layers(model)
    if not layers or n < 1:
        return
    saved = [layer.momentum for layer in layers]
    for layer in layers:
        layer.moving_mean.assign(keras.ops.zeros_like(layer.moving_mean))
        layer.moving_variance.assign(keras.ops.ones_like(layer.moving_variance))
    try:
        for i in range(n):
            for layer in layers:
                layer.momentum = i / (i + 1)
            x, _ = next(batches)
            model(x, training=True)  # eager: each call reads the momentum set above
    finally:
        for layer, momentum in zip(layers, saved, strict=True):
            layer.momentum = momentum
