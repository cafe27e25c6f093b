"""ProgressBarHook: a rank-0 tqdm bar over optimizer steps with the ETA and the latest loss.

The bar and the log lines share the terminal: while the bar is up, a record logged through the trainer's logger
first clears the bar, so each line starts on a line of its own and the bar is redrawn under it at the next step.
A terminal that reports no size (a bare pseudo-terminal) gets 80 x 24; tqdm would draw nothing there.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys

from zerogpt.trainer.hooks.base import Hook


class _ClearBar(logging.Filter):
    """Clears the bar before a record is written (a filter runs first; it lets every record through)."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear()
        return True


class ProgressBarHook(Hook):
    """Shows step/max_steps, steps/s, ETA, and the loss and lr of the latest log step on rank 0 (tqdm)."""

    def __init__(self, desc: str = "train"):
        self.desc = desc
        self._bar = None
        self._filter: _ClearBar | None = None
        self._logger: logging.Logger | None = None

    def before_train(self, trainer) -> None:
        if trainer.is_main:
            from tqdm.auto import tqdm
            s = trainer.state
            # A terminal of unknown size reads as -1 x -1 to tqdm, which then draws nothing: give it one.
            size = {} if _size_known() else dict(zip(("ncols", "nrows"), shutil.get_terminal_size((80, 24))))
            self._bar = tqdm(total=s.max_steps, initial=s.step, desc=self.desc, unit="step",
                             dynamic_ncols=not size, **size)
            self._logger, self._filter = trainer.logger, _ClearBar(self._bar)
            self._logger.addFilter(self._filter)

    def after_step(self, trainer) -> None:
        if self._bar is not None:
            m = trainer.state.metrics
            if m.logged:
                post = {"loss": f"{m.loss:.4f}"}
                if m.lr is not None:
                    post["lr"] = f"{m.lr:.2e}"
                self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)

    def after_train(self, trainer) -> None:
        if self._bar is not None:
            self._logger.removeFilter(self._filter)
            self._bar.close()
            self._bar = None


def _size_known() -> bool:
    """Whether the terminal reports its size (then tqdm follows resizes)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        return size.columns > 0 and size.lines > 0
    except (OSError, ValueError):
        return False
