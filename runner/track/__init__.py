"""Tracking: MLflow runs. The store and its client (server, client, store's repair), the
tracker a run logs through (tracker), a run's life from open to close (lifecycle), sending what
a lost server missed (upload), runs compared side by side (compare), and what a run says it
ran: its code (source), its data (datasets) and the trained model it keeps (model)."""
