"""data=custom: a user's function returns the data as a tf.data.Dataset; this checks it.

The function `data._target_` names (pkg.module.fn, imported from the current directory or
PYTHONPATH) is called once, with `data.kwargs` as keyword arguments. It returns either one
tf.data.Dataset of (input, target) pairs in a fixed order, from which every k-th element is
held out for validation (k = round(1 / data.val_fraction)), or a (train, val) pair of them.
The runner shuffles, maps, batches and prefetches it like any source. Before TensorFlow
loads, `check` finds the function without running it (runner/core/targets.py, as a model's
is); what only the running function can say is one line naming data._target_ when the data
is built: it cannot be imported, it raises (its message), or what it returns is not a
dataset of pairs shaped for the model.
"""

from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from models.spec import DataSpec
from runner.core import targets
from runner.core.errors import ConfigError, error_line
from runner.data import checks
from runner.data.checks import require
from runner.data.contract import Request

if TYPE_CHECKING:  # the build side's: TensorFlow is imported when a build runs
    from runner.data.examples import Examples

KINDS = ("image", "tokens")
RETURNS = "a function returning a tf.data.Dataset of (input, target), or a (train, val) pair"


def check(d: DictConfig, request: Request) -> None:
    checks.val_fraction(d)
    reason = targets.problem(d._target_)
    allowed = f"an importable function pkg.module.fn: {reason}"
    require(reason is None, "data._target_", d._target_, allowed)
    checks.train_records(d)


def _call(d: DictConfig):
    """What the function returns; ConfigError if it cannot be imported or raises."""
    try:
        fn = targets.load(d._target_)
    except targets.TargetError as err:
        allowed = f"an importable function pkg.module.fn: {err}"
        raise ConfigError("data._target_", d._target_, allowed) from None
    try:
        return fn(**OmegaConf.to_container(d.kwargs, resolve=True))
    except Exception as err:  # the user's code: any error, said in one line
        allowed = f"{RETURNS}; it raised {error_line(err)}"
        raise ConfigError("data._target_", d._target_, allowed) from err


def _datasets(out, target: str) -> tuple:
    """(train, val or None) of what the function returned."""
    import tensorflow as tf

    if isinstance(out, tf.data.Dataset):
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2:
        if all(isinstance(o, tf.data.Dataset) for o in out):
            return out[0], out[1]
    raise ConfigError("data._target_", target, f"{RETURNS}; it returned {type(out).__name__}")


def _pair_spec(ds, target: str, split: str) -> tuple:
    import tensorflow as tf

    spec = ds.element_spec
    ok = isinstance(spec, tuple) and len(spec) == 2
    if not (ok and all(isinstance(s, tf.TensorSpec) for s in spec)):
        shown = str(spec).replace("\n", " ")
        allowed = f"{RETURNS}; its {split} elements are {shown}"
        raise ConfigError("data._target_", target, allowed)
    return spec


def _described(spec) -> str:
    return f"{spec.shape.as_list()} {spec.dtype.name}"


def _spec(d: DictConfig, x, y, images: bool) -> DataSpec:
    """The DataSpec of elements (x, y): tokens [seq_len] (integers) or images [H, W, 1|3]."""
    tokens = x.shape.rank == 1 and x.dtype.is_integer and x.shape[0] is not None
    image = x.shape.rank == 3 and x.shape[-1] in (1, 3)
    want = "images [H, W, 1|3]" if images else "integer tokens [seq_len]"
    if not (image if images else tokens):
        allowed = f"{RETURNS}, with inputs {want}; they are {_described(x)}"
        raise ConfigError("data._target_", d._target_, allowed)
    per_token = not images and y.shape.as_list() == x.shape.as_list()
    if not per_token and y.shape.rank != 0:
        allowed = f"{RETURNS}, with targets [] or {x.shape.as_list()}; they are {_described(y)}"
        raise ConfigError("data._target_", d._target_, allowed)
    if not images and d.vocab_size is None:
        raise ConfigError("data.vocab_size", None, "the token vocabulary (ids 0..vocab_size-1)")
    if not per_token and d.num_classes is None:
        allowed = f"the number of classes of the targets {d._target_} returns"
        raise ConfigError("data.num_classes", None, allowed)
    if images:
        return DataSpec("image", (d.image_size, d.image_size, 3), d.num_classes)
    classes = d.vocab_size if per_token else d.num_classes
    return DataSpec("tokens", (x.shape[0],), classes, per_token, d.vocab_size)


def _size(ds, d: DictConfig) -> int:
    """Elements of ds: data.train_records, else its cardinality, else one streamed pass."""
    import numpy as np
    import tensorflow as tf

    if d.train_records is not None:
        return d.train_records
    n = int(ds.cardinality())
    if n == tf.data.INFINITE_CARDINALITY:
        allowed = f"{RETURNS}, finite (it is infinite), or data.train_records set"
        raise ConfigError("data._target_", d._target_, allowed)
    if n >= 0:
        return n
    return int(ds.reduce(np.int64(0), lambda count, _: count + 1))  # one element at a time


def build(d: DictConfig, request: Request) -> "Examples":
    """The user's datasets, checked; validation split off by index when there is none."""
    import tensorflow as tf

    from runner.data.examples import Examples, every_kth, image_prepare, split_every_kth

    train, val = _datasets(_call(d), d._target_)
    x, y = _pair_spec(train, d._target_, "training")
    if val is not None:
        _pair_spec(val, d._target_, "validation")
    spec = _spec(d, x, y, request.images)
    n = _size(train, d)
    if val is None:
        k, n_val = every_kth(n, d.val_fraction)
        (train, val), n = split_every_kth(train, k), n - n_val
    if request.images:
        prepare = image_prepare(d.image_size, float(d.pixel_max), request.pixels)
    else:

        def prepare(inputs, targets):
            return tf.cast(inputs, tf.int32), tf.cast(targets, tf.int32)

    return Examples(train, val, prepare, spec, n)
