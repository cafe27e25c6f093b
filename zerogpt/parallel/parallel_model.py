"""ParallelModel: this rank's part of a model after the tensor and pipeline plans, and what the engine must know.

`initialize` takes one in place of the module (`parallelize` in plan.py makes it; `ParallelModel.whole` wraps a
model no plan touched), so everything the engine needs about the model's layout arrives when it is built:
where each local tensor lies in the unsharded parameter (checkpoints), which gradients another rank also holds
(the grad norm), the tied copy a last stage keeps (checkpoints), and the loss's context (vocab-parallel loss).
Kept apart from plan.py so that a data-parallel run does not import torch's tensor-parallel and pipelining code.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
from torch import nn

from zerogpt.parallel.layout import ParamLayout
from zerogpt.parallel.mesh import ParallelDims

__all__ = ["ParallelModel", "local_loss"]


@dataclass(frozen=True)
class ParallelModel:
    """This rank's part of the model after the plans, and what the engine needs to know about it."""

    module: nn.Module
    dims: ParallelDims = field(default_factory=ParallelDims)
    """T and P (D is the context's)."""
    layouts: dict[str, ParamLayout] = field(default_factory=dict)
    """name -> where this rank's local tensor lies in the unsharded parameter (absent: it is the whole one)."""
    norm_duplicates: frozenset[str] = frozenset()
    """Parameters whose gradient another rank of the pp x tp group also holds: counted there, not here, in the
    grad norm (a TP-replicated parameter off TP rank 0; a last stage's head copy)."""
    tied_copies: dict[str, str] = field(default_factory=dict)
    """alias -> canonical: a last pipeline stage's own head, kept equal to wte (checkpoints save wte once)."""

    def loss_context(self) -> ContextManager:
        """What a loss and its backward run inside: torch's `loss_parallel` on vocab-sharded logits."""
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def criterion(self, criterion: Callable | None) -> Callable | None:
        """`criterion` as this rank computes it: under tensor parallelism it returns the plain local loss."""
        return local_loss(criterion) if self.dims.tp > 1 else criterion


def local_loss(criterion: Callable | None) -> Callable | None:
    """`criterion` giving a plain tensor: on vocab-sharded logits its loss is a replicated DTensor."""
    if criterion is None:
        return None

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return plain_loss(criterion(logits, labels))

    return loss


def plain_loss(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor, differentiably: computed on vocab-sharded logits it is a replicated DTensor (the
    criterion's, or a model's own loss from its labels)."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value
