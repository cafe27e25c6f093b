"""Where a flat shard's elements lie in the model's parameters: how an engine's state_dict describes its tensors.

A chunk packs several parameters into one flat buffer, and each rank holds an equal slice of it (its shard). Code
that saves or reads state by parameter (checkpoint.py) needs, for each shard tensor, which element ranges of which
parameters it holds: the role DCP's local-chunk metadata plays for a DTensor. The engine hands one ShardMap per
chunk with its state, so nothing outside zero/ walks chunk plans.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerogpt.zero.chunk_plan import ChunkPlan


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of the flattened (local) parameter `name`, at `at` in the shard."""

    name: str
    start: int
    end: int
    at: int

    @property
    def shard_slice(self) -> slice:
        return slice(self.at, self.at + self.end - self.start)


@dataclass(frozen=True)
class ShardMap:
    """One chunk's shard on this rank: what it holds, parameter by parameter. The rest of it is padding."""

    chunk: int
    """The chunk's index (a checkpoint names its files by it)."""
    params: tuple[str, ...]
    """Every parameter of the chunk, in model order, whether or not this shard holds elements of it."""
    pieces: tuple[Piece, ...]
    numel: int
    """The shard's length, padding included."""
    group: int
    """The optimizer param group stepping it; -1 for frozen parameters (no optimizer state)."""
    replicated: bool
    """Every data-parallel rank holds this same shard (stage 0): one of them need save it."""

    @property
    def trainable(self) -> bool:
        return self.group >= 0

    @classmethod
    def of(cls, plan: ChunkPlan, shard: int) -> "ShardMap":
        pieces = tuple(Piece(*piece) for piece in plan.shard_pieces(shard))
        return cls(plan.index, tuple(slot.name for slot in plan.slots), pieces, plan.shard_numel, plan.group_index,
                   plan.num_shards == 1)
