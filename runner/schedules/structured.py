"""pruning=structured: whole channels (Dense units, convolution filters, attention heads)
masked on the other schedules' clock and polynomial ramp, then removed at end_step, after
which the run trains the smaller model (runner/techniques/structured.py does both).

The fraction is of each channel group's channels (runner/channels/: the layers whose channels
must go together); a group keeps a multiple of round_to channels.
"""

from dataclasses import dataclass
from typing import ClassVar

from runner.schedules.magnitude import ramp
from runner.schedules.schedule import Gradual, require

IMPORTANCE = ("l1", "l2", "taylor")


@dataclass
class Structured(Gradual):
    """A group's channels ranked by importance over the group's weights (l1: sum |w|, l2:
    sum w^2, taylor: sum |w x dL/dw| accumulated over the steps since the last choice); the
    lowest masked, the fraction rising from initial_fraction to target_fraction as Zhu &
    Gupta's polynomial (magnitude.Polynomial) rises; removed for good at end_step.

    Choices are made on the host between two steps, and the masks are one float32 vector per
    weight axis a group indexes: a choice holds no kernel copy in the step (choice_copies 0).
    A masked channel's weights are zero from then on, so it cannot come back (regrow false)."""

    name = "structured"
    choice_copies: ClassVar[int] = 0
    removes: ClassVar[bool] = True
    schedule: str = "structured"
    target_fraction: float = 0.5  # the share of each group's channels removed at end_step
    initial_fraction: float = 0.0  # at begin_step
    power: float = 3.0
    importance: str = "l1"
    round_to: int = 8  # a group keeps a multiple of this many channels (all, if it has fewer)
    regrow: bool = False

    def check(self, total_steps: int | None = None) -> None:
        for key in ("target_fraction", "initial_fraction"):
            value = getattr(self, key)
            require(0.0 <= value < 1.0, key, value, "a number in [0, 1)")
        require(self.power > 0, "power", self.power, "a number > 0")
        require(self.importance in IMPORTANCE, "importance", self.importance, ", ".join(IMPORTANCE))
        require(self.round_to >= 1, "round_to", self.round_to, "an integer >= 1")
        why = "false: a masked channel's weights stay zero until it is removed"
        require(not self.regrow, "regrow", self.regrow, why)
        super().check(total_steps)

    def sparsity(self, step, total_steps: int):
        initial, target = self.initial_fraction, self.target_fraction
        return ramp(step, self.begin_step, self.end(total_steps), initial, target, self.power)
