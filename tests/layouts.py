"""Test helpers for checkpoints under tensor/pipeline layouts: Megatron-style TP-local and pipeline-stage copies of a
tiny GPT, an engine's state filled from unsharded reference tensors, and the check that an engine's state is the
reference cut by the engine's own layouts (its state_dict's shard maps, layouts and tied names).

A reference is {kind: {name: unsharded fp32 tensor}} with kinds "master", "exp_avg", "exp_avg_sq".
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerogpt.checkpoint import CheckpointReader
from zerogpt.parallel.layout import ParamLayout, local_from_full

KINDS = ("master", "exp_avg", "exp_avg_sq")
TIED_HEAD = {"lm_head.weight": "transformer.wte.weight"}


def megatron_layout(name: str, shape: tuple[int, ...], tp: int, rank: int) -> ParamLayout:
    """Megatron's split of a GPT-2 parameter over `tp` ranks: column-parallel (fused q/k/v, c_fc, vocab rows)
    along dim 0, row-parallel c_proj weights along dim 1, the rest replicated (whole)."""
    def part(size: int) -> tuple[int, int]:
        return (rank * size // tp, size // tp)

    if ".attn.c_attn." in name:  # (3C, C) / (3C,): this rank's heads of q, k and v
        c = shape[0] // 3
        return ParamLayout(shape, 0, tuple((i * c + part(c)[0], c // tp) for i in range(3)))
    if ".mlp.c_fc." in name or name in ("transformer.wte.weight", "lm_head.weight"):
        return ParamLayout(shape, 0, (part(shape[0]),))
    if name.endswith("c_proj.weight"):
        return ParamLayout(shape, 1, (part(shape[1]),))
    return ParamLayout.whole(shape)


def tp_local_model(model: nn.Module, tp: int, rank: int) -> dict[str, ParamLayout]:
    """Replace every parameter of `model` by its TP-local slice (ties kept); returns the layouts."""
    layouts = {}
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            layout = megatron_layout(name, tuple(param.shape), tp, rank)
            layouts[name] = layout
            local = nn.Parameter(local_from_full(param.detach(), layout).clone())
            for module in model.modules():  # every owner, so a tied parameter stays one object
                for attr, p in list(module._parameters.items()):
                    if p is param:
                        setattr(module, attr, local)
    return layouts


def pipeline_stage(model: nn.Module, stage: int) -> dict[str, str]:
    """Cut a 2-layer GPT to pipeline stage 0 (embeddings, block 0) or 1 (block 1, ln_f, its own head copy),
    names unchanged; returns the stage's tied copies (engine.tied_copies)."""
    h = model.transformer.h
    if stage == 0:
        h[1] = nn.Identity()
        del model.transformer["ln_f"]
        del model.lm_head
        return {}
    h[0] = nn.Identity()
    del model.transformer["wte"], model.transformer["wpe"]
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # no longer wte's object
    return dict(TIED_HEAD)


def _pieces(state: dict):
    """(shard map, piece) for every parameter range this rank's shards hold (the engine's state_dict)."""
    for shard in state["shards"].values():
        for piece in shard.pieces:
            yield shard, piece


def _expected(reference: dict, kind: str, name: str, layout: ParamLayout, tied: dict, start: int, end: int):
    full = reference[kind][tied.get(name, name) if name not in reference[kind] else name]
    return local_from_full(full, layout).flatten()[start:end]


def fill_engine(engine: Any, reference: dict, step: int) -> None:
    """Put the reference (cut by the engine's layouts) into the engine's masters and Adam state."""
    state = engine.state_dict()
    layouts, tied, chunks = state["layouts"], state["tied"], state["optimizer"]["chunks"]
    for shard, piece in _pieces(state):
        live = chunks[shard.chunk]
        for kind in KINDS:
            if not isinstance(live.get(kind), torch.Tensor) or live[kind].dim() == 0:
                live[kind] = torch.zeros(shard.numel)
            live[kind][piece.shard_slice] = _expected(reference, kind, piece.name, layouts[piece.name], tied,
                                                      piece.start, piece.end)
        live["step"] = torch.tensor(float(step))
    engine.load_state_dict(state)


def engine_mismatches(engine: Any, reference: dict) -> list[str]:
    """Where this rank's masters, Adam state and parameters differ (bitwise) from the reference cut by the
    engine's own layouts; [] when they are all equal."""
    state = engine.state_dict()
    layouts, tied, chunks = state["layouts"], state["tied"], state["optimizer"]["chunks"]
    params = {chunk.plan.index: chunk.shard for chunk in engine.chunks}  # the working copies the masters set
    bad = []
    for shard, piece in _pieces(state):
        where = piece.shard_slice
        actual = {kind: chunks[shard.chunk][kind][where] for kind in KINDS}
        actual["param"] = params[shard.chunk][where].float()
        for kind, value in actual.items():
            expected = _expected(reference, "master" if kind == "param" else kind, piece.name,
                                 layouts[piece.name], tied, piece.start, piece.end)
            if not torch.equal(value.cpu(), expected):
                bad.append(f"{kind} of {piece.name} [{piece.start}, {piece.end})")
    return bad


def reference_from_engine(engine: Any) -> dict:
    """{kind: {name: unsharded tensor}} from a world-1 engine without tensor or pipeline parallelism."""
    state = engine.state_dict()
    chunks, layouts = state["optimizer"]["chunks"], state["layouts"]
    return {kind: {piece.name: chunks[shard.chunk][kind][piece.shard_slice].detach().clone()
                   .view(layouts[piece.name].global_shape) for shard, piece in _pieces(state)} for kind in KINDS}


def reference_from_checkpoint(directory: str) -> dict:
    """{kind: {name: unsharded tensor}} read back from a checkpoint of any layout."""
    reader = CheckpointReader(directory)
    return {kind: {name: reader.tensor(name, kind) for name in reader.meta["params"]} for kind in KINDS}
