"""Stage-3 parameter hooks: gather a module's chunks before it runs, release them after, prefetch ahead.

Module pre-forward hooks gather the chunks a module owns, post-
forward hooks release a chunk once every module owning it has run, and a tiny autograd function on
module outputs re-gathers before that module's backward. The order of gathers is recorded on the
first pass (forward and backward each) and the next `prefetch` gather units are gathered ahead,
asynchronously; a pass whose order differs replaces the recording. A unit is one chunk when every module
is hooked (eager), one hooked module's chunks when the blocks are hooked whole. The first `prefetch`
units of the recorded backward are kept (or prefetched) at the end of forward rather than released:
backward starts where forward ended, and re-gathering them there would be pure waste. Under
`compile = True` the transformer blocks are hooked as wholes instead (`gather_per_block`), so no hook runs
inside a compiled block.

Releasing a chunk must free its memory, but autograd saves weights for backward (a Linear saves
`weight.t()`, a view of the gathered buffer), and such a view would pin the whole buffer until backward:
stage 3 would then hold every parameter from forward to backward. So while the root module runs
forward, a saved-tensors hook stores a saved view of a parameter as (parameter, size, stride, offset)
and rebuilds it at backward from the parameter's re-gathered data (FSDP frees the storage in place
instead; DeepSpeed swaps in its own Linear). Autograd calls only the innermost saved-tensors hooks, so a user's
own around the forward (save_on_cpu) see nothing the model saves at stage 3: chaining to them needs the hook stack,
which only a private torch API reads (torch._C._autograd), and zerogpt keeps its private owners few
(tests/test_private_torch.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from zerogpt.zero.chunk import Chunk


def parts_with_chunks(module: nn.Module, blocks: list[nn.Module],
                      param_to_chunk: dict[int, tuple[int, int]]) -> list[tuple[nn.Module, list[int]]]:
    """The parts of `module` that hooks wait or gather for, in module order, each with the sorted chunk indices
    of its parameters: each of `blocks` whole (all of its parameters, no hook inside it), and every other module
    outside them that owns parameters directly (its own)."""
    whole = {id(b) for b in blocks}
    inside = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    parts = []
    for sub in module.modules():
        if id(sub) in inside:
            continue
        chunk_ids = sorted({param_to_chunk[id(p)][0] for p in sub.parameters(recurse=id(sub) in whole)
                            if id(p) in param_to_chunk})
        if chunk_ids:
            parts.append((sub, chunk_ids))
    return parts


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity whose backward gathers the module's chunks before the module's own backward runs."""

    @staticmethod
    def forward(ctx, hooks: "Stage3GatherHooks", module_id: int, tensor: torch.Tensor) -> torch.Tensor:
        ctx.hooks, ctx.module_id = hooks, module_id
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hooks.gather_for_backward(ctx.module_id)
        return None, None, grad


class Stage3GatherHooks:
    """The module hooks of stage 3; the engine sets `in_backward` around backward. `remove()` takes them off."""

    def __init__(self, module: nn.Module, chunks: list[Chunk], param_to_chunk: dict[int, tuple[int, int]],
                 *, prefetch: int) -> None:
        self.module = module
        self.chunks = chunks
        self.param_to_chunk = param_to_chunk  # id(param) -> (chunk index, slot index)
        self.prefetch = prefetch  # gather units ahead: chunks, or hooked modules once blocks are hooked whole
        self.in_backward = False
        self.handles: list[Any] = []
        self._saved_params_ctx: Any = None
        self._register(blocks=[])

    @property
    def recorded_order(self) -> list[int]:
        """The chunks of the recorded forward, in gather order (a chunk once per module that gathers it)."""
        return [c for unit in self.recorded_units for c in unit]

    @property
    def backward_order(self) -> list[int]:
        """The chunks of the recorded backward, in gather order."""
        return [c for unit in self.backward_units for c in unit]

    def gather_per_block(self, blocks: list[nn.Module]) -> None:
        """Gather and release each of `blocks` as a whole: one hook pair on the block for all of its parameters,
        none inside it (zerogpt/compile.py calls this before compiling the blocks' forwards).

        A compiled block then sees its parameters full-size and runs no hook inside (per-module hooks there
        would break its graph at every Linear and LayerNorm). Modules outside the blocks keep their own hooks.
        `prefetch` then counts hooked modules, not chunks: `prefetch = N` gathers, with each hooked module, the
        chunks of the next N hooked modules of the recorded order (blocks, or the embeddings, ln_f and the
        head), so the next block is whole before it runs; N chunks would cover a part of it. Eager runs keep
        per-module hooks and count chunks (their modules are single Linears and LayerNorms, many to a chunk:
        counting those would prefetch little new). A chunk is then gathered only while a module that owns it
        runs, where here a block holds all of its chunks through its forward and its backward, beside the next
        N modules' (tests/zero/test_stage3.py's GPT, one chunk per parameter, prefetch 2 counted in chunks: 15
        chunks gathered at once against 5). memory_model.buffer_bytes(gather_per_block=True) counts that.
        Call before the first forward: the recorded orders start again.
        """
        self.remove()
        self._register(blocks)

    def _register(self, blocks: list[nn.Module]) -> None:
        """The hooks: gather/release on each of `blocks` for all of its parameters and on every other module
        outside them that owns parameters directly, for those; then the root module's."""
        self.whole_blocks = bool(blocks)  # prefetch counts hooked modules, not chunks
        self.module_chunks: dict[int, list[int]] = {}
        uses: dict[int, int] = defaultdict(int)
        for sub, chunk_ids in parts_with_chunks(self.module, blocks, self.param_to_chunk):
            self.module_chunks[id(sub)] = chunk_ids
            for c in chunk_ids:
                uses[c] += 1
            self.handles.append(sub.register_forward_pre_hook(self._pre_forward))
            self.handles.append(sub.register_forward_hook(self._post_forward))
        self.uses_per_pass = dict(uses)
        self.remaining_uses = dict(uses)
        # the gather orders, as units (tuples of chunk ids): recorded on the last pass, and this pass's so far
        self.recorded_units: list[tuple[int, ...]] = []
        self.current_units: list[tuple[int, ...]] = []
        self.backward_units: list[tuple[int, ...]] = []
        self.current_backward_units: list[tuple[int, ...]] = []
        root = self.module
        self.handles.append(root.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self.handles.append(root.register_forward_hook(self._root_post_forward))
        self.handles.append(root.register_forward_hook(self._exit_saved_params, always_call=True))

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.in_backward:
            return
        self.remaining_uses = dict(self.uses_per_pass)
        self.current_units = []
        if torch.is_grad_enabled() and self._saved_params_ctx is None:
            self._saved_params_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_saved,
                                                                              self._unpack_saved)
            self._saved_params_ctx.__enter__()

    def _exit_saved_params(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: runs even when forward raised, so the hooks never outlive the forward
        if self._saved_params_ctx is not None:
            self._saved_params_ctx.__exit__(None, None, None)
            self._saved_params_ctx = None

    def _pack_saved(self, tensor: torch.Tensor) -> Any:
        """A parameter (or a view of one) is saved by where it lies, not by the gathered buffer.

        Not a tensor-parallel (DTensor) parameter: autograd saves it as a DTensor, whose global size and
        strides cannot be re-strided onto the local shard, so it is kept as saved (its local tensor is
        a view of the gathered buffer, which then stays alive until backward: correct, but that
        chunk's memory is not freed between forward and backward).
        """
        param = tensor._base if tensor._base is not None else tensor
        if id(param) not in self.param_to_chunk or isinstance(param, DTensor):
            return tensor
        return param, tensor.size(), tensor.stride(), tensor.storage_offset() - param.storage_offset()

    def _unpack_saved(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        param, size, stride, offset = saved
        self.chunks[self.param_to_chunk[id(param)][0]].gather()  # a no-op when backward gathered it already
        data = param.detach()
        return data.as_strided(size, stride, data.storage_offset() + offset)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.in_backward:
            return
        if self.current_units != self.recorded_units:
            self.recorded_units = self.current_units
        # Backward starts with the chunks forward used last (GPT-2's tied LM head is the embedding's
        # chunk): keep those the recorded backward starts with and prefetch the rest of its first
        # `prefetch` units, behind the loss computation, instead of releasing and re-gathering them.
        ahead = self._backward_ahead()
        for index, chunk in enumerate(self.chunks):
            if index not in ahead:
                chunk.release()
        for index in ahead:
            self.chunks[index].gather(async_op=True)

    def _backward_ahead(self) -> list[int]:
        """The chunks of the units the recorded backward starts with (none when no backward can follow)."""
        if not torch.is_grad_enabled():
            return []
        return [c for unit in self.backward_units[: self.prefetch] for c in unit]

    def _gather(self, chunk_ids: list[int], order: list[tuple[int, ...]], current: list[tuple[int, ...]]) -> None:
        for c in chunk_ids:
            self.chunks[c].gather()
        # one unit per module when blocks are hooked whole, one per chunk otherwise (prefetch counts chunks)
        current.extend([tuple(chunk_ids)] if self.whole_blocks else [(c,) for c in chunk_ids])
        # prefetch: the units that followed this position when the order was recorded
        pos = len(current)
        if order[: pos] == current and self.prefetch > 0:
            for unit in order[pos : pos + self.prefetch]:
                for c in unit:
                    self.chunks[c].gather(async_op=True)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        chunk_ids = self.module_chunks[id(module)]
        if self.in_backward:  # activation-checkpoint recompute
            for c in chunk_ids:
                self.chunks[c].gather()
            return
        self._gather(chunk_ids, self.recorded_units, self.current_units)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        module_id = id(module)
        if not self.in_backward:
            ahead = self._backward_ahead()
            for c in self.module_chunks[module_id]:
                self.remaining_uses[c] -= 1
                if self.remaining_uses[c] <= 0 and c not in ahead:
                    self.chunks[c].release()
        if not torch.is_grad_enabled():
            return output

        def wrap(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                return _GatherBeforeBackward.apply(self, module_id, t)
            return t

        return tree_map_only(torch.Tensor, wrap, output)

    def gather_for_backward(self, module_id: int) -> None:
        # Record a chunk on its first use in this backward even when forward left it gathered, so the
        # recorded order does not depend on what was kept; re-record only chunks released since.
        chunk_ids = self.module_chunks[module_id]
        recorded = {c for unit in self.current_backward_units for c in unit}
        new = [c for c in chunk_ids if c not in recorded or not self.chunks[c].is_gathered]
        if new:
            self._gather(new, self.backward_units, self.current_backward_units)

    def end_backward(self) -> None:
        """Keep this backward's gather order for the next one's prefetch."""
        self.in_backward = False
        if self.current_backward_units != self.backward_units:
            self.backward_units = self.current_backward_units
        self.current_backward_units = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
