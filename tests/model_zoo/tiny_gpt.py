"""The baby GPT and token batches the model_zoo tests share: a seeded gpt2_tiny with vocab 100 and 32 positions."""
from __future__ import annotations

import torch

from model_zoo.gpt import GPT, gpt2_tiny


def tiny(**kw) -> GPT:
    """gpt2_tiny(vocab_size=100, max_position_embeddings=32, **kw) built after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=100, max_position_embeddings=32, **kw)


def ids(batch=2, seq=16, vocab=100, seed=1) -> torch.Tensor:
    """(batch, seq) int64 token ids < vocab from their own generator (the global RNG is left alone)."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
