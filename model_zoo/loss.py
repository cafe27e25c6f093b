"""The language-model loss: next-token cross-entropy in fp32, for our GPT's logits or any output with `.logits`.

GPT.forward(labels=...) uses it with shift=False; training scripts use it directly. Knows nothing of the model.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTLMLoss"]


class GPTLMLoss(nn.Module):
    """Next-token cross-entropy, mean over targets != ignore_index, computed in fp32.

    shift=True (default, the Colossal-AI tutorial form): `loss(logits, input_ids)` predicts input_ids[t+1]
    from position t. shift=False: `loss(logits, labels)` with labels already aligned (labels[t] = next token
    of input_ids[t]), as zerogpt's datasets yield them. `logits` may also be any output object with `.logits`
    (GPTOutput, Hugging Face CausalLMOutput).

    Example:
        >>> logits, ids = torch.randn(2, 8, 100), torch.randint(0, 100, (2, 8))
        >>> GPTLMLoss()(logits, ids).shape
        torch.Size([])
    """

    def __init__(self, ignore_index: int = -100, shift: bool = True):
        super().__init__()
        self.ignore_index, self.shift = ignore_index, shift

    def forward(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """logits (B, T, V) or an object with `.logits`; labels (B, T) int64. Returns a scalar fp32 tensor."""
        logits = getattr(logits, "logits", logits)
        if self.shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                               ignore_index=self.ignore_index)
