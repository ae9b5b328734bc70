"""tfmemlab runner: Hydra config -> tf.data -> Keras model -> own training loop -> MLflow."""

import os

# Must happen before TensorFlow is imported anywhere: the BFC allocator is what makes
# tf.config.experimental.get_memory_info('CPU:0') work (see shared GUIDE, "CPU memory").
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# TensorFlow's INFO lines (oneDNN, cuda probing) drown the run summary.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
