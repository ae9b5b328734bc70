"""Signals: SIGTERM or SIGINT lets the current optimizer step finish, writes a checkpoint,
marks the run KILLED and exits with 128 + the signal's number (143, 130)."""

import signal
import threading


class StopOnSignal:
    """SIGTERM and SIGINT set `signum` instead of stopping the process, so the loop can end the
    step it is in and checkpoint; a second SIGINT stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def take_back(self) -> None:
        """Handle SIGTERM and SIGINT here again. TensorFlow's coordination service (a
        multi-worker strategy) installs a SIGTERM handler of its own in C++, over Python's:
        measured, a SIGTERM after MultiWorkerMirroredStrategy() left `signum` None."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
