"""zerogpt/logging.py: a long start-up phase says what it is doing, a quick one says nothing; rank_logger."""
import logging
import threading

from zerogpt.logging import rank_logger, slow_phase


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines, self.said = [], threading.Event()

    def emit(self, record):
        self.lines.append(record.getMessage())
        self.said.set()


def test_a_phase_still_running_says_what_it_is_doing_once_and_a_quick_one_nothing():
    logger = logging.getLogger("zerogpt.test_slow_phase")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    lines = Lines()
    logger.addHandler(lines)
    with slow_phase(logger, "initialize: filling shards", after_s=0.01):
        assert lines.said.wait(timeout=30)           # the phase runs on until the line is out
    with slow_phase(logger, "preflight", after_s=600):
        pass
    assert lines.lines == ["initialize: filling shards (0 s so far)"]


def test_rank_logger_is_the_rank_from_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    logger = rank_logger()
    assert logger.name == "zerogpt.rank3" and rank_logger() is logger
    # one handler of ours however often it is asked (pytest's own capture handlers may sit beside it)
    assert sum(type(handler).__name__ == "_StdHandler" for handler in logger.handlers) == 1
