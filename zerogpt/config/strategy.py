"""Shard strategies, the config's words for which parameters share a chunk (`zero.shard_strategy`).

A strategy is plain data: its name and, for buckets, a size. `chunk_groups` says what the words mean, as
arithmetic on parameter sizes; zero/chunk.py packs each group into one flat, padded buffer and
memory_model.py counts the same groups. Neither the config nor the memory model imports the engine for them.
A chunk never mixes optimizer param groups or dtypes (plan_chunks calls `chunk_groups` once per run of one
param group), so each chunk's master shard belongs to exactly one optimizer param group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["ShardStrategy", "TensorShardStrategy", "BucketTensorShardStrategy", "chunk_groups"]


class ShardStrategy:
    """What `zero.shard_strategy` accepts: one of the two strategies below (the Colossal-AI tutorial's names)."""


@dataclass(frozen=True)
class TensorShardStrategy(ShardStrategy):
    """One parameter per chunk: the most collectives, the finest-grained release at stage 3."""


@dataclass(frozen=True)
class BucketTensorShardStrategy(ShardStrategy):
    """Pack consecutive parameters into chunks of up to `bucket_mb` megabytes (the default).

    Few large collectives amortise launch latency; a parameter larger than the bucket gets a chunk
    of its own rather than being split, so a parameter always lives in exactly one chunk.
    """

    bucket_mb: float = 25.0
    """MiB of the compute dtype per chunk (2**20 bytes)."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"BucketTensorShardStrategy(bucket_mb=...) must be > 0, got {self.bucket_mb!r}")


def chunk_groups(strategy: ShardStrategy, numels: Sequence[int], element_size: int) -> list[list[int]]:
    """The parameters that share each chunk, as lists of indices into `numels`, in order.

    Args:
        strategy: TensorShardStrategy (one per chunk) or BucketTensorShardStrategy(bucket_mb).
        numels: elements of each parameter, in registration order (one optimizer param group).
        element_size: bytes per element of the compute dtype (buckets are in bytes).
    Example:
        >>> chunk_groups(BucketTensorShardStrategy(bucket_mb=8 / 2**20), [3, 3, 3, 9], element_size=1)
        [[0, 1], [2], [3]]
    """
    if isinstance(strategy, TensorShardStrategy):
        return [[i] for i in range(len(numels))]
    if not isinstance(strategy, BucketTensorShardStrategy):
        raise TypeError(f"zero.shard_strategy must be TensorShardStrategy() or "
                        f"BucketTensorShardStrategy(bucket_mb=...) (from zerogpt.zero import ...), got {strategy!r}")
    limit = int(strategy.bucket_mb * 1024 * 1024)
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, n in enumerate(numels):
        nbytes = n * element_size
        if current and current_bytes + nbytes > limit:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups
