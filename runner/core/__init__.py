"""The TensorFlow-free bottom of tfmemlab: what every other package shares.

Errors with one-line messages (errors), byte units (units), plain-text tables (text), running
something in a fresh process (process), the machine's CPU (machine) and TensorFlow's start-up
(start). Nothing here imports TensorFlow at module level, nor any other tfmemlab package.
"""
