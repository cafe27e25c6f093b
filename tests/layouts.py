"""Test helpers for checkpoints under tensor/pipeline layouts: Megatron-style TP-local and pipeline-stage copies of a
tiny GPT, an engine's state filled from unsharded reference tensors, and the check that an engine's state is the
reference cut by the engine's own layouts (engine_layouts / engine_tied: what the engine says it holds).

A reference is {kind: {name: unsharded fp32 tensor}} with kinds "master", "exp_avg", "exp_avg_sq".
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerogpt.checkpoint import CheckpointReader, engine_layouts, engine_tied
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


def _slot_ranges(engine: Any):
    """(chunk, slot, local start, local end, shard slice) for every slot overlap this rank owns."""
    for chunk in engine.chunks:
        lo, _ = chunk.plan.shard_range(chunk.shard_index)
        for slot in chunk.plan.slots:
            overlap = chunk.plan.slot_overlap(slot, chunk.shard_index)
            if overlap is not None:
                yield chunk, slot, overlap[0] - slot.offset, overlap[1] - slot.offset, \
                    slice(overlap[0] - lo, overlap[1] - lo)


def _expected(reference: dict, kind: str, name: str, layout: ParamLayout, tied: dict, start: int, end: int):
    full = reference[kind][tied.get(name, name) if name not in reference[kind] else name]
    return local_from_full(full, layout).flatten()[start:end]


def fill_engine(engine: Any, reference: dict, step: int) -> None:
    """Put the reference (cut by the engine's layouts) into the engine's masters and Adam state."""
    layouts, tied = engine_layouts(engine), engine_tied(engine)
    state = engine.state_dict()
    chunks = state["optimizer"]["chunks"]
    for chunk, slot, start, end, where in _slot_ranges(engine):
        live = chunks[chunk.plan.index]
        for kind in KINDS:
            if not isinstance(live.get(kind), torch.Tensor) or live[kind].dim() == 0:
                live[kind] = torch.zeros(chunk.plan.shard_numel)
            live[kind][where] = _expected(reference, kind, slot.name, layouts[slot.name], tied, start, end)
        live["step"] = torch.tensor(float(step))
    engine.load_state_dict(state)


def engine_mismatches(engine: Any, reference: dict) -> list[str]:
    """Where this rank's masters, Adam state and parameters differ (bitwise) from the reference cut by the
    engine's own layouts; [] when they are all equal."""
    layouts, tied = engine_layouts(engine), engine_tied(engine)
    chunks = engine.state_dict()["optimizer"]["chunks"]
    bad = []
    for chunk, slot, start, end, where in _slot_ranges(engine):
        live = chunks[chunk.plan.index]
        actual = {kind: live[kind][where] for kind in KINDS}
        actual["param"] = chunk.shard[where].float()
        for kind, value in actual.items():
            expected = _expected(reference, "master" if kind == "param" else kind, slot.name,
                                 layouts[slot.name], tied, start, end)
            if not torch.equal(value.cpu(), expected):
                bad.append(f"{kind} of {slot.name} [{start}, {end})")
    return bad


def reference_from_engine(engine: Any) -> dict:
    """{kind: {name: unsharded tensor}} from a world-1 engine without tensor or pipeline parallelism."""
    chunks = engine.state_dict()["optimizer"]["chunks"]
    return {kind: {slot.name: chunks[c.plan.index][kind][slot.offset:slot.end].detach().clone().view(slot.shape)
                   for c in engine.chunks for slot in c.plan.slots} for kind in KINDS}


def reference_from_checkpoint(directory: str) -> dict:
    """{kind: {name: unsharded tensor}} read back from a checkpoint of any layout."""
    reader = CheckpointReader(directory)
    return {kind: {name: reader.tensor(name, kind) for name in reader.meta["params"]} for kind in KINDS}
