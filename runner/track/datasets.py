"""What a run trained on, as MLflow datasets: each split (train, val) logged as a run input with
its source and a digest of its actual data.

The digest hashes the bytes (and dtypes and shapes) of the first few batches of the split,
after the source's preparation, shuffling and batching: two runs on the same data with the
same seed and batch show the same digest; another seed, path, source or preparation shows
another. It works for any source the tf.data pipelines are built from, and costs a few
batches. The training split's are the batches the run trained on first, hashed as the loop
draws them (`Tap`): a second iterator of a split shuffled with reshuffle_each_iteration
would take a seed from the generator the training iterator shares, and change the order of
its later epochs. The validation split's come from a fresh iterator after the last
evaluation. The datasets are logged when training has finished (a resumed run logs none:
its first batches are not the split's). The source is the data config: `data.path` (or any
*path*/*file*/*url* key) as a local source, else the source's name (`generator` for
synthetic) as a code source.
"""

import hashlib
import itertools
import json
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.schema import TensorDatasetSchema
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.types.schema import Schema, TensorSpec
from omegaconf import DictConfig, OmegaConf

from runner.core.secrets import redact, redact_obj
from runner.track.tracker import Tracker, WorkerTracker

BATCHES = 2  # batches hashed per split: enough to tell data apart, cheap for 224 px images
CONTEXTS = {"train": "training", "val": "validation"}  # MLflow's mlflow.data.context values
_LOCATION_KEYS = ("path", "file", "url", "uri", "dir")


def _update(sha, batch) -> None:
    for tensor in tf.nest.flatten(batch):
        value = np.asarray(tensor)
        sha.update(f"{value.dtype}{value.shape}".encode())
        sha.update(np.ascontiguousarray(value).tobytes())


def digest(split: tf.data.Dataset, batches: int = BATCHES) -> str:
    """sha256 of the first `batches` batches of a fresh iterator of `split` (16 hex digits)."""
    sha = hashlib.sha256()
    for batch in itertools.islice(iter(split), batches):
        _update(sha, batch)
    return sha.hexdigest()[:16]


class Tap:
    """An iterator passed through unchanged, the first `batches` items it yields hashed as
    `digest` does: the digest of the training split, from the batches the run draws."""

    def __init__(self, iterator: Iterator, batches: int = BATCHES):
        self.iterator, self.left, self.sha = iterator, batches, hashlib.sha256()

    def __iter__(self) -> "Tap":
        return self

    def __next__(self):
        batch = next(self.iterator)
        if self.left > 0:
            _update(self.sha, batch)
            self.left -= 1
        return batch

    @property
    def digests(self) -> dict[str, str]:
        """{"train": digest} (log_datasets' `digests`)."""
        return {"train": self.sha.hexdigest()[:16]}


def _location(data: DictConfig) -> str | None:
    """Where a file-based source reads from: the first set key naming a path, file or URL."""
    for key, value in data.items():
        if isinstance(value, str) and value and any(k in key for k in _LOCATION_KEYS):
            return value
    return None


def source(data: DictConfig) -> DatasetSource:
    """The data config as an MLflow dataset source (a login in it redacted, issue 27)."""
    where = _location(data)
    if where is not None:
        from mlflow.data.sources import LocalArtifactDatasetSource

        return LocalArtifactDatasetSource(redact(where))
    config = redact_obj(OmegaConf.to_container(data, resolve=True))
    origin = "generator" if data.name == "synthetic" else data.name
    return CodeDatasetSource({"data": data.name, "source": origin, "config": json.dumps(config)})


def _schema(split: tf.data.Dataset) -> dict:
    """The split's element spec as MLflow tensor specs (features, then targets)."""

    def specs(spec) -> Schema:
        flat = tf.nest.flatten(spec)
        return Schema(
            [
                TensorSpec(
                    np.dtype(s.dtype.as_numpy_dtype), [-1 if d is None else d for d in s.shape]
                )
                for s in flat
            ]  # fmt: skip
        )

    element = split.element_spec
    pair = isinstance(element, tuple) and len(element) == 2
    features, targets = element if pair else (element, None)
    schema = TensorDatasetSchema(specs(features), specs(targets) if targets is not None else None)
    return schema.to_dict()


def dataset_input(
    data: DictConfig, name: str, split: tf.data.Dataset, hashed: str | None = None
) -> DatasetInput:
    """The split `name` of `data` as a run input, with its digest (`hashed`, else `digest`'s
    from a fresh iterator) and context tag."""
    hashed = hashed or digest(split)
    meta = MetaDataset(source(data), name=f"{data.name}:{name}", digest=hashed).to_dict()
    entity = Dataset(
        name=meta["name"],
        digest=meta["digest"],
        source_type=meta["source_type"],
        source=meta["source"],
        schema=json.dumps(_schema(split)),
        profile=json.dumps({"batches_hashed": BATCHES, "batch_size": data.batch_size}),
    )
    return DatasetInput(entity, tags=[InputTag("mlflow.data.context", CONTEXTS.get(name, name))])


def log_datasets(
    tracker: Tracker,
    data: DictConfig,
    splits: dict[str, tf.data.Dataset],
    digests: dict[str, str] | None = None,
) -> dict:
    """Log each split as a run input (the chief only; while the server is lost, the digests
    only, as tags), its digest from `digests` (a Tap's) or a fresh iterator; returns {split:
    digest}, also set as tags data/<split>_digest."""
    if isinstance(tracker, WorkerTracker):
        return {}
    digests = digests or {}
    inputs = [dataset_input(data, n, split, digests.get(n)) for n, split in splits.items()]
    digests = {name: i.dataset.digest for name, i in zip(splits, inputs, strict=True)}
    tracker.log_inputs(inputs)
    tracker.set_tags({f"data/{name}_digest": d for name, d in digests.items()})
    return digests
