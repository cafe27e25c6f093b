"""Start (or join) the process group and return the explicit distributed context every component takes.

`launch_from_torch` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or,
when run as a plain `python train_gpt.py`, makes a one-rank group so collectives work the same everywhere.
NCCL on CUDA, gloo on CPU. It seeds python/numpy/torch identically on every rank (replicated model init).
It does not build models or data; nothing here is a global: pass the returned DistContext around.
"""
from __future__ import annotations

import os
import random
import tempfile
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerogpt.context import DistContext, model_parallel_group
from zerogpt.logging import get_logger

__all__ = ["DistContext", "launch_from_torch", "seed_everything", "cpu_threads"]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """Torch threads for one CPU rank, and where the number came from.

    torch's default is every core for every process: ranks that share a host then oversubscribe it, and on a
    busy machine each step waits on threads that are not running. Order: `requested` (train.cpu_threads), then
    OMP_NUM_THREADS (yours, or torchrun's 1 for several ranks when you set none), then the cores this process
    may run on (os.sched_getaffinity) divided by the ranks on this host (LOCAL_WORLD_SIZE), at least 1.
    """
    if requested is not None:
        return requested, "train.cpu_threads"
    omp = _env_int("OMP_NUM_THREADS")
    if omp is not None and omp >= 1:
        return omp, "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(_env_int("LOCAL_WORLD_SIZE") or 1, 1)
    return max(1, cores // local), f"{cores} cores available / {local} rank{'s' if local > 1 else ''} on this host"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (set by torchrun)") from None


def launch_from_torch(cfg: Any = None, seed: int | None = None, device: str | None = None,
                      init_method: str | None = None, timeout_s: float = 1800.0, dims: Any = None) -> DistContext:
    """Initialise (or wrap) the default process group from torchrun's environment and return a DistContext.

    Args:
        cfg: a zerogpt Config (or dict, or None); only `train.seed` is read.
        seed: overrides cfg's train.seed (default 42). The same seed on every rank, so replicated inits agree.
        device: "cuda" or "cpu" to force a backend (nccl / gloo); None = cuda if available.
        init_method: rendezvous URL for a multi-rank launch; None = "env://" (torchrun's MASTER_ADDR/PORT).
            Tests pass "file:///tmp/x/rdzv" to avoid port races.
        timeout_s: collective timeout; a hung rank fails after this instead of blocking forever.
        dims: the run's ParallelDims (zerogpt.parallel.mesh): with T x P > 1 the context is on its
            ("pp", "dp", "tp") DeviceMesh, and ZeRO shards over "dp".
    Returns:
        DistContext(global_rank, world_size, device, local_rank, logger). If a process group is already
        initialised (e.g. by a test), it is wrapped as is: the device follows its backend.
    Example:
        >>> ctx = launch_from_torch(seed=0)     # plain python: world_size 1, gloo on CPU
        >>> ctx.world_size, ctx.device
        (1, device(type='cpu'))
        >>> ctx.destroy()
    """
    threads = None
    if cfg is not None:
        from zerogpt.config import train_config

        train = train_config(cfg)
        seed, threads = train.seed if seed is None else seed, train.cpu_threads
    seed = 42 if seed is None else seed
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cpu' or None (auto), got {device!r}")

    owns_group, tmpdir = False, None
    if dist.is_initialized():
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK")
        if local_rank is None:
            local_rank = rank % max(torch.cuda.device_count(), 1) if backend == "nccl" else rank
        use_cuda = backend == "nccl"
    else:
        use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
        if use_cuda and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available; pass device='cpu'")
        backend = "nccl" if use_cuda else "gloo"
        world_size, rank, local_rank = _env_int("WORLD_SIZE"), _env_int("RANK"), _env_int("LOCAL_RANK")
        if world_size is None:  # plain `python script.py`: a private one-rank group, rendezvous through a file
            rank, world_size, local_rank = 0, 1, 0 if local_rank is None else local_rank
            tmpdir = tempfile.mkdtemp(prefix="zerogpt_pg_")
            init_method = f"file://{os.path.join(tmpdir, 'rendezvous')}"
        else:
            if rank is None:
                raise ValueError(f"WORLD_SIZE={world_size} is set but RANK is not; launch with torchrun "
                                 f"(it sets RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing and init_method is None:
                raise ValueError(f"{', '.join(missing)} not set; launch with torchrun --nproc_per_node=N "
                                 f"train_gpt.py ... (or export MASTER_ADDR=localhost MASTER_PORT=29500)")
            local_rank = rank if local_rank is None else local_rank
            init_method = init_method or "env://"
        if use_cuda:
            torch.cuda.set_device(local_rank)  # before NCCL init, so each rank binds its own GPU
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        owns_group = True

    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    seed_everything(seed)
    logger = get_logger(rank)
    mesh = dims.build_mesh(dev.type) if dims is not None and dims.model_parallel else None
    ctx = DistContext(global_rank=rank, world_size=world_size, device=dev, local_rank=local_rank,
                      local_world_size=_env_int("LOCAL_WORLD_SIZE") or 1, logger=logger, mesh=mesh,
                      model_parallel_group=model_parallel_group(mesh) if mesh is not None else None,
                      backend=backend, owns_group=owns_group, tmpdir=tmpdir)
    logger.info(f"launch: world_size={world_size} backend={backend} device={dev} seed={seed}")
    if dev.type == "cpu" and owns_group:  # a wrapped group keeps its process's threads as they are
        n, why = cpu_threads(threads)
        torch.set_num_threads(n)
        logger.info(f"cpu threads: {n} per rank ({why}; set train.cpu_threads or OMP_NUM_THREADS to change)")
    return ctx
