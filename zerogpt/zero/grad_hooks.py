"""Gradient hooks (every stage): each parameter's gradient into its chunk, and each chunk's reduction launched.

A post-accumulate-grad hook copies each parameter's gradient into its chunk's `grad_full` and frees
`param.grad`. When the chunk's gradients are complete on a step that reduces, its reduction is launched
asynchronously so communication overlaps the rest of backward, and the reduced shard is handed over to the
optimizer side (the engine's `hand_over`). Chunks are reduced in strictly descending index order on every
rank (a chunk waits for the ones after it), so ranks always issue collectives in the same order even if a
parameter got no gradient. At stage 3 a chunk whose gradients are all in is released at once: no later
backward op reads its parameters.

A tied embedding (GPT-2's wte, also the LM head's weight) would have autograd build its gradient three times
over: the head's (vocab x dim), the embedding's (a dense vocab x dim tensor, zero but for the rows the batch
used) and their sum in a third buffer, all at once at the end of backward. Its embedding gradient is taken
instead as rows (the batch's ids and the output gradient) before autograd densifies it, and added into the
chunk's gradient buffer row by row once the head's gradient has landed there: one vocab x dim buffer, the
one the head's gradient already is.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
        # id(weight) -> this backward's embedding gradients as (ids, output gradient), waiting for the weight's own
        self._pending_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for sub in _tied_embeddings(module, param_to_chunk):
            # prepend: see the embedding's own output, before stage 3 wraps it (gather_hooks.py)
            self.handles.append(sub.register_forward_hook(self._take_rows_in_backward, prepend=True))

    def _take_rows_in_backward(self, module: nn.Embedding, args: Any, output: Any) -> None:
        """Hook the embedding's backward node so its weight gradient comes as rows (see the module docstring)."""
        node = output.grad_fn if isinstance(output, torch.Tensor) and torch.is_grad_enabled() else None
        if node is None or type(node).__name__ != "EmbeddingBackward0":
            return
        weight, ids = module.weight, args[0]
        node.register_prehook(lambda grads: self._rows_arrived(weight, ids, grads[0]))

    def _rows_arrived(self, weight: nn.Parameter, ids: torch.Tensor, grad: torch.Tensor | None) -> Any:
        """Node pre-hook: keep (ids, grad) and hand the node no gradient, so it builds no dense one (an undefined
        gradient reaches the weight as none). The rows go into the chunk with the weight's own gradient, or at
        once if that arrived already in this backward."""
        if grad is None:
            return None
        chunk_index, slot_index = self.param_to_chunk[id(weight)]
        if slot_index in self.chunks[chunk_index].slots_ready:
            self._add_rows(chunk_index, slot_index, [(ids, grad)])
        else:
            self._pending_rows.setdefault(id(weight), []).append((ids, grad))
        return (None,)

    def _add_rows(self, chunk_index: int, slot_index: int, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        chunk = self.chunks[chunk_index]
        self._check_not_reduced(chunk, slot_index)
        for ids, grad in rows:
            chunk.add_param_rows(slot_index, ids, grad)

    def _check_not_reduced(self, chunk: Chunk, slot_index: int) -> None:
        if self.reduce_this_step and chunk.plan.index > self._next_to_reduce:
            raise RuntimeError(
                f"parameter {chunk.plan.slots[slot_index].name!r} got a second gradient in one backward, after "
                f"its chunk {chunk.plan.index} was already reduced; this happens when a parameter is used in several "
                f"reentrant activation-checkpoint segments: checkpoint with use_reentrant=False")

    def _grad_ready(self, param: nn.Parameter) -> None:
        chunk_index, slot_index = self.param_to_chunk[id(param)]
        chunk = self.chunks[chunk_index]
        self._check_not_reduced(chunk, slot_index)
        if param.grad is not None:  # None: a tied embedding reached only through its rows (they follow)
            chunk.add_param_grad(slot_index, grad_as_param(param))
            param.grad = None
        self._add_rows(chunk_index, slot_index, self._pending_rows.pop(id(param), []))
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
        self._pending_rows.clear()
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
        for weight_id, rows in self._pending_rows.items():  # a weight whose only gradient this backward was rows
            self._add_rows(*self.param_to_chunk[weight_id], rows)
        self._pending_rows.clear()
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


def _tied_embeddings(module: nn.Module, param_to_chunk: dict[int, tuple[int, int]]) -> list[nn.Embedding]:
    """The plain embeddings whose weight another module also holds (a tied LM head), the weight in a chunk.

    Plain: no padding_idx, max_norm, scale_grad_by_freq or sparse (each changes its backward), and not a
    tensor-parallel (DTensor) weight.
    """
    holders = Counter(id(p) for sub in module.modules() for p in sub.parameters(recurse=False))
    return [sub for sub in module.modules()
            if type(sub) is nn.Embedding and holders[id(sub.weight)] > 1 and id(sub.weight) in param_to_chunk
            and sub.weight.requires_grad and not isinstance(sub.weight, DTensor) and sub.padding_idx is None
            and sub.max_norm is None and not sub.scale_grad_by_freq and not sub.sparse]
