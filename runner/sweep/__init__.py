"""Sweeps: a Hydra multirun as one MLflow parent run with a child per job and a comparison at
the end (callback), each job in a fresh process of its own (job), the sweep's state in its
folder (state), and a stopped sweep resumed where it was (resume)."""
