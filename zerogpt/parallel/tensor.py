"""Megatron-style tensor parallelism for model_zoo's GPT, applied from outside with torch's DTensor plans.

`apply_tensor_parallel(model, tp_mesh)` is the one place the plan lives; `model_zoo/gpt.py` stays a plain model.
Per block, `torch.distributed.tensor.parallel.parallelize_module` makes
  attn.c_attn, mlp.c_fc    ColwiseParallel  (weight rows Shard(0); input replicated, output this rank's columns)
  attn.c_proj, mlp.c_proj  RowwiseParallel  (weight columns Shard(1); the partial sums all-reduced)
and for the whole model
  transformer.wte          RowwiseParallel  vocab-parallel embedding: rows Shard(0), out-of-shard ids masked,
                                            the partial embeddings all-reduced (DTensor's MaskPartial)
  lm_head                  ColwiseParallel  the same Shard(0) weight (tied), logits left sharded on the vocab dim
  real_vocab               replaced: padded classes masked to -inf in the local shard instead of sliced off.
LayerNorms, wpe and the row-parallel biases stay replicated (plain tensors); their gradients are the same on
every tensor-parallel rank, because every activation they touch is replicated.

Fused QKV. `c_attn` is one (3C, C) Linear whose rows are [q; k; v] and the attention splits its output in
three. A plain Shard(0) of those rows would give rank 0 all of q and half of k. Each rank r must hold the
rows of its own heads in each of q, k and v: [q_r; k_r; v_r], three row blocks of the standard layout, so
its local output splits in three as before and `CausalSelfAttention` reads its local head count from the
width. To get there with DTensor's even Shard(0), the rows (weight and bias) are permuted once, before
`parallelize_module` slices them, so that the contiguous block r is [q_r; k_r; v_r]. The parameter keeps its
name and each rank's values are rows of the standard layout; only the DTensor's notion of which global rows
it holds is the permuted one, which compute never needs (a column-parallel Linear's rows are independent).
What a local tensor *is* in the unsharded parameter is stated by `tensor_parallel_layout`, never by
`DTensor.full_tensor()` (which would return the permuted rows for c_attn).

Tied embedding and head. `parallelize_module` distributes each module's parameter on its own and wraps it
in a new Parameter, which unties them; both want Shard(0) on the same mesh, so after the plan the head is
pointed back at the embedding's DTensor: one parameter, as before.

Vocab-parallel loss. The head's logits stay a DTensor sharded on the (padded) vocab dim: no rank
materialises the full (B, T, V) logits. `GPT` slices logits to the real vocabulary through its `real_vocab`
module; slicing a sharded dim would all-gather it, so the plan replaces that module with one that masks the
padded classes of the local shard to -inf (they drop out of the softmax and get zero gradient). The loss is
torch's `loss_parallel()`: inside it, `F.cross_entropy` (so model_zoo's GPTLMLoss) on vocab-sharded logits
computes Megatron's max / sum-exp / target-logit all-reduces. Its backward must run inside the same context:
a training step wraps the loss *and* `engine.backward(loss)` in `loss_parallel()`. The loss is a replicated
DTensor; `.to_local()` gives the plain scalar (differentiably).

Dropout. Every tensor-parallel rank must be seeded alike: the dropouts on replicated activations
(embeddings, residual branches) then draw the same masks on every rank, which keeps those activations
replicated. The attention dropout of a rank's own heads, and under SP the dropouts of its own positions, draw
from a stream of the rank's own, forked from the shared one (rng.py), as Megatron does.

Layout (for checkpoints): `tensor_parallel_layout(model)[name]` is a `layout.ParamLayout(global_shape, dim,
blocks)`: `global_shape` is the unsharded parameter's shape, `dim` the dim it is split along (`is_whole`:
replicated, the local tensor is the whole parameter) and `blocks` the (start, length) ranges of that dim, in the unsharded
parameter, that this rank's local tensor concatenates along `dim`, in order. A c_attn weight on rank r of T
has blocks [(r*C/T, C/T), (C + r*C/T, C/T), (2C + r*C/T, C/T)]; a Shard(d) parameter has one block.

Sequence parallelism (`sequence_parallel=True`, see `_plan`) shards the residual stream on the sequence dim
between the matmuls. A model built on the meta device works (the plan only reshapes meta tensors; plan.py fills
the shards). Not done: models built in ZeroInitContext (the plan's row permutation and slicing happen outside
the context, where nothing records them).
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
    is the same on every rank, so ranks other than tensor-parallel rank 0 put them in `norm_skip`.
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
