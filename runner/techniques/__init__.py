"""Techniques applied to the training job: precision, checkpointing, pruning."""
