"""Mixed precision: compute dtypes and the fp16 dynamic loss scaler.

The scaler holds no tensors and does no communication: the optimizer all-reduces the overflow flag
once per step and hands the verdict to `update()`. bf16 and fp32 need no scaling (scale stays 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}; "
                         f"set precision = 'bf16' (or --set precision=bf16)")
    return DTYPES[precision]


@dataclass
class DynamicLossScaler:
    """fp16 loss scale: back off on overflow (after `hysteresis` overflows), grow after a clean run.

    Defaults follow DeepSpeed/Megatron: start at 2**16, x0.5 on overflow, x2 after 1000 clean steps.
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**32
    enabled: bool = True

    def __post_init__(self) -> None:
        self.scale = float(self.initial_scale) if self.enabled else 1.0
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps % self.growth_interval == 0:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
