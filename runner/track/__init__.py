"""Tracking: MLflow runs. The store and its client (server, client, store's repair), the
tracker a run logs through (tracker), a run's life from open to close (lifecycle), sending what
a lost server missed (upload), and runs compared side by side (compare)."""
