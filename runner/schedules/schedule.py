"""A pruning schedule (`pruning=<option>`) as one value: the schema of its YAML's keys, their
checks (free of TensorFlow, run before it loads), when its masks are chosen, its sparsity at a
step, how a choice is made and what a choice holds in memory.

Each option of conf/pruning/ extends the schema of its class (`defaults: [base_<name>]`,
registered by runner/config/store.py) and names it (`schedule: <name>`): a new schedule is one
YAML and one subclass that sets `name`. TensorFlow is imported inside the methods that make
tensors, as the data sources do (runner/data/).

The clock is tensorflow-model-optimization 0.8.1's (file:line below are tensorflow_model_
optimization/python/core/sparsity/keras/ there; tests/test_pruning_tfmot.py runs tfmot beside
it). Step t is the t-th optimizer step, from 1, i.e. `optimizer.iterations + 1` as it starts;
the LR schedule reads the same counter. tfmot's wrapper adds 1 to its pruning_step (set to 0 by
UpdatePruningStep.on_train_begin, pruning_callbacks.py:54-65) at the start of every training
call, then runs conditional_mask_update with it (pruning_wrapper.py:289-314): its step t is
ours. A float16 step skipped for overflow advances neither of our clocks. Masks are chosen
at the start of step t if begin_step <= t <= end_step and (t - begin_step) % frequency == 0
(_should_prune_in_step, pruning_schedule.py:40-64): with begin_step 0 the first choice is at
step `frequency`, after frequency - 1 trained steps. Ours adds end_step itself, so a schedule
ends on its target when end_step - begin_step is not a multiple of frequency (tfmot stops
short). A first choice at step 1 is refused: it would rank the initial weights, i.e. prune at
random.
"""

import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ConfigError

SCHEDULES: dict[str, type["Schedule"]] = {}  # name -> class, filled as the classes are defined
UNTRAINED = "(step 1 starts from the untrained weights)"


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """A one-line ConfigError on `pruning.<key>` unless ok."""
    if not ok:
        raise ConfigError(f"pruning.{key}", value, allowed)


@dataclass
class Schedule:
    """What every pruning option has: its name, and which variables it prunes.

    include: regexes on variable paths (e.g. "block_0/mlp_up/kernel"); [] is Dense, EinsumDense
    and conv kernels but the first conv's (runner/techniques/pruning.py select_kernels);
    exclude: regexes of variables then left dense."""

    name: ClassVar[str] = ""
    choice_copies: ClassVar[int] = 0  # copies of a kernel a choice holds at once (see below)
    removes: ClassVar[bool] = False  # channels removed from the model (structured.py)

    schedule: str = "none"
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            SCHEDULES[cls.name] = cls

    @property
    def prunes(self) -> bool:
        return self.choice_copies > 0

    def check(self, total_steps: int | None = None) -> None:
        """One line for the first bad key; total_steps: the run's optimizer steps, if known."""
        for key in ("include", "exclude"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error:
                    raise ConfigError(f"pruning.{key}", pattern, "regular expressions") from None

    def is_update_step(self, step, total_steps: int):
        """Are masks chosen at the start of step `step` (from 1)? For a Python int or an int64
        tensor (the compiled step asks with optimizer.iterations + 1)."""
        return False

    def sparsity(self, step, total_steps: int):
        """The schedule's sparsity at step `step`, a float32 tensor."""
        raise NotImplementedError(f"pruning={self.name} chooses no masks")

    def choose(self, scores, sparsity, axes: tuple[int, ...]):
        """A float32 mask of `scores` (|w|) at `sparsity`; `axes`: the kernel's input axes."""
        raise NotImplementedError(f"pruning={self.name} chooses no masks")

    def sparsity_at(self, step: int, total_steps: int) -> float:
        """The sparsity the masks hold during step `step`: the schedule's value at the last
        choice at or before it (0 before the first)."""
        chosen = [t for t in range(2, step + 1) if self.is_update_step(t, total_steps)]
        return float(self.sparsity(chosen[-1], total_steps)) if chosen else 0.0


@dataclass
class NoPruning(Schedule):
    """pruning=none: dense training."""

    name = "none"


@dataclass
class Gradual(Schedule):
    """A schedule that chooses masks on tfmot's clock (module docstring), from the weights'
    magnitudes after each update. regrow: pruned weights keep training and may be chosen
    back, as in tfmot; false ranks them below every kept one, so they stay pruned.

    choice_copies: the float32 copies of a kernel its choice holds beside its new mask
    (runner/estimate/executor_rules.py choice_bytes): a magnitude choice its scores (|w|), then
    top_k's indices beside the kept flags. **Measured** under XLA on a CPU, which chooses one
    kernel at a time: the plan of a step on six Dense kernels of 4 or 16 MiB held two copies of
    every mask and 2.00 copies of one kernel beyond the step without pruning (56.1 MiB at 4 MiB,
    224.2 at 16)."""

    choice_copies: ClassVar[int] = 2

    begin_step: int = 0  # choices at begin_step + k x frequency (step 0 never runs)
    end_step: int | None = None  # and at end_step, the last choice; null: the run's last step
    frequency: int = 100  # steps between choices (tfmot's default)
    regrow: bool = True

    def end(self, total_steps: int) -> int:
        return total_steps if self.end_step is None else self.end_step

    def check(self, total_steps: int | None = None) -> None:
        super().check(total_steps)
        require(self.begin_step >= 0, "begin_step", self.begin_step, "a number >= 0")
        require(self.frequency >= 1, "frequency", self.frequency, "a number >= 1")
        require(self.begin_step != 1, "begin_step", self.begin_step, f"0 or >= 2 {UNTRAINED}")
        first_ok = self.begin_step > 0 or self.frequency > 1
        require(first_ok, "frequency", self.frequency, f">= 2 with begin_step=0 {UNTRAINED}")
        end = self.end_step
        end_ok = end is None or end >= max(self.begin_step, 2)
        require(end_ok, "end_step", end, f"null or >= begin_step and >= 2 {UNTRAINED}")
        if total_steps is not None:
            self.check_steps(total_steps)

    def check_steps(self, total_steps: int) -> None:
        """begin_step and end_step must fall within the run's optimizer steps (1 to
        total_steps), so the masks reach their target while it still trains, and the last
        choice (end_step; null: the last step) must follow a trained step."""
        allowed = f"a step <= {total_steps} (the run has {total_steps} optimizer steps)"
        for key in ("begin_step", "end_step"):
            value = getattr(self, key)
            require(value is None or value <= total_steps, key, value, allowed)
        allowed = "a step >= 2, or null in a run of >= 2 optimizer steps"
        require(self.end_step is not None or total_steps >= 2, "end_step", None, allowed)

    def is_update_step(self, step, total_steps: int):
        begin, end = self.begin_step, self.end(total_steps)
        on_grid = (step - begin) % self.frequency == 0
        return (step >= begin) & (step <= end) & (on_grid | (step == end))


def schedule_of(p) -> Schedule:
    """The schedule a `pruning` config describes (a DictConfig, or a dict): the class its
    `schedule` names, with the keys of that class; one line if it names none, or another
    class than its node's (an override of pruning.schedule on another option's keys)."""
    name = p["schedule"]
    cls = SCHEDULES.get(name)
    if cls is None:
        allowed = "one of " + ", ".join(sorted(SCHEDULES))
        raise ConfigError("pruning.schedule", name, f"{allowed} (pruning=<option> chooses it)")
    if isinstance(p, DictConfig):
        node = OmegaConf.get_type(p)
        if isinstance(node, type) and issubclass(node, Schedule) and node is not cls:
            allowed = f"{node.name} (pruning={name} chooses that schedule with its own keys)"
            raise ConfigError("pruning.schedule", name, allowed)
        p = OmegaConf.to_container(p, resolve=True)
    return cls(**{f.name: p[f.name] for f in fields(cls) if f.name in p})
