"""tfmemlab: Hydra config -> tf.data -> Keras model -> own training loop -> MLflow.

The packages, bottom up (docs/architecture.md; tests/test_house.py keeps the order):
core -> config -> techniques -> measure -> track -> report -> train, deploy -> cli ->
plan, sweep -> launch, bench; run.py on top. `models/` sits beside core: it imports no
tfmemlab package.
"""

from runner.core.start import prepare_environment

# Before TensorFlow is imported anywhere: any tfmemlab import comes through here first.
prepare_environment()
