"""Measurement: memory and speed telemetry, the analytic estimate, the per-layer profile
and the run's report."""
