"""LossHook: kept so that Colossal-AI-style hook lists run as written; the loop owns the loss now.

Trainer.fit averages the step's loss over ranks on every log step (`state.metrics.loss`), so this hook
has nothing left to do.
"""
from __future__ import annotations

from zerogpt.trainer.hooks.base import Hook


class LossHook(Hook):
    """No-op: the loss averaged over ranks is `trainer.state.metrics.loss` on log steps."""
