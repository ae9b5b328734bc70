"""XLA's own plan of the compiled step as the estimate (runner/estimate/xla_plan.py): its
parameters are the variables and inputs the call reads, to the byte, and the plans are cached
by what decides them. A run compiled by XLA estimated by it: tests/test_user_models.py (a
subclassed CNN), tests/test_memory_figures.py (the transformer, against XLA's own dump)."""

import keras
import pytest

from models.spec import DataSpec
from runner.estimate import resident, xla_plan

BATCH, FEATURES, CLASSES = 8, 48, 10
SPEC = DataSpec(kind="image", input_shape=(FEATURES,), num_classes=CLASSES)


def dense_model() -> keras.Model:
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(96, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(CLASSES)(h))


@pytest.fixture
def model():
    keras.backend.clear_session()
    return dense_model()


def adam(model) -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    return optimizer


def test_a_calls_parameters_are_the_variables_it_reads_and_its_inputs(model):
    # Counted from the variables themselves, not from the plan: the weights (22,696 bytes),
    # Adam's slots and step count (45,404) and the micro-batch (8 x 48 float32 inputs, 8 int32
    # labels). An accumulating step's micro-batch call reads the weights, their float32 sums and
    # its `first` flag (a bool), not the slots; its update reads the weights, slots, sums and the
    # accum losses. Were a plan's allocation told apart wrongly (a temporary read as a
    # parameter), these sums would not meet to the byte.
    optimizer = adam(model)
    weights, slots = resident.nbytes(model.weights), resident.nbytes(optimizer.variables)
    batch = BATCH * FEATURES * 4 + BATCH * 4
    (one,) = xla_plan.plan_step(model, optimizer, SPEC, 1, BATCH)
    assert one.parameters == weights + slots + batch
    micro, update = xla_plan.plan_step(model, optimizer, SPEC, 2, BATCH)
    sums = resident.nbytes(model.trainable_variables)  # float32 weights: their sums' size
    assert micro.parameters == weights + sums + batch + 1
    assert update.parameters == weights + slots + sums + 2 * 4
    # What a call adds grows with the micro-batch: activations and their gradients.
    (larger,) = xla_plan.plan_step(model, optimizer, SPEC, 1, 4 * BATCH)
    assert larger.temporaries > one.temporaries > 0


def test_plans_are_cached_by_what_decides_them(model, tmp_path):
    optimizer = adam(model)
    what = xla_plan.key(model, optimizer, 1, BATCH, None)
    first, hit = xla_plan.cached(
        tmp_path, what, lambda: xla_plan.plan_step(model, optimizer, SPEC, 1, 8)
    )
    assert not hit and len(list(tmp_path.glob("xla-plan-*.json"))) == 1
    again, hit = xla_plan.cached(tmp_path, what, lambda: pytest.fail("compiled again"))
    assert hit and again == first
    # Another micro-batch is another plan.
    other = xla_plan.key(model, optimizer, 1, 2 * BATCH, None)
    assert other != what
    _, hit = xla_plan.cached(
        tmp_path, other, lambda: xla_plan.plan_step(model, optimizer, SPEC, 1, 16)
    )
    assert not hit and len(list(tmp_path.glob("xla-plan-*.json"))) == 2
