"""The memory estimate: what a training step is predicted to hold at its peak, part by part,
from the layer rules, the executor rules and the closed forms (runner/measure holds what is
measured)."""
