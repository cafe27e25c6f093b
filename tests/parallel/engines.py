"""The TP / PP engines of the parallel tests, built as train_gpt builds them: the mesh into the context, the model
through parallelize into initialize, the pipeline schedule from the engine."""
from __future__ import annotations

from typing import Any, Callable

import torch

from zerogpt.context import DistContext


def parallel_engine(model: torch.nn.Module, dims: Any, config: Any, optimizer: Callable,
                    criterion: Callable | None = None, sequence_parallel: bool = False) -> tuple[Any, Any]:
    """(engine, pipeline or None) for this rank of a (pp, dp, tp) mesh over every rank (every rank calls)."""
    import zerogpt
    from zerogpt.parallel.pipeline import Pipeline
    from zerogpt.parallel.plan import parallelize

    ctx = DistContext.current("cpu").with_mesh(dims.build_mesh("cpu"))
    parallel = parallelize(model, ctx.mesh, sequence_parallel)
    engine = zerogpt.initialize(parallel, optimizer(parallel.module), criterion, config=config, ctx=ctx)
    return engine, Pipeline(engine) if dims.pp > 1 else None
