"""Rank-aware logging: rank 0 prints progress, every rank can warn.

`get_logger(rank)` returns a stdlib logger that shows INFO on rank 0 only (or on all ranks with
all_ranks=True) and WARNING/ERROR from any rank, tagged "[rank R] WARNING ...". `slow_phase` says what a long
start-up phase is doing once it has run SLOW_PHASE_S. It owns no files: metrics go to metrics.jsonl through the
trainer's hooks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator

__all__ = ["get_logger", "rank_logger", "slow_phase", "SLOW_PHASE_S"]

SLOW_PHASE_S = 10.0
"""A start-up phase still running after this long says what it is doing (slow_phase): past it, a user wonders."""


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or self.all_ranks or record.levelno >= logging.WARNING


class _RankFormatter(logging.Formatter):
    """Rank-0 INFO lines are the bare message (fixed-field step lines); anything else carries rank and level."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno == logging.INFO and self.rank == 0:
            return message
        return f"[rank {self.rank}] {record.levelname} {message}"


class _StdHandler(logging.Handler):
    """INFO/DEBUG to stdout, WARNING+ to stderr, looked up at emit time (so pytest's capture sees it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging must never kill training
            self.handleError(record)


def get_logger(rank: int = 0, level: int = logging.INFO, all_ranks: bool = False) -> logging.Logger:
    """Logger named "zerogpt.rank<R>": INFO on rank 0 (all ranks if all_ranks), warnings/errors from any rank.

    Example:
        >>> log = get_logger(rank=1)
        >>> log.info("hidden on rank 1"); log.warning("shown")   # stderr: [rank 1] WARNING shown
    """
    logger = logging.getLogger(f"zerogpt.rank{rank}")
    logger.setLevel(level)
    logger.propagate = False  # don't double-print through the root logger's handlers
    for handler in list(logger.handlers):
        if isinstance(handler, _StdHandler):
            logger.removeHandler(handler)
    handler = _StdHandler()
    handler.addFilter(_RankFilter(rank, all_ranks))
    handler.setFormatter(_RankFormatter(rank))
    logger.addHandler(handler)
    return logger


def rank_logger() -> logging.Logger:
    """This process's rank logger, for library code handed no DistContext (an op's build at first use): the rank
    from torchrun's environment (RANK; 0 in a plain `python` run), set up by get_logger unless it already is.

    Example:
        >>> rank_logger().info("building ... (first run only)")   # printed by rank 0 alone
    """
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    logger = logging.getLogger(f"zerogpt.rank{rank}")
    if any(isinstance(handler, _StdHandler) for handler in logger.handlers):
        return logger
    return get_logger(rank)


@contextlib.contextmanager
def slow_phase(logger: logging.Logger, what: str, after_s: float = SLOW_PHASE_S) -> Iterator[None]:
    """Around a start-up phase that can be long (preflight's model on meta, initialize's shard fill, a resume's
    read): still running after `after_s`, it logs "<what> (N s so far)" once; a quick phase prints nothing, so a
    small run's console stays as it is. The line comes from a timer thread (logging's handler lock orders it).

    Example:
        >>> with slow_phase(ctx.logger, "initialize: filling this rank's shards"):
        ...     engine = zerogpt.initialize(model, optimizer, config=cfg, ctx=ctx)
    """
    timer = threading.Timer(after_s, lambda: logger.info(f"{what} ({after_s:.0f} s so far)"))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
