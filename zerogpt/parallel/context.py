"""The engine's view of a (pp, dp, tp) mesh: ZeRO shards over "dp"; the grad norm also sums over "pp" x "tp".

`initialize(ctx=...)` takes a duck-typed context (rank, world_size, device, group, logger, model_parallel_group,
norm_skip; EngineContext below). With tensor or pipeline parallelism its rank, world size and group are
the data-parallel ones: every ZeRO collective runs among the ranks that hold the same part of the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass
class EngineContext:
    """What `zerogpt.initialize` needs to know of this rank's place in the mesh."""

    rank: int
    """Data-parallel rank: which shard of each chunk this rank owns."""
    world_size: int
    """Data-parallel size: the number of shards."""
    device: torch.device
    group: Any
    """The data-parallel process group (ZeRO's collectives)."""
    logger: Any = None
    model_parallel_group: Any = None
    """The ranks with this rank's dp coordinate (pp x tp); None when both sizes are 1."""
    norm_skip: frozenset = field(default_factory=frozenset)
    """Parameters whose gradient another rank of model_parallel_group holds too: left out of the norm here."""
    mesh: Any = None
    """The whole DeviceMesh, for the plans and the checkpoint's layout."""


def engine_context(mesh: Any, device: torch.device, logger: Any = None,
                   norm_skip: Iterable[str] = ()) -> EngineContext:
    """The context for `initialize()` on a ("pp", "dp", "tp") mesh built by ParallelDims.build_mesh."""
    dp = mesh["dp"]
    model_parallel = None
    if mesh["pp"].size() * mesh["tp"].size() > 1:
        model_parallel = mesh["pp", "tp"]._flatten("pp_tp").get_group()
    return EngineContext(rank=dp.get_local_rank(), world_size=dp.size(), device=device, group=dp.get_group(),
                         logger=logger, model_parallel_group=model_parallel, norm_skip=frozenset(norm_skip),
                         mesh=mesh)
