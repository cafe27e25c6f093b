"""Chunks: parameters packed into flat padded buffers, the unit of communication, placement and step.

The layout is a `ChunkPlan` (zero/chunk_plan.py: pure arithmetic on sizes, made by the engine plan). `Chunk`
owns the buffers of one chunk on one rank and moves bytes: all-gather of param shards, reduce(-scatter) of
gradients. It knows nothing about modules or optimizers; `grad_hooks.py`, `gather_hooks.py` and the engine drive it.

Tensor parallelism: a parameter may be a DTensor (zerogpt.parallel.tensor), whose global shape spans the
tensor-parallel ranks. A chunk holds what this rank computes with, the DTensor's local shard: the planner,
the packing, the gradient hooks and the binding all go through `to_local()`, and `bind_param()` points
the DTensor's local tensor at the slot. ZeRO then shards those local tensors over the data-parallel group.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from zerogpt.zero.chunk_plan import ChunkPlan
from zerogpt.zero.comm import Pending, all_gather_flat, all_reduce_flat, reduce_scatter_flat
from zerogpt.zero.offload import Traffic
from zerogpt.zero.shm import SharedMemoryTransport



def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local tensor (`DTensor.to_local()` outside autograd; for a
    DTensor Parameter torch returns a view of it, same values and storage), any other tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def grad_as_param(param: torch.Tensor) -> torch.Tensor:
    """`param.grad` placed as `param` is, so its local tensor lines up with the parameter's local tensor.

    DTensor does not promise a gradient the parameter's placement: a vocab-parallel embedding's own gradient
    comes back Replicate (each rank computes all rows) while the weight is Shard(0). When wte is tied to the
    head the two gradients are summed into Shard(0), but a first pipeline stage has no head. Under sequence
    parallelism a LayerNorm's gradient is a Partial sum over the sequence shards. Replicate -> Shard is a
    local slice; Partial -> Replicate an all-reduce over the tensor-parallel ranks.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def bind_param(param: torch.Tensor, data: torch.Tensor) -> None:
    """Make `data` the values `param` computes with (its local shard for a DTensor).

    `param.data = ...` cannot do it for a DTensor: `.data` swaps the wrapper's (storage-less) TensorImpl,
    while the values a DTensor computes with are the plain tensor in its `_local_tensor` slot. The DTensor's
    spec (global shape, placements) stays; only the local values move into the chunk. Assigning that slot is a
    private torch API (zerogpt/private_torch.py): `DTensor.from_local` would build a new Parameter, and the
    optimizer, tied modules and hooks hold this one.
    """
    if isinstance(param, DTensor):
        param._local_tensor = data
        _match_wrapper_offset(param, data)
    else:
        param.data = data


def _match_wrapper_offset(param: DTensor, local: torch.Tensor) -> None:
    """Give the DTensor wrapper its local tensor's storage offset, as `DTensor.from_local` does.

    torch.compile fakeifies a DTensor by rebuilding it from its local tensor, then checks that the rebuilt
    wrapper's offset is the original's; a wrapper left at offset 0 over a slot at offset k fails that check
    ("Attempted to set the storage ... on different device meta"). The wrapper's storage holds no data, so a
    fresh wrapper over `local` (a data-less storage of the slot's size, at its offset) lends its TensorImpl's
    storage, offset, sizes and strides through `.data =`, which DTensor's dispatch never sees; the Parameter
    object, its `_local_tensor`, autograd state and version stay. Nothing aliases the chunk.
    """
    if param.storage_offset() == local.storage_offset():
        return
    param.data = torch.Tensor._dtensor__new__(DTensor, local, param._spec, requires_grad=False)


def _empty_like_param(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


class Chunk:
    """The buffers of one chunk on one rank.

    `full` (compute dtype, on the device) holds every parameter of the chunk while it is gathered;
    at stages 0-2 it is always gathered, at stage 3 only between `gather()` and `release()`.
    `shard` is this rank's slice of the parameters: a view of `full` at stages 0-2, its own storage
    (on the device or, with param offload, in host memory) at stage 3, where one shard on the compute's
    device is also `full` while gathered.
    `grad_full` accumulates the local gradient; `reduce()` turns it into this rank's shard.
    `transport`, when given, is `group`'s shared-memory transport (zero/shm.py): every collective of the chunk
    goes through it where it would run on gloo. The engine owns it and closes it.
    """

    def __init__(
        self,
        plan: ChunkPlan,
        params: Sequence[torch.nn.Parameter],
        *,
        dtype: torch.dtype,
        device: torch.device,
        rank: int,
        group: dist.ProcessGroup | None,
        persistent_full: bool,
        shard_device: torch.device,
        pin_memory: bool,
        shard_home: str = "device",
        transport: SharedMemoryTransport | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        assert len(params) == len(plan.slots), (len(params), len(plan.slots))
        self.plan = plan
        self.params = list(params)
        self.dtype = dtype
        self.device = device
        self.rank = rank
        self.shard_index = rank if plan.num_shards > 1 else 0
        self.group = group
        self.transport = transport
        self.traffic = traffic  # counts the host->device copy of a host shard at each gather
        self.persistent_full = persistent_full
        self.shard_home = "device" if persistent_full else shard_home  # for the memory accounting
        self.full: torch.Tensor | None = None
        # Set while an overlapped optimizer step (ShardedOptimizer) may still be writing this chunk's shard:
        # calling it waits for that and finishes the write-back (stages 0-2: and the all-gather into `full`).
        # gather() (stage 3) and the modules' pre-forward hooks (stages 0-2, StepWaitHooks) call it first.
        self.pending_step: Callable[[], None] | None = None
        self.grad_full: torch.Tensor | None = None
        self._written: set[int] = set()  # slots of grad_full holding a gradient (the rest is garbage)
        self.slots_ready: set[int] = set()  # slots whose gradient arrived in this backward
        lo, hi = plan.shard_range(self.shard_index)
        if persistent_full:
            self.full = torch.zeros(plan.padded_numel, dtype=dtype, device=device)
            self.shard = self.full[lo:hi]
        else:
            self.shard = torch.zeros(plan.shard_numel, dtype=dtype, device=shard_device)
            if pin_memory and shard_device.type == "cpu":  # the plan pins only a GPU run's host shards
                self.shard = self.shard.pin_memory()
        self._gather_work: Pending | None = None
        self._gather_buffer: torch.Tensor | None = None
        self._reduce_work: Pending | dist.Work | None = None
        self._reduce_out: torch.Tensor | None = None

    # -- loading values ---------------------------------------------------------------------

    def load_full(self, flat: torch.Tensor) -> None:
        """Set the chunk's parameters from a flat full-chunk tensor (numel or padded_numel long)."""
        lo, hi = self.plan.shard_range(self.shard_index)
        padded = torch.zeros(self.plan.padded_numel, dtype=self.dtype, device=flat.device)
        padded[: flat.numel()].copy_(flat.view(-1)[: self.plan.padded_numel])
        if self.full is not None:
            self.full.copy_(padded)
        else:
            self.shard.copy_(padded[lo:hi])

    # -- parameters -------------------------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        return self.full is not None and self._gather_work is None

    @property
    def full_buffer(self) -> torch.Tensor | None:
        """The full-chunk buffer if one is allocated: gathered, or the target of an in-flight all-gather
        (a prefetch holds its memory before `full` is set, so accounting must count it)."""
        return self.full if self.full is not None else self._gather_buffer

    def bind_params(self) -> None:
        """Point every parameter's (local) values at its slot in `full` (or at an empty tensor)."""
        for param, slot in zip(self.params, self.plan.slots):
            if self.full is None:
                local = to_local(param)
                bind_param(param, _empty_like_param(local if local.numel() else self.shard))
            else:
                bind_param(param, self.full[slot.offset : slot.end].view(slot.shape))

    def wait_step(self) -> None:
        """Finish this chunk's optimizer step if it runs behind the forward (`pending_step`); else nothing."""
        if self.pending_step is not None:
            self.pending_step()

    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into `full` (stage 3). No-op when already gathered or in flight."""
        self.wait_step()
        if self.full is not None or self._gather_work is not None:
            if not async_op:
                self.wait_gather()
            return
        shard = self.shard.to(self.device, non_blocking=True) if self.shard.device != self.device else self.shard
        if self.traffic is not None:
            self.traffic.copied(self.shard_home, "device", self.shard)
        if self.plan.num_shards == 1:
            # One shard is the whole chunk: it is `full` itself, its copy on the device when it rests on the host, and
            # otherwise (CPU compute, a device-resident shard) the shard: gathering copies nothing, so a CPU run at
            # one rank holds no second copy of a chunk while it computes (the tied embedding's, through the pass)
            self.full = shard
            self._gather_buffer, self._gather_work = self.full, None
            self.bind_params()
            return
        buffer = torch.empty(self.plan.padded_numel, dtype=self.dtype, device=self.device)
        work = all_gather_flat(buffer, shard, group=self.group, async_op=True, transport=self.transport)
        self._gather_buffer, self._gather_work, self._gather_input = buffer, work, shard
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
            self._gather_input = None
            self.full = self._gather_buffer
            self.bind_params()

    def release(self) -> None:
        """Drop the gathered parameters (stage 3); the shard keeps this rank's values."""
        if self.persistent_full:
            return
        self.wait_gather()
        self.full = None
        self._gather_buffer = None
        self.bind_params()

    def all_gather_full(self, async_op: bool = False) -> Pending | None:
        """Refresh `full` from every rank's shard after an optimizer step (stages 0-2).

        With `async_op`, returns a handle to wait on (None when there is nothing to gather).
        """
        if self.plan.num_shards == 1 or self.full is None:
            return None
        return all_gather_flat(self.full, self.shard, group=self.group, async_op=async_op, transport=self.transport)

    # -- gradients --------------------------------------------------------------------------

    def add_param_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Accumulate one parameter's gradient into `grad_full`.

        `grad_full` starts uninitialised and each slot's first gradient is copied in: a zero-filled
        buffer plus add_ would write the whole buffer twice. Padding and slots that never get a
        gradient are zeroed before the reduction (`_zero_unwritten`).
        """
        grad = to_local(grad)
        if self.grad_full is None and grad.numel() == self.plan.padded_numel and grad.is_contiguous() \
                and grad.dtype == self.dtype and grad.device == self.device and grad._base is None \
                and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size():
            # A chunk that is this one parameter (the embedding, at one shard): its gradient, a tensor that owns
            # its whole storage, becomes the buffer; no second buffer of the chunk's size beside it (the caller
            # drops param.grad, so it is ours)
            self.grad_full, self._written = grad.reshape(-1), {slot_index}
            self.slots_ready.add(slot_index)
            return
        if self.grad_full is None:
            self.grad_full = torch.empty(self.plan.padded_numel, dtype=self.dtype, device=self.device)
            self._written = set()
        slot = self.plan.slots[slot_index]
        target = self.grad_full[slot.offset : slot.end]
        if slot_index in self._written:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self._written.add(slot_index)
        self.slots_ready.add(slot_index)

    def add_param_rows(self, slot_index: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Accumulate an embedding's gradient given as rows: `rows[..., :]` belongs to row `ids[...]` of the slot.

        A tied embedding's gradient (grad_hooks.py) arrives this way instead of as a dense vocab x dim tensor.
        Repeated ids are summed first, then added once per row, so a row's sum is the one autograd's dense
        embedding gradient gives (the ids' rows in order, then added to the head's gradient). Every shape here
        is the ids' count, never the count of distinct ids: `unique` would make the host wait for the device.
        """
        slot = self.plan.slots[slot_index]
        target = self._slot_grad(slot_index).view(slot.shape)
        segment_ids, segment_of_row, order = _segments_of_equal_ids(ids.reshape(-1))
        rows = rows.reshape(-1, rows.shape[-1])
        summed = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device)
        summed.index_add_(0, segment_of_row, rows.index_select(0, order))
        # segments past the last distinct id are zero rows aimed at the last id: t + s + 0 == t + s bit for bit,
        # since a sum started from +0 is never -0
        target.index_add_(0, segment_ids, summed.to(target.dtype))
        self.slots_ready.add(slot_index)

    def _slot_grad(self, slot_index: int) -> torch.Tensor:
        """One slot's flat view of `grad_full` to add into, zero-filled if no gradient has reached it."""
        if self.grad_full is None:
            self.grad_full = torch.empty(self.plan.padded_numel, dtype=self.dtype, device=self.device)
            self._written = set()
        slot = self.plan.slots[slot_index]
        target = self.grad_full[slot.offset : slot.end]
        if slot_index not in self._written:
            target.zero_()
            self._written.add(slot_index)
        return target

    def local_grad(self, slot_index: int) -> torch.Tensor:
        """One slot's accumulated local gradient (not yet reduced) as a view, zero-filled if none arrived."""
        slot = self.plan.slots[slot_index]
        if self.grad_full is None or slot_index not in self._written:
            self.add_param_grad(slot_index, torch.zeros(slot.shape, dtype=self.dtype, device=self.device))
        return self.grad_full[slot.offset : slot.end].view(slot.shape)

    def _zero_unwritten(self) -> None:
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.plan.padded_numel, dtype=self.dtype, device=self.device)
            return
        for i, slot in enumerate(self.plan.slots):
            if i not in self._written:
                self.grad_full[slot.offset : slot.end].zero_()
        self.grad_full[self.plan.numel :].zero_()

    @property
    def grads_complete(self) -> bool:
        # distinct slots, not hook calls: a hook that fires twice for one parameter must not stand in
        # for another parameter's gradient that has not arrived yet
        return len(self.slots_ready) >= len(self.params)

    def launch_reduce(self) -> None:
        """Start the (async) reduction of `grad_full` across ranks, averaged over the ranks.

        One shard per rank -> reduce-scatter; one shard for all (stage 0) -> all-reduce.
        """
        self._zero_unwritten()  # slots no gradient reached on this rank contribute zeros
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world == 1:
            self._reduce_out, self._reduce_work = self.grad_full, None
            return
        if self.plan.num_shards == 1:
            self._reduce_work = all_reduce_flat(self.grad_full, group=self.group, async_op=True, scale=1.0 / world,
                                                transport=self.transport)
            self._reduce_out = self.grad_full
        else:
            out = torch.empty(self.plan.shard_numel, dtype=self.dtype, device=self.device)
            self._reduce_work = reduce_scatter_flat(out, self.grad_full, group=self.group, async_op=True,
                                                    scale=1.0 / world, transport=self.transport)
            self._reduce_out = out

    def finish_reduce(self) -> torch.Tensor:
        """Wait for the reduction; return this rank's reduced grad shard and free `grad_full`."""
        if self._reduce_work is not None:
            self._reduce_work.wait()
        out = self._reduce_out
        assert out is not None, f"chunk {self.plan.index}: finish_reduce without launch_reduce"
        if self.plan.num_shards == 1:
            lo, hi = self.plan.shard_range(0)
            out = out[lo:hi]
        self._reduce_work, self._reduce_out = None, None
        self.grad_full = None
        self.slots_ready.clear()
        return out

    def reset_grads(self) -> None:
        self.grad_full = None
        self.slots_ready.clear()


def _segments_of_equal_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group equal ids without a data-dependent shape: (the id of each segment, padded with the last id to
    len(ids); each sorted row's segment; the stable sort's order). The stable sort keeps each id's rows in their
    original order, so summing a segment adds them in the order autograd does."""
    sorted_ids, order = ids.sort(stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment_of_row = starts.cumsum(0) - 1
    segment_ids = sorted_ids[-1:].expand(ids.numel()).clone().scatter_(0, segment_of_row, sorted_ids)
    return segment_ids, segment_of_row, order
