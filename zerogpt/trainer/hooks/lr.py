"""LRSchedulerHook: advances the learning-rate schedule once per optimizer step and saves its position.

The schedule itself (warmup + cosine / linear / constant, min_lr) is built by
`zerogpt.optim.lr_scheduler.build_lr_scheduler`; this hook only steps it and carries its state_dict in
the checkpoint so a resumed run continues on the same curve.
"""
from __future__ import annotations

from typing import Any

from zerogpt.trainer.hooks.base import Hook


class LRSchedulerHook(Hook):
    """Steps `lr_scheduler` after every optimizer step that was applied.

    An fp16 step skipped on overflow did not move the weights, so the schedule does not advance either
    (as DeepSpeed does); `state.metrics["lr"]` is the rate the step used.

    Args:
        lr_scheduler: a torch LRScheduler (what zerogpt.initialize returns).
    """

    priority = 20

    def __init__(self, lr_scheduler: Any):
        self.lr_scheduler = lr_scheduler

    def after_step(self, trainer) -> None:
        m = trainer.state.metrics
        if m.get("lr") is None:
            m["lr"] = self.lr_scheduler.get_last_lr()[0]
        if not m.get("skipped"):
            self.lr_scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return _json_safe(self.lr_scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scheduler.load_state_dict(state)
        # The scheduler sets the optimizer's rates only when it steps: put the resumed rates in place now,
        # whether or not the engine's checkpoint restored the param groups.
        for group, lr in zip(self.lr_scheduler.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr


def _json_safe(obj: Any) -> Any:
    """Keep numbers, strings, lists and dicts (a scheduler's state_dict may hold a config object)."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items() if _is_plain(v)}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _is_plain(v: Any) -> bool:
    if isinstance(v, (dict, list, tuple)):
        return all(_is_plain(x) for x in (v.values() if isinstance(v, dict) else v))
    return v is None or isinstance(v, (bool, int, float, str))
