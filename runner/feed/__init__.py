"""The job's input pipelines: tf.data from a data source's examples (runner/data/) as the job's
config asks (runner/config/data.py), for training, evaluation and calibration alike."""
