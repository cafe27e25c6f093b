"""The language-model loss: next-token cross-entropy in fp32, for our GPT's logits or any output with `.logits`.

GPT.forward(labels=...) uses it with shift=False; training scripts use it directly. Knows nothing of the model.
`chunked_cross_entropy` is the same loss from the hidden states and the head's weight, a chunk of tokens at a
time, so the fp32 logits of the whole batch never exist (GPTConfig.chunked_loss).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTLMLoss", "chunked_cross_entropy"]


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


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          vocab_size: int | None = None, chunk_size: int = 1024,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight[:vocab_size].T` against `labels`, `chunk_size` tokens at a time.

    The plain path holds (B*T, V) logits in the compute dtype, their fp32 copy and its softmax for backward:
    with GPT-2's 50k vocabulary and 8k tokens that is several GiB. Here each chunk's logits are computed under
    activation checkpointing, summed into the loss and dropped; backward recomputes one chunk at a time. The
    result is GPTLMLoss(shift=False)'s up to fp32 summation order (the sum is over chunks, then divided by
    the number of counted targets).

    The weight is sliced inside the checkpointed function, so the recompute reads the parameter as it is at
    backward (ZeRO-3 re-gathers it into a new buffer), not a view kept from forward.

    Args:
        hidden: (..., C) final hidden states in the compute dtype.
        weight: (V_padded, C) the head's weight (GPT-2: the tied embedding).
        labels: (...) int64 aligned targets; ignore_index is not counted.
        vocab_size: the real vocabulary (rows past it are padding, never a class); None = all rows.
    Example:
        >>> h, w, y = torch.randn(2, 8, 16), torch.randn(100, 16), torch.randint(0, 90, (2, 8))
        >>> chunked_cross_entropy(h, w, y, vocab_size=90, chunk_size=5).shape
        torch.Size([])
    """
    hidden, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    vocab_size = vocab_size or weight.size(0)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.size(0), chunk_size):
        part = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_loss_sum, hidden[part], weight, labels[part], vocab_size, ignore_index,
                                   use_reentrant=False)
    return total / (labels != ignore_index).sum()


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                    ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight[:vocab_size])  # (chunk, V) compute dtype, as the head gives them
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
