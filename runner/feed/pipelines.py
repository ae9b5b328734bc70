"""tf.data pipelines: a source's examples -> shuffle -> parallel map -> batch -> prefetch.

The job's data source is the module its `data` YAML names (`data.module`: runner/data/, one
module per source, docs/data.md is their contract); its build gives `Examples`
(runner/data/examples.py): raw examples, a `prepare` function run in the parallel map, and
the `DataSpec` the model is built for. The training pipeline yields micro-batches of
`data.batch_size`; the train step (runner/techniques/accumulation.py) draws `accum` of them,
one at a time, per optimizer step.
"""

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil
import tensorflow as tf
from omegaconf import DictConfig

from models.spec import DataSpec
from runner.config.data import complete, request
from runner.data.contract import source_module
from runner.data.examples import Examples, held_bytes

AUTOTUNE = tf.data.AUTOTUNE


@dataclass
class Data:
    train: tf.data.Dataset  # (inputs, targets), each [batch_size, ...], repeated
    val: tf.data.Dataset  # (inputs, targets), each [batch_size, ...], one pass
    spec: DataSpec
    train_size: int
    steps_per_epoch: int  # optimizer steps per pass over the training split
    # The process's resident-memory growth over building these pipelines and drawing a first
    # training batch (build_data(measure=True); 0 when not measured): data held in memory
    # shows here, a streamed source's shuffle and prefetch buffers only.
    setup_rss_bytes: int = 0
    # A copy of the training pipeline, made afresh on each call, whose shuffle has a seed
    # state of its own: a second iterator of `train` itself would advance its shuffle's seed
    # state, and the epochs training draws after it would come in another order (measured:
    # trainer.bn_recalibrate's batches drawn that way changed the losses from the 2nd epoch on).
    twin: Callable[[], tf.data.Dataset] | None = None


def source_errors(cfg: DictConfig):
    """The source's own one-line errors for what is found only as its pipeline is drawn
    (a source module's `errors(d)`, e.g. tfrecord's short token record), else nothing."""
    errors = getattr(source_module(cfg.data.module), "errors", None)
    return errors(cfg.data) if errors is not None else contextlib.nullcontext()


def _train_pipeline(examples: Examples, buffer: int, seed: int, batch: int) -> tf.data.Dataset:
    return (
        examples.train.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .map(examples.prepare, num_parallel_calls=AUTOTUNE)
        .batch(batch, drop_remainder=True)
        .prefetch(AUTOTUNE)
    )


def build_data(cfg: DictConfig, image_model: bool, replicas: int = 1, measure=False) -> Data:
    """The training and validation pipelines for `cfg.data`; an epoch is `steps_per_epoch`
    optimizer steps of `cfg.accum` micro-batches each. With `replicas` > 1 the training
    micro-batches are global, data.batch_size x replicas (runner/techniques/distribution.py
    gives each replica its part). measure: draw a first batch and record the process's RSS
    growth (Data.setup_rss_bytes): a difference, below 0 when a process that ran jobs before
    gave back more than the data took."""
    if measure:
        gc.collect()  # an earlier job's garbage, freed now rather than inside the measurement
    rss_before = psutil.Process().memory_info().rss
    seed, accum = cfg.trainer.seed, cfg.accum
    batch = cfg.data.batch_size * replicas
    complete(cfg, image_model)  # what the files say, if validate has not filled it in yet
    examples = source_module(cfg.data.module).build(cfg.data, request(cfg, image_model))
    steps_per_epoch = examples.train_size // (batch * accum)
    if steps_per_epoch < 1:
        over = f" x {replicas} replicas" if replicas > 1 else ""
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} x accum={accum}{over} needs "
            f"{batch * accum} training examples, data={cfg.data.name} has {examples.train_size}"
        )
    buffer = min(cfg.data.shuffle_buffer, examples.train_size)
    train = _train_pipeline(examples, buffer, seed, batch)
    val = examples.val.map(examples.prepare, num_parallel_calls=AUTOTUNE)
    val = val.batch(cfg.data.batch_size).prefetch(AUTOTUNE)
    spec = replace(examples.spec, held_bytes=held_bytes(examples, buffer))
    data = Data(train, val, spec, examples.train_size, steps_per_epoch)
    data.twin = lambda: _train_pipeline(examples, buffer, seed, batch)
    if measure:
        next(iter(data.twin()))  # a twin's batch: the order training sees is left as it is
        data.setup_rss_bytes = psutil.Process().memory_info().rss - rss_before
    return data
