"""What a stage run as tasks shows on the console: one progress line, then its summary; the rest goes to a file.

datatrove logs every task's start, its pipeline and a "Stats" banner, and each task prints its shard's counts:
hundreds of lines for a small corpus. While a stage's tasks run, `stage_output` sends all of it (this
process's file descriptors 1 and 2, which forked workers inherit, and datatrove's loguru sink) to
`WORKDIR/logs/STAGE.log`; on a terminal a bar counts the finished tasks meanwhile. `-v` keeps it all on the
console, as before. Ray workers' output stays out of the console too (`ray_init_kwargs`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

__all__ = ["stage_output", "stage_log", "summary", "ray_init_kwargs"]


def stage_log(workdir: str, stage: str) -> str:
    """Where a stage's task output goes: WORKDIR/logs/STAGE.log (kept after the stage's task files are removed)."""
    return os.path.join(workdir, "logs", f"{stage}.log")


def ray_init_kwargs(verbose: bool) -> dict:
    """ray.init arguments: workers' output reaches the console only with -v (Ray keeps it in its session logs)."""
    import logging

    return {} if verbose else dict(log_to_driver=False, logging_level=logging.WARNING)


@contextlib.contextmanager
def stage_output(log_path: str, verbose: bool, total_tasks: int, completions: list[str],
                 label: str) -> Iterator[None]:
    """Run the block with stdout, stderr and datatrove's log appended to `log_path` (unless `verbose`).

    On a terminal, a bar `label: N/total tasks` is redrawn while the block runs, from the completion markers
    datatrove writes into the `completions` folders, and erased at the end.
    """
    if verbose:
        yield
        return
    from loguru import logger

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    streams = sys.stdout, sys.stderr
    with open(log_path, "a", buffering=1) as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        sys.stdout = sys.stderr = log
        logger.remove()
        logger.add(log, level="INFO", format="{time:YYYY-MM-DD HH:mm:ss} | {level: <8} | {name} - {message}")
        bar = _Bar(console, label, total_tasks, completions) if console.isatty() else None
        try:
            yield
        finally:
            if bar is not None:
                bar.stop()
            logger.remove()
            log.flush()
            sys.stdout, sys.stderr = streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            console.close()
            from datatrove.utils.logging import setup_default_logger

            setup_default_logger()  # datatrove's own console sink, as after each of its tasks


class _Bar:
    """`label: done/total tasks [####    ]` on the terminal, redrawn every 0.2 s by a thread, erased by stop()."""

    def __init__(self, out, label: str, total: int, completions: list[str]):
        self.out, self.label, self.total, self.completions = out, label, max(total, 1), completions
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerogpt-stage-bar", daemon=True)
        self._thread.start()

    def _count(self) -> int:
        return sum(len(os.listdir(d)) for d in self.completions if os.path.isdir(d))

    def _draw(self) -> None:
        done = min(self._count(), self.total)
        filled = 20 * done // self.total
        self.out.write(f"\r{self.label}: {done}/{self.total} tasks [{'#' * filled}{' ' * (20 - filled)}]")
        self.out.flush()

    def _run(self) -> None:
        self._draw()
        while not self._done.wait(0.2):
            self._draw()
        self._draw()  # the finished count once more before stop() erases the bar (a stage quicker than a redraw)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.out.write("\r\033[K")
        self.out.flush()


def summary(stage: str, output: str, log_path: str | None) -> str:
    """The stage's one line from its stats file (its tasks printed theirs into the log), and where the log is."""
    from data_pipeline.stats import read_stats

    stats = read_stats(output) or {}
    counts = ", ".join(f"{k}={v}" for k, v in (stats.get("counts") or {}).items())
    seconds = f" in {stats['seconds']:.1f}s" if isinstance(stats.get("seconds"), (int, float)) else ""
    return (f"[{stage}] {output}: {counts or 'no counts'}" + seconds
            + (f" (task output: {log_path})" if log_path else ""))
