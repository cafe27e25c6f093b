"""Megatron-style tensor parallelism for model_zoo's GPT and Llama family, from outside with torch's DTensor plans.

`apply_tensor_parallel(model, tp_mesh)` builds the plan (`_plan`: every block's from its family, families.py: the
q/k/v (GPT's fused c_attn) and MLP-in projections column-parallel, the attention-out and MLP-out projections
row-parallel; the token embedding vocab-parallel, lm_head column-parallel on its vocabulary; norms, GPT's wpe and
the row-parallel biases replicated), so `model_zoo` stays plain models. Around the plan: GPT's fused c_attn has
its [q; k; v] rows permuted first, so DTensor's even Shard(0) gives each rank its own heads of all three
(`_qkv_rows`); a tied head is re-tied to the embedding, which `parallelize_module` unties; the model's
`real_vocab` slice becomes a mask of the local shard's padded classes (`_MaskPaddedVocab`: slicing the
vocab-sharded logits would all-gather them); the dropouts on what only this rank holds get its own stream
(rng.py). `tensor_parallel_layout` says which blocks of the unsharded parameter each local tensor holds (for
checkpoints; `full_tensor()` would return c_attn's permuted rows). A model built on meta works; one built in
ZeroInitContext does not (the permutation and slicing happen outside the context, unrecorded). DESIGN.md
section 9 has the rest: SP, the loss, gradients, memory.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from zerogpt.parallel.families import Family, family_of
from zerogpt.parallel.layout import ParamLayout
from zerogpt.parallel.mesh import ParallelDims
from zerogpt.parallel.rng import own_stream

__all__ = ["apply_tensor_parallel", "tensor_parallel_layout"]


class _MaskPaddedVocab(nn.Module):
    """A model's `real_vocab` under tensor parallelism: the padded classes of the local logits shard set to -inf."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: DTensor) -> DTensor:
        local = logits.to_local()
        width = local.size(-1)
        start = logits.device_mesh.get_local_rank() * width  # even Shard(-1): the padded vocab divides by T
        ids = torch.arange(start, start + width, device=local.device)
        local = local.masked_fill(ids >= self.vocab_size, float("-inf"))
        return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                                  shape=logits.shape, stride=logits.stride())


def _qkv_rows(width: int, tp: int) -> torch.Tensor:
    """Row order of a (3C, ...) [q; k; v] tensor whose contiguous block r is [q_r; k_r; v_r]."""
    per = width // tp
    return torch.cat([torch.arange(part * width + r * per, part * width + (r + 1) * per)
                      for r in range(tp) for part in range(3)])


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> set[str]:
    """Shard a model_zoo GPT or Llama-family model over `tp_mesh` (1-D) in Megatron's layout, in place; call
    before `initialize`.

    Every tensor-parallel rank must pass the same, fully built weights (same seed), or the same meta build: each
    keeps its slice. Returns the names of the parameters that stay replicated over the tensor-parallel ranks:
    their gradient is the same on every rank, so ranks other than tensor-parallel rank 0 put them in
    `norm_duplicates`.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tensor-parallel mesh (mesh['tp']), "
                         f"got a {tp_mesh.ndim}-D mesh")
    family, tp = family_of(model), tp_mesh.size()
    ParallelDims(tp=tp).check_config(model.config)
    if family.fused_qkv is not None:
        with torch.no_grad():
            for block in model.get_submodule(family.layers):
                qkv = block.get_submodule(family.fused_qkv)
                rows = _qkv_rows(qkv.out_features // 3, tp)
                qkv.weight.data = qkv.weight.data[rows]
                qkv.bias.data = qkv.bias.data[rows]
    parallelize_module(model, tp_mesh, _plan(model, family, sequence_parallel))
    for module in family.own_dropouts(model, sequence_parallel):
        own_stream(module, tp_mesh.get_local_rank())
    if family.tied(model.config):  # re-tie: one Shard(0) DTensor parameter
        model.lm_head.weight = model.get_submodule(family.embedding).weight
    model.real_vocab = _MaskPaddedVocab(model.config.vocab_size)
    return {name for name, p in model.named_parameters() if _shard_dim(name, p) is None}


def _plan(model: nn.Module, family: Family, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallelize_module plan: Megatron's TP, and with `sequence_parallel` Megatron's SP on top of it.

    Under SP the residual stream between the matmuls is sharded on the sequence dim (Shard(1)): the embedding's
    and each row-parallel output's all-reduce becomes a reduce-scatter, each norm runs on its rank's positions
    (`SequenceParallel`: its weights a Replicate DTensor whose gradient is a Partial sum, all-reduced when the
    engine takes it), and each attention / MLP / head input is all-gathered back to the whole sequence (the
    blocks' PrepareModuleInput, families.py). Same communication volume as plain TP; the norm and dropout
    activations and the residual stream are 1/T per rank.
    """
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's placement between blocks
    plan: dict[str, ParallelStyle] = {}
    for i, block in enumerate(model.get_submodule(family.layers)):
        plan.update(family.block_plan(f"{family.layers}.{i}", block, sequence_parallel))
    plan[family.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:  # the final norm on this rank's positions; GPT's wpe (T, C) rows cut to them
        plan[family.final_norm] = SequenceParallel()
        if family.positions is not None:
            plan[family.positions] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    return plan


def _shard_dim(name: str, p: torch.Tensor) -> int | None:
    """The dim `p` is split along over the tensor-parallel ranks; None when every rank holds all of it
    (a plain tensor, or a Replicate DTensor such as a row-parallel Linear's bias)."""
    if not isinstance(p, DTensor):
        return None
    (placement,) = p.placements
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, Shard):
        raise ValueError(f"{name}: placement {placement} is neither Shard nor Replicate; "
                         f"apply_tensor_parallel makes none")
    return placement.dim


def tensor_parallel_layout(model: nn.Module) -> dict[str, ParamLayout]:
    """For each parameter (tied ones once), how this rank's local tensor maps onto the unsharded one: one even
    block of the split dim, but GPT's fused c_attn, whose local rows are its own heads of q, k and v."""
    fused = family_of(model).fused_qkv
    layout = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)  # a DTensor's shape is the global one
        dim = _shard_dim(name, p)
        if dim is None:
            layout[name] = ParamLayout.whole(shape)
            continue
        dim, rank, tp = dim % len(shape), p.device_mesh.get_local_rank(), p.device_mesh.size()
        per = shape[dim] // tp
        if fused is not None and name.endswith((f"{fused}.weight", f"{fused}.bias")):
            width = shape[0] // 3
            per = width // tp
            blocks = tuple((part * width + rank * per, per) for part in range(3))
        else:
            blocks = ((rank * per, per),)
        layout[name] = ParamLayout(shape, dim, blocks)
    return layout
