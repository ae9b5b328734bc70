"""What the trained model costs where it runs (issue 49): the model a run keeps (model.keras)
exported as a SavedModel and converted to LiteRT flatbuffers (convert.py), each variant loaded
and timed in a fresh process (child.py), checked against the Keras model's own predictions on
the validation split and logged into the same run (job.py, report.py).

    python run.py model=mobilenet data=digits deploy=litert      # at the end of the run
    python -m runner.deploy outputs/runs/<day>/<time>            # a run already trained

Nothing here is imported with deploy=none (runner/train/pipeline.py imports it only for a run
that asks for it): the default run does not pay for TensorFlow Lite's converter or LiteRT.
"""
