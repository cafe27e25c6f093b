"""Shard strategies: how parameters are grouped into chunks.

A strategy is a pure plan: it takes parameter sizes and returns groups of indices. It moves no
bytes; `zero/chunk.py` packs each group into one flat, padded buffer. A chunk never mixes optimizer
param groups or dtypes, so each chunk's master shard belongs to exactly one optimizer param group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class ShardStrategy:
    """Base: subclasses define `group(numels, element_size)`."""

    def group(self, numels: Sequence[int], element_size: int) -> list[list[int]]:
        raise NotImplementedError

    def __repr__(self) -> str:  # shows up in resolved config.py files
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)


class TensorShardStrategy(ShardStrategy):
    """One parameter per chunk: the most collectives, the finest-grained release at stage 3."""

    def group(self, numels: Sequence[int], element_size: int) -> list[list[int]]:
        return [[i] for i in range(len(numels))]


@dataclass(eq=False, repr=False)
class BucketTensorShardStrategy(ShardStrategy):
    """Pack consecutive parameters into chunks of up to `bucket_mb` megabytes (the default).

    Few large collectives amortise launch latency; a parameter larger than the bucket gets a chunk
    of its own rather than being split, so a parameter always lives in exactly one chunk.
    """

    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"BucketTensorShardStrategy(bucket_mb=...) must be > 0, got {self.bucket_mb!r}")

    def group(self, numels: Sequence[int], element_size: int) -> list[list[int]]:
        limit = int(self.bucket_mb * 1024 * 1024)
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
