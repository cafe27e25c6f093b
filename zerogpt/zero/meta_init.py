"""RangeInit: fill this rank's shards of a meta-device model from the model's own `init_param_range`.

The default path for model_zoo's GPT: train_gpt.py builds it under `torch.device("meta")` (no storage, no init)
and `initialize()` asks the model for the values of this rank's shard of each chunk, as torchtitan builds on meta
and initialises after sharding. The protocol is duck-typed, since zerogpt does not import model_zoo:
`model.init_param_range(name, start, end)` returns elements [start, end) of the flattened parameter `name` as
initialised, the same values however the parameter is split. Models without it use record/replay (init_ctx.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerogpt.zero.init_ctx import built_in_context

__all__ = ["RangeInit", "range_init"]


@dataclass
class RangeInit:
    """Values of a meta model's parameters, by name and element range, from `model.init_param_range`.

    Real (non-meta) parameters of the model are read as they are.
    """

    model: nn.Module
    params: dict[str, nn.Parameter]

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """Nothing to fill: `range_init` refuses a model with meta buffers."""
        return {}

    def range_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter `name` as initialised.

        Peak memory: what `init_param_range` needs for one range (GPT: the range and one block; a checkpoint's
        reader: the range's rows in the file's dtype).
        """
        param = self.params[name]
        if not param.is_meta:
            return param.detach().reshape(-1)[start:end]
        values = self.model.init_param_range(name, start, end)
        if not isinstance(values, torch.Tensor) or values.numel() != end - start:
            got = f"{values.numel()} values" if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"{type(self.model).__name__}.init_param_range({name!r}, {start}, {end}) returned "
                             f"{got}; it must return a tensor of end - start = {end - start} values")
        return values.reshape(-1)


def range_init(model: nn.Module) -> RangeInit | None:
    """A RangeInit when `model` has meta parameters, was not built in a ZeroInitContext and has init_param_range.

    None otherwise: a model with real weights, or one whose meta parameters were recorded (or not, and
    `recorded_init` then says what to do).

    Raises:
        ValueError: the model has a meta buffer, which init_param_range cannot fill.
    """
    params = dict(model.named_parameters())
    if not any(p.is_meta for p in params.values()) or built_in_context(model):
        return None
    if not callable(getattr(model, "init_param_range", None)):
        return None
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ValueError(f"buffer {name!r} of {type(model).__name__} is on the meta device, and "
                             f"init_param_range fills parameters only; create the buffer with real values (e.g. "
                             f"device='cpu' inside the meta build) or build the model inside zerogpt.ZeroInitContext")
    return RangeInit(model, params)
