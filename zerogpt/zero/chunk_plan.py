"""The chunk layout: parameters packed, in order, into flat buffers padded to equal shards (`plan_chunks`).

Pure arithmetic on sizes, tested without a process group (tests/zero/test_chunk_plan.py): the plan half of a chunk,
apart from the runtime that moves its bytes (zero/chunk.py's `Chunk`). The engine plan (planner/engine_plan.py)
makes the layout once at build; the checkpoint's shard maps (shard_map.py) read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from zerogpt.config.strategy import ShardStrategy, chunk_groups

__all__ = ["ParamSlot", "ChunkPlan", "plan_chunks"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its chunk's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk: its slots, padded size and per-rank shard size.

    The buffer is padded to a multiple of `num_shards` so every rank owns an equal, contiguous shard;
    equal shards are what the flat all-gather and reduce-scatter (zero/comm.py) require.
    """

    index: int
    slots: tuple[ParamSlot, ...]
    group_index: int  # optimizer param group; -1 for frozen parameters (no grads, no optimizer state)
    num_shards: int

    @property
    def numel(self) -> int:
        return self.slots[-1].end

    @property
    def padded_numel(self) -> int:
        return math.ceil(self.numel / self.num_shards) * self.num_shards

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    @property
    def trainable(self) -> bool:
        return self.group_index >= 0

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.shard_numel
        return start, start + self.shard_numel

    def slot_overlap(self, slot: ParamSlot, shard: int) -> tuple[int, int] | None:
        """The part of `slot` inside `shard`, as (start, end) offsets in the chunk buffer."""
        lo, hi = self.shard_range(shard)
        start, end = max(lo, slot.offset), min(hi, slot.end)
        return (start, end) if start < end else None

    def shard_pieces(self, shard: int) -> list[tuple[str, int, int, int]]:
        """What `shard` holds, parameter by parameter: (name, start, end, offset in the shard), with [start, end)
        an element range of the flattened parameter. The rest of the shard is padding."""
        lo, _ = self.shard_range(shard)
        pieces = []
        for slot in self.slots:
            overlap = self.slot_overlap(slot, shard)
            if overlap is not None:
                pieces.append((slot.name, overlap[0] - slot.offset, overlap[1] - slot.offset, overlap[0] - lo))
        return pieces


def plan_chunks(
    params: Sequence[tuple[str, tuple[int, ...], int]],
    strategy: ShardStrategy,
    num_shards: int,
    element_size: int,
) -> list[ChunkPlan]:
    """Pack parameters, in order, into chunks that never mix optimizer param groups.

    Args:
        params: (name, shape, group_index) in registration order; group_index -1 = frozen.
        strategy: decides which consecutive parameters share a chunk.
        num_shards: ranks that share each chunk (1 at stage 0, the world size otherwise).
        element_size: bytes per element of the compute dtype (bucket sizes are in bytes).
    Returns:
        Chunk plans in execution order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    plans: list[ChunkPlan] = []
    run: list[int] = []

    def flush() -> None:
        numels = [math.prod(params[i][1]) for i in run]
        for group in chunk_groups(strategy, numels, element_size):
            slots, offset = [], 0
            for j in group:
                name, shape, _ = params[run[j]]
                slots.append(ParamSlot(name, tuple(shape), offset))
                offset += math.prod(shape)
            plans.append(ChunkPlan(len(plans), tuple(slots), params[run[0]][2], num_shards))
        run.clear()

    for i, (_, _, group_index) in enumerate(params):
        if run and params[run[-1]][2] != group_index:
            flush()
        run.append(i)
    if run:
        flush()
    return plans
