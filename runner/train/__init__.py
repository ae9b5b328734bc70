"""The training job: the pipeline `run(cfg)` (pipeline), the job and what it trains with (job),
the data (data), the device (device), the optimizer and evaluation step (optimizer), the
readable loop (loop), checkpoints (checkpoint), signals (signals) and the run directory
(rundir).

`from runner.train import run` imports the pipeline on first use, so that the TensorFlow-free
modules of this package (rundir, signals) load without TensorFlow: the command line checks a
resume before TensorFlow is imported.
"""


def __getattr__(name: str):
    if name == "run":
        from runner.train.pipeline import run

        return run
    raise AttributeError(f"module 'runner.train' has no attribute {name!r}")
