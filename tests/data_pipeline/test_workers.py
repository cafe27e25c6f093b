"""Tests for data_pipeline/workers.py: a stage's progress bar leaves no thread behind (later stages still fork)."""
from __future__ import annotations

import io
import sys
import threading

from data_pipeline.workers import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_on_a_terminal_leaves_no_thread_behind(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    before = set(threading.enumerate())
    with progress(total=10, desc="stage") as bar:
        bar.update(10)
    for _ in progress(range(3), desc="stage"):
        pass
    assert set(threading.enumerate()) == before
    assert "stage" in sys.stderr.getvalue()  # the bar was drawn
