"""Channels removed from a functional model: which must go together (groups.py), and the model
rebuilt without them (surgery.py)."""
