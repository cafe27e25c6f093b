"""Run a function on N gloo (or NCCL) ranks in spawned processes, with a hard timeout (a hang fails, never blocks).

Rendezvous is a file in a fresh temp dir (no port races). The function's return value on each rank
comes back through a queue, so tests assert in the parent process.
"""
from __future__ import annotations

import io
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue: Any,
            backend: str = "gloo") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # before NCCL init, so each rank binds its own GPU
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # by value: tensors sent as shared memory die with this process
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report, don't hang the others
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` ranks (gloo; "nccl": one GPU per rank); return
    results by rank.

    Raises RuntimeError with the failing rank's traceback, or TimeoutError after `timeout` seconds.
    fn must be importable (module level) so spawned processes can find it.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="zerogpt-rdzv-"), "rdzv")
    procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue, backend),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:
                raise TimeoutError(f"distributed test did not finish within {timeout}s "
                                   f"(ranks done: {sorted(results)})") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
