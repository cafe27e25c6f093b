"""Megatron-style tensor parallelism for model_zoo's GPT, applied from outside with torch's DTensor plans.

`apply_tensor_parallel(model, tp_mesh)` is the one place the plan lives (`_plan`: c_attn and c_fc column-parallel,
both c_proj row-parallel, wte a vocab-parallel embedding, lm_head column-parallel on wte's weight; LayerNorms, wpe
and the row-parallel biases replicated), so `model_zoo/gpt.py` stays a plain model. Around the plan: c_attn's
[q; k; v] rows are permuted first, so DTensor's even Shard(0) gives each rank its own heads of all three
(`_qkv_rows`); the head is re-tied to wte, which `parallelize_module` unties; GPT's `real_vocab` slice becomes a
mask of the local shard's padded classes (`_MaskPaddedVocab`: slicing the vocab-sharded logits would all-gather
them); the dropouts on what only this rank holds get its own stream (rng.py). `tensor_parallel_layout` says which
blocks of the unsharded parameter each local tensor holds (for checkpoints; `full_tensor()` would return c_attn's
permuted rows). A model built on meta works; one built in ZeroInitContext does not (the permutation and slicing
happen outside the context, unrecorded). DESIGN.md section 9 has the rest: SP, the loss, gradients, memory.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from zerogpt.parallel.layout import ParamLayout
from zerogpt.parallel.mesh import ParallelDims
from zerogpt.parallel.rng import own_stream

__all__ = ["apply_tensor_parallel", "tensor_parallel_layout"]

_QKV = "attn.c_attn"  # the fused [q; k; v] projection: permuted so each rank holds [q_r; k_r; v_r]


class _MaskPaddedVocab(nn.Module):
    """`GPT.real_vocab` under tensor parallelism: the padded classes of the local logits shard set to -inf."""

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
    """Shard a model_zoo GPT over `tp_mesh` (1-D) in Megatron's layout, in place; call before `initialize`.

    Every tensor-parallel rank must pass the same, fully built weights (same seed): each keeps its slice.
    Returns the names of the parameters that stay replicated over the tensor-parallel ranks: their gradient
    is the same on every rank, so ranks other than tensor-parallel rank 0 put them in `norm_duplicates`.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tensor-parallel mesh (mesh['tp']), "
                         f"got a {tp_mesh.ndim}-D mesh")
    tp = tp_mesh.size()
    ParallelDims(tp=tp).check_gpt(model.config)
    with torch.no_grad():
        for block in model.transformer.h:
            qkv = block.attn.c_attn
            rows = _qkv_rows(qkv.out_features // 3, tp)
            qkv.weight.data = qkv.weight.data[rows]
            qkv.bias.data = qkv.bias.data[rows]
    parallelize_module(model, tp_mesh, _plan(len(model.transformer.h), sequence_parallel))
    _own_dropout_streams(model, tp_mesh.get_local_rank(), sequence_parallel)
    model.lm_head.weight = model.transformer.wte.weight  # re-tie: one Shard(0) DTensor parameter
    model.real_vocab = _MaskPaddedVocab(model.config.vocab_size)
    return {name for name, p in model.named_parameters() if _shard_dim(name, p) is None}


def _plan(n_layer: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallelize_module plan: Megatron's TP, and with `sequence_parallel` Megatron's SP on top of it.

    Under SP the residual stream between the matmuls is sharded on the sequence dim (Shard(1)): the embedding's
    and each row-parallel output's all-reduce becomes a reduce-scatter, each LayerNorm runs on its rank's
    positions (`SequenceParallel`: its weights a Replicate DTensor whose gradient is a Partial sum, all-reduced
    when the engine takes it), and each attention / MLP / head input is all-gathered back to the whole sequence.
    Same communication volume as plain TP; the LayerNorm and dropout activations and the residual stream are
    1/T per rank.
    """
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's placement between blocks
    plan: dict[str, ParallelStyle] = {}
    for i in range(n_layer):
        block = f"transformer.h.{i}"
        plan.update({f"{block}.attn.c_attn": ColwiseParallel(), f"{block}.mlp.c_fc": ColwiseParallel(),
                     f"{block}.attn.c_proj": RowwiseParallel(output_layouts=seq),
                     f"{block}.mlp.c_proj": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            gather = Replicate()
            plan.update({f"{block}.ln_1": SequenceParallel(), f"{block}.ln_2": SequenceParallel(),
                         # attn(x, layer_past, use_cache), mlp(x): the whole sequence in
                         f"{block}.attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                                             desired_input_layouts=(gather, None, None)),
                         f"{block}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(gather,))})
    plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:  # wpe's (T, C) rows for this rank's positions; ln_f on them
        plan["transformer.wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["transformer.ln_f"] = SequenceParallel()
    return plan


def _own_dropout_streams(model: nn.Module, rank: int, sequence_parallel: bool) -> None:
    """The dropouts on what only this rank holds draw from its own stream (rng.py): the attention
    probabilities of its heads, and under SP the embedding and residual dropouts of its positions."""
    own = [block.attn.attend for block in model.transformer.h]
    if sequence_parallel:
        own += [model.transformer.drop]
        own += [m for block in model.transformer.h for m in (block.attn.resid_dropout, block.mlp.dropout)]
    for module in own:
        own_stream(module, rank)


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
    """For each parameter (tied ones once), how this rank's local tensor maps onto the unsharded one."""
    layout = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)  # a DTensor's shape is the global one
        dim = _shard_dim(name, p)
        if dim is None:
            layout[name] = ParamLayout.whole(shape)
            continue
        dim, rank, tp = dim % len(shape), p.device_mesh.get_local_rank(), p.device_mesh.size()
        per = shape[dim] // tp
        if name.endswith((f"{_QKV}.weight", f"{_QKV}.bias")):
            width = shape[0] // 3
            per = width // tp
            blocks = tuple((part * width + rank * per, per) for part in range(3))
        else:
            blocks = ((rank * per, per),)
        layout[name] = ParamLayout(shape, dim, blocks)
    return layout
