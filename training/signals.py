"""SIGINT and SIGTERM during a training run: stop after the step in flight, or at once."""
from __future__ import annotations

import os
import signal
import threading
import time


class Interrupted(KeyboardInterrupt):
    """A signal that stops the run at once: during setup, or a second Ctrl-C while stopping."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


class StopSignals:
    """SIGINT and SIGTERM (what schedulers send on preemption) for the duration of a run.

    Once `armed` (the training loop runs), the first one only records its name in `received`: the loop stops
    after the step in flight, saves a checkpoint and exits. A further SIGTERM is ignored; a further SIGINT at
    least `repeat_after_s` after the first raises Interrupted at once, without a checkpoint (an impatient
    user), except under torchrun, which passes a terminal's Ctrl-C on to workers that already got it, and
    kills them itself when they take too long. Before the loop (setup), either signal raises Interrupted.
    Handlers can only be installed in the main thread; elsewhere the process keeps its own.
    """
    repeat_after_s = 1.0

    def __init__(self):
        self.received: str | None = None
        self.armed = False
        self._first_at = 0.0
        self._under_torchrun = "RANK" in os.environ
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            raise Interrupted(name)
        if self.received is None:
            self.received, self._first_at = name, time.monotonic()
        elif (signum == signal.SIGINT and not self._under_torchrun
              and time.monotonic() - self._first_at >= self.repeat_after_s):
            raise Interrupted(name)
