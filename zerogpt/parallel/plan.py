"""Tensor and pipeline parallelism applied to a model_zoo GPT in one call, and what the engine then needs to know.

`parallelize(model, mesh)` is the one place the plans meet: Megatron's tensor-parallel plan over "tp" first
(tensor.py), then the stage split over "pp" (pipeline.py: it keeps this stage's blocks; the last stage's head
copy is cut from the already vocab-parallel wte). What comes back records
what the engine cannot see in the module: which parameters another rank of the model-parallel group also
holds (left out of the grad norm, `norm_skip`) and where each local tensor lies in the unsharded parameter
(`layouts`, taken here because ZeRO-3 releases the parameters' storage once the engine owns them).

    parallel = parallelize(model, mesh)
    engine, *_ = zerogpt.initialize(parallel.module, optimizer, criterion, config=cfg,
                                    ctx=parallel.context(device, logger))
    parallel.attach(engine)        # layouts for checkpoints, the vocab-parallel loss, the pipeline schedule
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zerogpt.parallel.context import EngineContext, engine_context
from zerogpt.parallel.layout import ParamLayout, global_runs
from zerogpt.parallel.pipeline import EMBEDDING, HEAD, Pipeline, norm_skip, split_stage
from zerogpt.parallel.tensor import apply_tensor_parallel, tensor_parallel_layout

__all__ = ["ParallelModel", "parallelize", "local_loss", "init_local_ranges"]


@dataclass
class ParallelModel:
    """This rank's part of the model after the plans, and what the engine needs to know about it."""

    module: nn.Module
    mesh: Any
    layouts: dict[str, ParamLayout]
    """name -> where this rank's local tensor lies in the unsharded parameter (absent: it is the whole one)."""
    norm_skip: frozenset[str]
    """Parameters whose gradient another rank of the pp x tp group counts in the grad norm."""

    @property
    def tensor_parallel(self) -> bool:
        return self.mesh["tp"].size() > 1

    @property
    def pipeline_parallel(self) -> bool:
        return self.mesh["pp"].size() > 1

    def context(self, device: torch.device, logger: Any = None) -> EngineContext:
        """The context for `zerogpt.initialize`: ZeRO over "dp", the grad norm over every rank."""
        return engine_context(self.mesh, device, logger, norm_skip=self.norm_skip)

    def attach(self, engine: Any, criterion: Callable | None = None) -> Pipeline | None:
        """Tell `engine` what the plans did; returns the pipeline schedule it now trains through, if any.

        Sets `engine.param_layouts` (checkpoints), and under tensor parallelism `engine.loss_context` (torch's
        `loss_parallel`, which a loss and its backward must run inside) and a criterion that returns the
        plain local loss.
        """
        engine.param_layouts = dict(self.layouts)
        if self.tensor_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            engine.loss_context = loss_parallel
            engine.criterion = local_loss(criterion or engine.criterion)
        elif criterion is not None:
            engine.criterion = criterion
        if self.pipeline_parallel:
            return Pipeline(engine, self.mesh, engine.criterion)
        return None


def local_loss(criterion: Callable | None) -> Callable | None:
    """`criterion` giving a plain tensor: on vocab-sharded logits its loss is a replicated DTensor."""
    if criterion is None:
        return None

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = criterion(logits, labels)
        return value.to_local() if isinstance(value, DTensor) else value  # differentiable

    return loss


def parallelize(model: nn.Module, mesh: Any, sequence_parallel: bool = False) -> ParallelModel:
    """Apply the tensor-parallel plan, then keep this rank's pipeline stage, in place (every rank calls).

    `model` is a model_zoo GPT built with the same seed on every rank, whole or on the meta device (then
    `initialize` fills each rank's shards, and no rank ever holds the whole model); `mesh` the
    ("pp", "dp", "tp") DeviceMesh from `ParallelDims.build_mesh`.
    """
    tp, pp = mesh["tp"], mesh["pp"]
    skip: set[str] = set()
    layouts: dict[str, ParamLayout] = {}
    if tp.size() > 1:
        replicated = apply_tensor_parallel(model, tp, sequence_parallel)
        layouts = {n: lay for n, lay in tensor_parallel_layout(model).items() if not lay.is_whole}
        if tp.get_local_rank() != 0:
            skip |= replicated
    stage, stages = pp.get_local_rank(), pp.size()
    split_stage(model, stage, stages)
    skip |= set(norm_skip(stage, stages))
    names = {n for n, _ in model.named_parameters()}
    if HEAD in names and EMBEDDING in layouts and HEAD not in layouts:  # the last stage's copy of wte
        layouts[HEAD] = layouts[EMBEDDING]
    layouts = {n: lay for n, lay in layouts.items() if n in names}
    if layouts and any(p.is_meta for p in model.parameters()):
        init_local_ranges(model, layouts)
    return ParallelModel(model, mesh, layouts, frozenset(skip))


def init_local_ranges(model: nn.Module, layouts: dict[str, ParamLayout]) -> None:
    """Make a meta-built model's `init_param_range` speak of this rank's local tensors, in place.

    `initialize` fills each shard of a meta model from `model.init_param_range(name, start, end)`, with
    [start, end) a range of the tensor the chunk holds: under tensor parallelism the local tensor, whose
    elements lie in the unsharded parameter where its layout says. Each range is drawn as the unsharded
    parameter's span that covers it (at most one parameter at a time, never the model) and its runs are
    picked out, so a rank's shard holds exactly the values a whole build would have given it.
    """
    whole = model.init_param_range

    def init_param_range(name: str, start: int, end: int) -> torch.Tensor:
        layout = layouts.get(name)
        if layout is None:
            return whole(name, start, end)
        runs = global_runs(layout, start, end)
        if not runs:
            return torch.empty(0)
        lo, hi = min(g for g, _, _ in runs), max(g + n for g, _, n in runs)
        span = whole(name, lo, hi)
        out = torch.empty(end - start, dtype=span.dtype)
        for g, local, n in runs:
            out[local - start: local - start + n] = span[g - lo: g - lo + n]
        return out

    model.init_param_range = init_param_range
