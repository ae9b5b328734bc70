"""What the training loop measured, step by step: losses, times, memory and evaluations.

The loop (runner/train/loop.py) fills it; the run's figures and pictures (runner/report/)
read it.
"""

from dataclasses import dataclass, field


@dataclass
class History:
    losses: list[float] = field(default_factory=list)  # mean train loss per optimizer step
    wait_s: list[float] = field(default_factory=list)  # waiting for the input pipeline
    compute_s: list[float] = field(default_factory=list)  # the compiled step, loss read back
    evals: list[tuple[int, dict]] = field(default_factory=list)
    current_bytes: list[int] = field(default_factory=list)  # allocator bytes after each step
    step_peaks: list[int] = field(default_factory=list)  # allocator peak during each step
    # each local replica's allocator peak during each step (GPUs: one per replica)
    replica_peaks: list[list[int]] = field(default_factory=list)
    skipped_steps: int = 0  # updates skipped for non-finite gradients (float16 loss scaling)
    first_step: int = 1  # the optimizer step of losses[0]: after a resume, the one after it

    @property
    def last_step(self) -> int:
        return self.first_step + len(self.losses) - 1

    @property
    def first_step_peak(self) -> int:
        return self.step_peaks[0]

    @property
    def steady_peak(self) -> int:
        """Training steps after the first, evaluation excluded; a 1-step run has only its
        first step to report."""
        return max(self.step_peaks[1:] or self.step_peaks)

    @property
    def steady_replica_peaks(self) -> list[int]:
        """steady_peak of each local replica's allocator."""
        steady = self.replica_peaks[1:] or self.replica_peaks
        return [max(column) for column in zip(*steady, strict=True)]

    def after(self, step: int) -> "History":
        """The steps after optimizer step `step` (those of a model rebuilt after it), or this
        history if fewer than two steps follow it: a first step alone is its tracing."""
        cut = step + 1 - self.first_step
        if len(self.losses) - cut < 2 or cut <= 0:
            return self
        kept = {
            key: getattr(self, key)[cut:]
            for key in ("losses", "wait_s", "compute_s", "current_bytes", "step_peaks")
        }
        return History(
            **kept,
            replica_peaks=self.replica_peaks[cut:],
            evals=[(s, m) for s, m in self.evals if s > step],
            skipped_steps=self.skipped_steps,
            first_step=step + 1,
        )

    def before(self, step: int) -> "History":
        """The steps up to optimizer step `step` (from the first)."""
        cut = max(0, step + 1 - self.first_step)
        return History(
            losses=self.losses[:cut],
            wait_s=self.wait_s[:cut],
            compute_s=self.compute_s[:cut],
            current_bytes=self.current_bytes[:cut],
            step_peaks=self.step_peaks[:cut],
            replica_peaks=self.replica_peaks[:cut],
            evals=[(s, m) for s, m in self.evals if s <= step],
            first_step=self.first_step,
        )
