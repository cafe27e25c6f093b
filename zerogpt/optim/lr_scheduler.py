"""LR schedules: linear warmup, then cosine / linear decay to an absolute floor `min_lr`, or constant.

Owns the shape of the schedule as a torch LambdaLR (so state_dict/load_state_dict come for free);
does not own when it is stepped (Trainer.fit calls `scheduler.step()` once per optimizer step).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["build_lr_scheduler", "WarmupDecay"]


class ScheduleConfig(Protocol):
    """The fields of `zerogpt.config.LRSchedulerConfig` the schedule reads (a Protocol, because the config
    schema imports zerogpt.optim to resolve optimizer names, so zerogpt.optim does not import the schema)."""

    type: str
    warmup_steps: int
    total_steps: int | None
    min_lr: float


class WarmupDecay:
    """LR multiplier at optimizer step `s` (0-based): the LambdaLR lambda, a plain object so that
    LambdaLR.state_dict() saves its fields and a resumed run gets the exact same schedule.

    warmup (s < warmup_steps):  (s + 1) / (warmup_steps + 1)   -- ramps up from ~0, never a wasted lr=0 step
                                (the torchtitan convention); reaches 1.0 at s = warmup_steps.
    decay:   p = (s - warmup_steps) / (total_steps - warmup_steps), clipped to [0, 1];
             cosine: f = 0.5 (1 + cos(pi p)); linear: f = 1 - p; constant: f = 1
             multiplier = min_ratio + (1 - min_ratio) f   (min_ratio = min_lr / base lr of group 0)
    """

    def __init__(self, kind: str, warmup_steps: int, total_steps: int | None, min_ratio: float) -> None:
        self.kind, self.warmup_steps, self.total_steps, self.min_ratio = kind, warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        f = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * f


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig,
                       total_steps: int | None = None) -> LambdaLR:
    """Build the run's LR schedule over `optimizer`.

    Args:
        optimizer: any torch optimizer; each group's current lr is its peak (base) lr.
        cfg: the checked `lr_scheduler` section (`zerogpt.config.LRSchedulerConfig`); min_lr is an absolute
            floor applied to group 0 (other groups keep the same ratio to their own base lr).
        total_steps: the run's length in optimizer steps; used when cfg.total_steps is None.
    Returns:
        torch.optim.lr_scheduler.LambdaLR; call .step() after each optimizer step (Trainer.fit does).

    Example:
        >>> cfg = LRSchedulerConfig(type="cosine", warmup_steps=100, min_lr=1e-5)
        >>> sched = build_lr_scheduler(opt, cfg, total_steps=10_000)
    """
    total = cfg.total_steps or total_steps
    # The checks below need the run's length and the optimizer's lr, which the config section alone lacks.
    if cfg.type != "constant":
        if total is None:
            raise ValueError(f"lr_scheduler.type={cfg.type!r} needs a length: set lr_scheduler.total_steps or "
                             f"train.max_steps (e.g. --set train.max_steps=1000)")
        if total < cfg.warmup_steps:
            raise ValueError(f"lr_scheduler.total_steps={total} is shorter than warmup_steps={cfg.warmup_steps}; "
                             f"raise total_steps or lower warmup_steps")
    base_lr = float(optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"]))
    if cfg.type != "constant" and cfg.min_lr > base_lr:
        raise ValueError(f"lr_scheduler.min_lr={cfg.min_lr} is above the optimizer's lr={base_lr}; "
                         f"min_lr is the floor the decay ends at, set it below lr")
    min_ratio = cfg.min_lr / base_lr if base_lr > 0 else 0.0
    return LambdaLR(optimizer, WarmupDecay(cfg.type, cfg.warmup_steps, None if total is None else int(total),
                                           min_ratio))
