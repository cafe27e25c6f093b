"""DistContext: who this process is, where it computes, and which ranks share its model state.

One typed object, made by `launch_from_torch` (or `DistContext.current()` around a process group that already
exists) and passed to `initialize`, the Trainer and checkpoints. "rank" alone never appears: `global_rank`
names the process in the run (who writes files and logs), `dp_rank` its shard of ZeRO's chunks. With tensor or
pipeline parallelism the ("pp", "dp", "tp") mesh (`with_mesh`) gives the data-parallel group and the
model-parallel one; without a mesh the whole run is data parallel.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from logging import Logger
from typing import Any

import torch
import torch.distributed as dist

from zerogpt.logging import get_logger

__all__ = ["DistContext"]


@dataclass
class DistContext:
    """This process's place in the run. Every field is set when the context is made; nothing is looked up later."""

    global_rank: int
    """The process's rank in the whole run (torchrun's RANK): rank 0 writes files and logs."""
    world_size: int
    """Processes in the run: tensor x pipeline x data parallel."""
    device: torch.device
    """Where this process computes (cuda:LOCAL_RANK, or cpu)."""
    local_rank: int = 0
    """The GPU index on this node."""
    local_world_size: int = 1
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE): they share its disk and host memory."""
    logger: Logger | None = None
    """Rank-aware logger (zerogpt.logging); None = get_logger(global_rank)."""
    mesh: Any = None
    """The ("pp", "dp", "tp") DeviceMesh when T x P > 1 (`with_mesh`), else None: all ranks are data parallel."""
    model_parallel_group: Any = None
    """The ranks that share this rank's data-parallel coordinate (pp x tp), which hold one model copy between them;
    None when T = P = 1. The grad norm sums over it."""
    backend: str = "gloo"
    owns_group: bool = field(default=False, repr=False)
    """True if launch_from_torch created the process group (then destroy() tears it down)."""
    tmpdir: str | None = field(default=None, repr=False)
    """launch_from_torch's rendezvous directory for a plain one-process run (removed by destroy())."""
    # Derived from the mesh when the context is made (without one: the whole run is data parallel).
    dp_rank: int = field(init=False)
    """Which shard of every chunk this rank owns."""
    dp_size: int = field(init=False)
    """The number of shards: the ranks that hold the same part of the model."""
    dp_group: Any = field(init=False, repr=False)
    """ZeRO's process group (None: the default group, the whole run)."""
    tp_rank: int = field(init=False)
    """This rank's place in its tensor-parallel group (0 without one)."""
    parallel_sizes: dict[str, int] = field(init=False)
    """{"tp": T, "pp": P, "dp": D}."""

    def __post_init__(self) -> None:
        if self.logger is None:
            self.logger = get_logger(self.global_rank)
        if self.owns_group:  # destroyed at exit if the script does not: after the transports (closed first, LIFO)
            atexit.register(self.destroy)
        if self.mesh is None:
            self.dp_rank, self.dp_size, self.dp_group, self.tp_rank = self.global_rank, self.world_size, None, 0
            self.parallel_sizes = {"tp": 1, "pp": 1, "dp": self.world_size}
        else:
            dp = self.mesh["dp"]
            self.dp_rank, self.dp_size, self.dp_group = dp.get_local_rank(), dp.size(), dp.get_group()
            self.tp_rank = self.mesh["tp"].get_local_rank()
            self.parallel_sizes = {dim: self.mesh[dim].size() for dim in ("tp", "pp", "dp")}

    @classmethod
    def current(cls, device: torch.device | str | None = None, logger: Logger | None = None) -> "DistContext":
        """The context of a process group that already exists (or of a lone process), without seeding or threads.

        `device` defaults to cuda:LOCAL_RANK when CUDA is available, else the CPU.
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device is None:
            device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
        return cls(rank, world, torch.device(device), local_rank, local_world, logger, backend=backend)

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def with_mesh(self, mesh: Any) -> "DistContext":
        """This context on a ("pp", "dp", "tp") mesh from ParallelDims.build_mesh (every rank calls: the
        model-parallel groups are created collectively). The new context does not own the process group."""
        return dataclasses.replace(self, mesh=mesh, model_parallel_group=model_parallel_group(mesh),
                                   owns_group=False, tmpdir=None)

    # -- lifetime --------------------------------------------------------------------------------------

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def destroy(self) -> None:
        """Destroy the process group if this context created it (a wrapped, pre-existing group is left alone)."""
        if self.owns_group:
            atexit.unregister(self.destroy)
            if dist.is_initialized():
                dist.destroy_process_group()
        self.owns_group = False
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __enter__(self) -> "DistContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()


def model_parallel_group(mesh: Any) -> Any:
    """The pp x tp group at this rank's dp coordinate, or None when both sizes are 1.

    From the mesh's rank table (pp, dp, tp): one group per dp index, created on every rank in the same order.
    """
    if mesh["pp"].size() * mesh["tp"].size() == 1:
        return None
    ranks = mesh.mesh
    groups = [ranks[:, d, :].flatten().tolist() for d in range(ranks.size(1))]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine
