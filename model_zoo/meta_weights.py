"""Refuse a call on a model whose weights are still on the meta device, in one line that says what to do.

model_zoo builds pretrained and fresh models on the meta device (no storage) for zerogpt.initialize, which fills
each rank's shards. Called directly, such a model fails deep inside torch ("Tensor on device cpu is not on the
expected device meta!"), which names neither cause nor fix. GPT and Llama ask `weights_are_real` at the top of
their forward until it says yes once, so a model with real weights pays one attribute read per call afterwards.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["weights_are_real"]


def weights_are_real(model: nn.Module, inputs: torch.Tensor) -> bool:
    """True when no parameter of `model` is on the meta device (the caller stops asking).

    False for meta weights called with meta inputs: shape propagation, which a meta model is for. Raises
    RuntimeError in one line for meta weights called with real inputs. A DTensor parameter (tensor parallelism)
    is judged by its local tensor, the one that holds the values.
    """
    from torch.distributed.tensor import DTensor

    meta = next((name for name, p in model.named_parameters()
                 if (p.to_local() if isinstance(p, DTensor) else p).is_meta), None)
    if meta is None:
        return True
    if inputs.is_meta:
        return False
    raise RuntimeError(f"{type(model).__name__}'s weights are on the meta device ({meta} has no values: "
                       f"model_zoo.from_pretrained(DIR) and a meta build leave them there for zerogpt.initialize); "
                       f"load them with model_zoo.from_pretrained(DIR, device=\"cpu\") (or \"cuda\"), or give the "
                       f"model to zerogpt.initialize, which fills each rank's shards")
