"""Gradient hooks (every stage): each parameter's gradient into its chunk, and each chunk's reduction launched.

A post-accumulate-grad hook copies each parameter's gradient into its chunk's `grad_full` and frees
`param.grad`. When the chunk's gradients are complete on a step that reduces, its reduction is launched
asynchronously so communication overlaps the rest of backward, and the reduced shard is handed over to the
optimizer side (the engine's `hand_over`). Chunks are reduced in strictly descending index order on every
rank (a chunk waits for the ones after it), so ranks always issue collectives in the same order even if a
parameter got no gradient. At stage 3 a chunk whose gradients are all in is released at once: no later
backward op reads its parameters.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from zerogpt.zero.chunk import Chunk, grad_as_param


class GradReduceHooks:
    """The gradient hooks on a model's parameters; `remove()` takes them off."""

    def __init__(self, module: nn.Module, chunks: list[Chunk], param_to_chunk: dict[int, tuple[int, int]],
                 *, stage: int) -> None:
        self.chunks = chunks
        self.param_to_chunk = param_to_chunk  # id(param) -> (chunk index, slot index)
        self.stage = stage
        self.reduce_this_step = True
        self._next_to_reduce = len(chunks) - 1  # reductions go in descending chunk order
        self._launched: list[Chunk] = []
        self._hand_over: Callable[[Chunk], None] | None = None
        self._hand_over_at_launch = False
        self.handles: list[Any] = []
        seen: set[int] = set()
        for param in module.parameters():
            if id(param) in seen or not param.requires_grad or id(param) not in param_to_chunk:
                continue
            seen.add(id(param))
            self.handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, param: nn.Parameter) -> None:
        chunk_index, slot_index = self.param_to_chunk[id(param)]
        chunk = self.chunks[chunk_index]
        if self.reduce_this_step and chunk_index > self._next_to_reduce:
            raise RuntimeError(
                f"parameter {chunk.plan.slots[slot_index].name!r} got a second gradient in one backward, after "
                f"its chunk {chunk_index} was already reduced; this happens when a parameter is used in several "
                f"reentrant activation-checkpoint segments: checkpoint with use_reentrant=False")
        chunk.add_param_grad(slot_index, grad_as_param(param))
        param.grad = None
        if self.stage == 3 and chunk.grads_complete:
            chunk.release()  # no later backward op reads these params: their grads are final
        if self.reduce_this_step:
            self._launch_ready_reductions()

    def begin_backward(self, reduce: bool, hand_over: Callable[[Chunk], None], at_launch: bool = False) -> None:
        """Start a backward pass. `hand_over(chunk)` finishes a chunk's launched reduction and hands the
        result to the optimizer side: right after the launch when `at_launch` (stream-ordered waits on CUDA:
        the host does not block), else for every chunk at the end of backward (gloo's waits block the host)."""
        self.reduce_this_step = reduce
        self._hand_over, self._hand_over_at_launch = hand_over, at_launch
        self._next_to_reduce = len(self.chunks) - 1
        for chunk in self.chunks:
            chunk.slots_ready.clear()

    def _launch_ready_reductions(self, force: bool = False) -> None:
        while self._next_to_reduce >= 0:
            chunk = self.chunks[self._next_to_reduce]
            if chunk.plan.trainable:
                if not (force or chunk.grads_complete):
                    return
                chunk.launch_reduce()
                if self._hand_over_at_launch:
                    self._hand_over(chunk)
                else:
                    self._launched.append(chunk)
            self._next_to_reduce -= 1

    def end_backward(self) -> None:
        """Reduce what is left (chunks with unused params included), hand shards over, release."""
        if self.reduce_this_step:
            self._launch_ready_reductions(force=True)
            for chunk in self._launched:
                self._hand_over(chunk)
            self._launched.clear()
        if self.stage == 3:
            for chunk in self.chunks:
                chunk.release()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
