"""Modules both decoder families share: causal SDPA attention, the LM head with its chunked loss, the real-vocab slice.

Each is a module of its own so that a parallel plan can find and replace it from outside (zerogpt.parallel): the
attention's dropout draws from a tensor-parallel rank's own stream, and the vocab slice becomes a mask when the
logits are sharded on the vocabulary. Knows nothing of GPT-2 or Llama.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.loss import chunked_cross_entropy

__all__ = ["CausalAttention", "RealVocab", "LMHead"]


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with dropout on the probabilities (SDPA), per head.

    With fewer k/v heads than q heads (grouped-query attention) each k/v head serves n_q / n_kv consecutive q
    heads, as in Llama 2/3 and Hugging Face's repeat_kv. A module of its own, without parameters, so a parallel
    plan can tell its dropout where to draw from: a tensor-parallel rank computes only its own heads and gives them
    their own random stream (zerogpt.parallel.rng), while every other dropout must draw alike on every rank.
    """

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs), k and v (B, n_kv, T_past + T, hs): the last T positions attend to all before them."""
        T, T_past = q.size(2), k.size(2) - q.size(2)
        dropout_p = self.dropout if self.training else 0.0
        gqa = q.size(1) != k.size(1)
        if T_past == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
        if T == 1:  # one new token sees the whole cache
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
        # SDPA's is_causal aligns top-left; with a cache the mask must align bottom-right
        mask = torch.ones(T, T_past + T, dtype=torch.bool, device=q.device).tril(diagonal=T_past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class RealVocab(nn.Module):
    """The head's logits over the padded vocabulary, sliced to the real one: (B, T, vocab_size).

    A module of its own, with no parameters, so a parallel plan can replace it: when the logits are sharded
    on the vocabulary dim no rank holds whole rows to slice, and the plan masks the padded classes instead
    (zerogpt.parallel.tensor).
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.vocab_size]


class LMHead(nn.Linear):
    """The output projection; given labels, it returns the chunked loss instead of the logits.

    The loss is computed inside this module's forward because that is where its (maybe tied) weight may be read:
    ZeRO-3 gathers a module's parameters only around its forward (and again before its backward).
    """

    def __init__(self, width: int, padded_vocab_size: int, vocab_size: int, chunk_size: int, backend: str = "auto"):
        super().__init__(width, padded_vocab_size, bias=False)
        self.vocab_size, self.chunk_size, self.backend = vocab_size, chunk_size, backend

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> logits (B, T, padded vocab); with labels (B, T): the scalar fp32 mean loss."""
        if labels is None:
            return super().forward(x)
        return chunked_cross_entropy(x, self.weight, labels, vocab_size=self.vocab_size, chunk_size=self.chunk_size,
                                     backend=self.backend)
