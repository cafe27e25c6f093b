"""Mixed precision: compute dtypes and the fp16 dynamic loss scaler.

The scaler holds no tensors and does no communication: the optimizer all-reduces the overflow flag
once per step and hands the verdict to `update()`. bf16 and fp32 need no scaling (scale stays 1).
"""
from __future__ import annotations

import typing

import torch

from zerogpt.config.dtypes import DTYPES, Precision, compute_dtype_name
from zerogpt.config.schema import LossScaleConfig

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, d.torch_name) for name, d in DTYPES.items()}
"""zerogpt's dtype names as torch dtypes (the table is zerogpt/config/dtypes.py's DTYPES)."""


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters and activations under `precision` (fp8: bf16, float8 only inside Linear)."""
    if precision not in typing.get_args(Precision):
        raise ValueError(f"precision must be one of {', '.join(typing.get_args(Precision))}, got {precision!r}; "
                         f"set precision = 'bf16' (or --set precision=bf16)")
    return TORCH_DTYPES[compute_dtype_name(precision)]


class DynamicLossScaler:
    """fp16 loss scale: back off on overflow (after `hysteresis` overflows), grow after a clean run.

    The numbers are the `zero.loss_scale` section's (LossScaleConfig: DeepSpeed/Megatron's defaults, start at
    2**16, x0.5 on overflow, x2 after 1000 clean steps); disabled (bf16, fp32), the scale stays 1.
    """

    def __init__(self, config: LossScaleConfig, enabled: bool = True) -> None:
        """`config`: the `zero.loss_scale` section."""
        self.config = config
        self.enabled = enabled
        self.scale = float(self.config.initial_scale) if enabled else 1.0
        self._clean_steps = 0
        self._hysteresis_left = self.config.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
                self._hysteresis_left = self.config.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps % self.config.growth_interval == 0:
            self.scale = min(self.scale * self.config.growth_factor, self.config.max_scale)
            self._hysteresis_left = self.config.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
