"""Tracking: MLflow runs, sweeps and their comparison."""
