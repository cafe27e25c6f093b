"""StopOnSignal: SIGINT / SIGTERM ask the training loop to stop at the next step boundary instead of killing it.

The first signal only records itself; `Trainer.fit` reads the record between steps and all ranks agree on it
there (one tiny all-reduce on the CPU), so every rank stops after the same step and no collective is left
half-done. A second signal, a second or more after the first, raises KeyboardInterrupt at once. A repeat
within that second is the same interrupt: torchrun forwards the signal it got to every worker, and a job
scheduler may signal the launcher and the workers alike. Handlers can only be set from the main thread; in any
other thread this does nothing.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any

__all__ = ["StopOnSignal"]


class StopOnSignal:
    """Installs SIGINT/SIGTERM handlers for a block; `signum` is the first signal received (0 while none).

    Example:
        with StopOnSignal() as stop:
            for step in range(n):
                if stop.signum: break          # the Trainer agrees on it across ranks first
                train_one_step()
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeat_s: float = 1.0):
        self.repeat_s = repeat_s
        self.signum = 0
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        # Nothing printed here: a write while the main thread is inside a write to the same stream raises.
        now = time.monotonic()
        if not self.signum:
            self.signum, self._at = signum, now
        elif now - self._at >= self.repeat_s:
            self.__exit__()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
