"""LossHook: the step's training loss averaged over ranks, into `state.metrics["loss"]`.

Each rank's `state.loss` is the mean over its own micro-batches; the logged number is the mean over all
ranks (one scalar all-reduce per step, small next to the step's own collectives).
"""
from __future__ import annotations

import torch

from zerogpt.trainer.hooks.base import Hook


class LossHook(Hook):
    """Puts the global mean loss of the last step in `trainer.state.metrics["loss"]`."""

    priority = 10

    def after_step(self, trainer) -> None:
        loss = torch.tensor([trainer.state.loss], dtype=torch.float64, device=trainer.device)
        trainer.all_reduce_sum(loss)
        trainer.state.metrics["loss"] = loss.item() / trainer.world_size
