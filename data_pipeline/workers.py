"""How a stage spreads its work over processes and shows it: `imap_bounded`, an ordered map over
worker processes with a bounded number of tasks in flight, `batched`, the units it sends, and `progress`, the
bar beside it.

The sharded-task path (executor.py) is the other way a stage runs; this is the in-process one.
"""
from __future__ import annotations

import functools
import sys
from typing import Iterable, Iterator


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "",
             unit: str = "doc"):
    """A tqdm bar on stderr; silent when stderr is not a terminal (logs, tests).

    Without tqdm's monitor thread: it outlives the bar, and a process with a thread alive no longer forks its
    workers (imap_bounded), so every later stage in the process, `all`'s included, would spawn them (slower, and a
    script without an `if __name__ == "__main__":` guard would start itself again in each worker).
    """
    return _bar_class()(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True,
                        disable=None, file=sys.stderr, mininterval=0.5)


@functools.cache
def _bar_class() -> type:
    """tqdm without its monitor thread (a class attribute tqdm reads when a bar is made); built once, on first use,
    so importing this module does not import tqdm."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar


def imap_bounded(fn, tasks: Iterable, workers: int, initializer=None, initargs: tuple = (),
                 window: int | None = None, prefer_fork: bool = False) -> Iterator:
    """Ordered `map(fn, tasks)` over `workers` processes, at most `window` tasks in flight.

    Pool.imap reads its whole input ahead (a corpus would land in RAM); this keeps memory
    bounded. The pool is created at call time, before the caller starts progress bars or
    other threads. It uses spawn, or fork when `prefer_fork` and this process has a single
    thread (fork copies imported modules for free; with threads alive it could copy a held
    lock). With workers <= 1 it runs in-process (no pickling; easier to debug).
    """
    import multiprocessing
    import threading

    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        return (fn(task) for task in tasks)
    method = "fork" if (prefer_fork and threading.active_count() == 1
                        and "fork" in multiprocessing.get_all_start_methods()) else "spawn"
    pool = multiprocessing.get_context(method).Pool(workers, initializer, initargs)
    return _PoolMap(pool, fn, tasks, window or 4 * workers)


class _PoolMap:
    """Iterator of imap_bounded; `close()` stops the pool even if iteration never started."""

    def __init__(self, pool, fn, tasks: Iterable, window: int) -> None:
        self.pool = pool
        self._results = self._run(fn, tasks, window)

    def _run(self, fn, tasks: Iterable, window: int) -> Iterator:
        from collections import deque

        try:
            pending: deque = deque()
            for task in tasks:
                pending.append(self.pool.apply_async(fn, (task,)))
                if len(pending) >= window:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
        finally:
            self.close()

    def __iter__(self) -> Iterator:
        return self._results

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` items (the last one shorter) from an iterable: the unit of work sent to a worker."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
