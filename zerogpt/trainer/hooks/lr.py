"""LRSchedulerHook: hands an LR schedule to the Trainer in the Colossal-AI form (the Trainer steps it).

`Trainer(engine, hooks=[LRSchedulerHook(lr_scheduler=s, by_epoch=False)])` is the same as
`Trainer(engine, lr_scheduler=s)`; the schedule is stepped inside `Trainer.fit` and saved in the
trainer's state_dict. The schedule itself comes from `zerogpt.optim.build_lr_scheduler`.
"""
from __future__ import annotations

from typing import Any

from zerogpt.trainer.hooks.base import Hook


class LRSchedulerHook(Hook):
    """Carries `lr_scheduler` to the Trainer.

    Args:
        lr_scheduler: a torch LRScheduler.
        by_epoch: step it once per epoch instead of once per optimizer step.
    """

    def __init__(self, lr_scheduler: Any, by_epoch: bool = False):
        self.lr_scheduler = lr_scheduler
        self.by_epoch = by_epoch

