"""The tiny GPT-2 recipe the ZeRO tests share: model, data, loss, zero config, and the parity settings."""
from __future__ import annotations

import itertools

import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.zero.reference import Recipe

MICRO_BATCH = 2
SEQ = 16
VOCAB = 128
CLIP = 0.05  # well below the tiny model's grad norms (~0.5-2), so clipping changes every step


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)


def token_batches(steps: int, world: int, accum: int) -> torch.Tensor:
    """(steps, accum, world, B, T+1) token ids: one global batch per step, the same for every run."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, world, MICRO_BATCH, SEQ + 1), generator=g)


def lm_loss(model, batch: torch.Tensor, step: int) -> torch.Tensor:
    return GPTLMLoss(shift=False)(model(batch[:, :-1]), batch[:, 1:])


GPT_RECIPE = Recipe(build=tiny_gpt, data=token_batches, loss=lm_loss)

# stage x precision x accumulation, plus clipping (fp32; without and with accumulation) at every stage
SETTINGS = [(stage, precision, accum, None) for stage, precision, accum in
            itertools.product([0, 1, 2, 3], ["fp32", "bf16"], [1, 3])]
SETTINGS += [(stage, "fp32", accum, CLIP) for stage in [0, 1, 2, 3] for accum in [1, 3]]


def zero_config(stage: int) -> dict:
    from zerogpt.zero import BucketTensorShardStrategy

    # 0.02 MB buckets: several multi-parameter chunks, most not divisible by 2 or 3 ranks (padding)
    return dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02))
