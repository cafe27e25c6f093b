"""NaNGuardHook: stop a run whose loss stays non-finite instead of training on garbage.

It looks at the loss of log steps only (the loop reads no number on other steps), so it stops after
`max_bad_steps` consecutive logged non-finite losses. fp16 steps that the loss scaler skipped
(metrics.skipped) are the scaler doing its job: they neither count towards the limit nor reset it.
"""
from __future__ import annotations

import math

from zerogpt.trainer.hooks.base import Hook


class NonFiniteLossError(FloatingPointError):
    """NaNGuardHook's stop: a diagnosis with its advice, which train_gpt.py prints as one line (no traceback)."""


class NaNGuardHook(Hook):
    """Raises NonFiniteLossError (a FloatingPointError) after `max_bad_steps` consecutive non-finite logged losses,
    naming the steps.

    List it after the loggers (so the bad step is in metrics.jsonl) and before SaveCheckpointHook (so no
    checkpoint is written from the step that trips it).
    """

    def __init__(self, max_bad_steps: int = 3):
        if max_bad_steps < 1:
            raise ValueError(f"NaNGuardHook(max_bad_steps={max_bad_steps}): must be >= 1")
        self.max_bad_steps = max_bad_steps
        self._bad: list[int] = []

    def after_step(self, trainer) -> None:
        s = trainer.state
        # an fp16-skipped step counts too: a lower loss scale rescues a gradient, never a forward loss, and the
        # weights a skip leaves unchanged give that loss again (an fp16 run would skip to its end, scale halving)
        if not s.metrics.logged:
            return
        loss = s.metrics.loss
        if math.isfinite(loss):
            self._bad = []
            return
        self._bad.append(s.step)
        if len(self._bad) >= self.max_bad_steps:
            raise NonFiniteLossError(f"loss is {loss} at step {s.step}, non-finite for {len(self._bad)} consecutive "
                                     f"logged steps (steps {self._bad[0]}..{s.step}). {advice(trainer.engine)}")


def advice(engine) -> str:
    """What to change, leaving out what the run already does (clipping; bf16 is offered to fp16 runs only)."""
    fixes = ["Lower optimizer.lr", "add warmup (lr_scheduler.warmup_steps)"]
    if not engine.config.clip_grad_norm:
        fixes.append("set clip_grad_norm=1.0")
    if engine.config.precision == "fp16":
        fixes.append("use precision='bf16'")
    return (f"{', '.join(fixes[:-1])} or {fixes[-1]}; then "
            "restart from the last good checkpoint with --resume auto. Steps whose gradient was not finite were "
            "skipped (skipped_steps in metrics.jsonl): no checkpoint holds a non-finite update.")
