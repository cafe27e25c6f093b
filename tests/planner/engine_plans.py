"""Engine plans made without an engine: a small parameter layout on the meta device and a CPU context."""
from __future__ import annotations

from typing import Any

import torch

import zerogpt
from zerogpt.config import engine_config
from zerogpt.context import DistContext
from zerogpt.planner.engine_plan import EnginePlan, plan_engine

# (name, shape, optimizer group): two blocks' worth of a tiny GPT, biases beside their weights; 4 B per fp32 element
LAYOUT = [("wte", (256, 32), 0), ("h0.w", (32, 96), 0), ("h0.b", (96,), 0), ("h1.w", (32, 96), 0),
          ("h1.b", (96,), 0), ("ln_f", (32,), 0)]


def meta_params(layout=LAYOUT) -> list[tuple[str, torch.nn.Parameter, int]]:
    return [(n, torch.nn.Parameter(torch.empty(shape, device="meta")), g) for n, shape, g in layout]


def plan_for(zero: dict, *, precision: str = "fp32", accumulation: int = 1, world: int = 1,
             ctx: Any = None, **kwargs: Any) -> EnginePlan:
    """The plan initialize would make for LAYOUT under this `zero` section, with no engine built."""
    cfg = zerogpt.Config(dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=accumulation))
    ctx = ctx or DistContext(0, world, torch.device("cpu"))
    return plan_engine(engine_config(cfg, world), meta_params(), ctx, **kwargs)
