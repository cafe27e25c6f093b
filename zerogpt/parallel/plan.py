"""Tensor and pipeline parallelism applied to a model_zoo GPT or Llama-family model in one call, and what the
engine then needs to know.

`parallelize(model, mesh)` is the one place the plans meet: Megatron's tensor-parallel plan over "tp" first
(tensor.py), then the stage split over "pp" (pipeline.py: it keeps this stage's blocks; a tied head's last-stage
copy is cut from the already vocab-parallel embedding); each family's names and block plan are in families.py.
What comes back records what the engine cannot see in the module: which parameters another rank of the
model-parallel group also holds (left out of the grad norm), where each local tensor lies in the unsharded
parameter (`layouts`, taken here because ZeRO-3 releases the parameters' storage once the engine owns them),
the tied copy a last stage holds, and the loss's context.
`initialize` takes it in place of the module, so the engine is complete when it returns:

    ctx = ctx.with_mesh(dims.build_mesh(device_type))
    engine = zerogpt.initialize(parallelize(model, ctx.mesh), optimizer, criterion, config=cfg, ctx=ctx)
    pipeline = Pipeline(engine) if dims.pp > 1 else None   # the Trainer's schedule
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerogpt.parallel.families import HEAD, family_of
from zerogpt.parallel.layout import ParamLayout, global_runs
from zerogpt.parallel.mesh import ParallelDims
from zerogpt.parallel.parallel_model import ParallelModel
from zerogpt.parallel.pipeline import split_stage, tied_copies
from zerogpt.parallel.rng import seed_stage
from zerogpt.parallel.tensor import apply_tensor_parallel, tensor_parallel_layout

__all__ = ["ParallelModel", "parallelize", "init_local_ranges"]


def parallelize(model: nn.Module, mesh: Any, sequence_parallel: bool = False) -> ParallelModel:
    """Apply the tensor-parallel plan, then keep this rank's pipeline stage, in place (every rank calls); with
    P > 1 the global random stream is then forked per stage (`rng.seed_stage`), so stages draw different dropout
    masks.

    `model` is a model_zoo GPT or Llama-family model built with the same seed on every rank, whole or on the
    meta device (then `initialize` fills each rank's shards from `init_param_range`, the fresh init or a
    pretrained model's files, and no rank ever holds the whole model); `mesh` the ("pp", "dp", "tp")
    DeviceMesh from `ParallelDims.build_mesh`.
    """
    family, tp, pp = family_of(model), mesh["tp"], mesh["pp"]
    duplicates: set[str] = set()
    layouts: dict[str, ParamLayout] = {}
    if tp.size() > 1:
        replicated = apply_tensor_parallel(model, tp, sequence_parallel)
        layouts = {n: lay for n, lay in tensor_parallel_layout(model).items() if not lay.is_whole}
        if tp.get_local_rank() != 0:
            duplicates |= replicated
    stage, stages = pp.get_local_rank(), pp.size()
    tied = tied_copies(model, stage, stages)  # a tied head's last-stage copy of the embedding
    split_stage(model, stage, stages)
    if stages > 1:  # the model is built: each stage's dropouts draw from a stream of their own (rng.py)
        seed_stage(stage)
    if sequence_parallel and tp.size() > 1 and stage > 0 and family.later_stage_sp is not None:
        family.later_stage_sp(model, tp.size())
    duplicates |= set(tied)
    names = {n for n, _ in model.named_parameters()}
    if tied and family.embedding_weight in layouts:  # the copy is split as the vocab-parallel embedding is
        layouts[HEAD] = layouts[family.embedding_weight]
    layouts = {n: lay for n, lay in layouts.items() if n in names}
    if layouts and any(p.is_meta for p in model.parameters()):
        init_local_ranges(model, layouts)
    dims = ParallelDims(tp=tp.size(), pp=stages, dp=mesh["dp"].size())
    return ParallelModel(model, dims, layouts, frozenset(duplicates), tied)


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
