"""Stages 0-2: the model's parts wait for their own chunks' overlapped optimizer step before they run.

At stages 0-2 every rank keeps the full parameters (`Chunk.full`) between steps, so nothing gathers them in
forward the way stage 3 does. When the host step runs behind the next forward (HostStep.launch, host_step.py),
a forward pre-hook finishes a part's chunks first: their step, the write-back of the new shard and the all-gather
that refreshes `full`, on this thread and in forward order, which is the same on every rank. The first blocks
then run while later chunks still step; `finish_step()` (backward, checkpoints) finishes the rest in chunk order.

The parts are the transformer blocks as wholes (the caller passes zerogpt/compile.py's find_blocks: no hook
inside a block, which may be compiled) and every module outside them that owns parameters directly. With no step pending a hook
costs a few attribute reads.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from zerogpt.zero.chunk import Chunk
from zerogpt.zero.gather_hooks import parts_with_chunks


class StepWaitHooks:
    """One forward pre-hook per block and per other module that owns parameters; `remove()` takes them off."""

    def __init__(self, module: nn.Module, chunks: list[Chunk], param_to_chunk: dict[int, tuple[int, int]],
                 blocks: list[nn.Module]) -> None:
        by_index = {c.plan.index: c for c in chunks}
        self.handles: list[Any] = []
        for sub, owned in parts_with_chunks(module, blocks, param_to_chunk):
            mine = [by_index[i] for i in owned]
            self.handles.append(sub.register_forward_pre_hook(lambda m, args, mine=mine: _wait(mine)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _wait(chunks: list[Chunk]) -> None:
    for chunk in chunks:
        chunk.wait_step()
