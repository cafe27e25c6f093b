"""The flat collectives ZeRO is built on (all-gather, reduce-scatter, all-reduce), fastest path per backend.

NCCL (and any backend but gloo): torch's `all_gather_single` / `reduce_scatter_single`. gloo's flat
all-gather and reduce-scatter are several times slower than its broadcast and all-reduce, so on gloo the
all-gather is a broadcast from every rank and the reduce-scatter an all-reduce whose slice is copied out
(neither moves more than a ring all-reduce). Ranks on one host skip gloo's sockets when the caller passes
`transport=` (zero/shm.py: one shared mapping, opened and closed by the engine); None keeps torch.distributed.
bench/README.md has the measurements.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from zerogpt.zero.shm import SharedMemoryTransport, check_flat

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """The handle of a collective made of several works, plus a step to run once they complete."""

    def __init__(self, works: list, then: Callable[[], None] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def _uses_gloo(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """True when this tensor's collectives run on gloo ("gloo", or "cpu:gloo,cuda:nccl" for CPU tensors)."""
    if tensor.device.type != "cpu":
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


def _shared_memory(tensor: torch.Tensor, group: dist.ProcessGroup | None,
                   transport: SharedMemoryTransport | None) -> SharedMemoryTransport | None:
    """`transport` where this tensor's collectives would run on gloo (a CUDA tensor keeps NCCL), else None."""
    if transport is None or not _uses_gloo(tensor, group):
        return None
    assert _same_group(transport.group, group), (
        f"a shared-memory transport opened for {transport.group} was passed with group={group}")
    return transport


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    return (a if a is not None else dist.group.WORLD) is (b if b is not None else dist.group.WORLD)


def _handle(pending: Pending, async_op: bool) -> Pending | None:
    """The caller's handle for an async call; a sync call waits here (the gloo paths always launch async)."""
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False, *, transport: SharedMemoryTransport | None = None) -> Pending | None:
    """output = concat of every rank's `input` (equal sizes). `input` may be this rank's slice of `output`.

    `transport`: `group`'s shared-memory transport (zero/shm.py), used where the collective would run on gloo;
    None = torch.distributed. The same holds for the two collectives below.
    """
    if (shm := _shared_memory(output, group, transport)) is not None:  # the transport checks the sizes itself
        return _handle(Pending([shm.all_gather(output.view(-1), input.view(-1))]), async_op)
    check_flat(input, output, dist.get_world_size(group), "all_gather")
    if not _uses_gloo(output, group):
        if input.data_ptr() == output.data_ptr() + dist.get_rank(group) * input.numel() * input.element_size():
            input = input.clone()  # in-place all-gather is not promised by every backend
        work = _all_gather_single(output, input, group=group, async_op=async_op)
        return Pending([work]) if async_op else None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = output.view(-1).chunk(world)
    if slices[rank].data_ptr() != input.data_ptr():
        slices[rank].copy_(input.view(-1))
    works = [dist.broadcast(slices[r], src=dist.get_global_rank(group, r) if group is not None else r,
                            group=group, async_op=True) for r in range(world)]
    return _handle(Pending(works), async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                        async_op: bool = False, scale: float = 1.0, *,
                        transport: SharedMemoryTransport | None = None) -> Pending | None:
    """output = `scale` x this rank's slice of the sum of every rank's `input`; `input` may be overwritten.

    Where the sum is taken on the wire (NCCL, gloo) `input` is pre-scaled, so a half-precision sum of
    means cannot overflow where a sum of the raw values would; shared memory scales the shard after summing.
    """
    if (shm := _shared_memory(input, group, transport)) is not None:  # the transport checks the sizes itself
        return _handle(Pending([shm.reduce_scatter(output.view(-1), input.view(-1), scale)]), async_op)
    check_flat(output, input, dist.get_world_size(group), "reduce_scatter")
    if scale != 1.0:
        input.mul_(scale)
    if not _uses_gloo(input, group):
        work = _reduce_scatter_single(output, input, group=group, async_op=async_op)
        return Pending([work]) if async_op else None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = input.view(-1).chunk(world)[rank]
    return _handle(Pending([dist.all_reduce(input, group=group, async_op=True)], then=lambda: output.copy_(mine)),
                   async_op)


def all_reduce_flat(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False,
                    scale: float = 1.0, *, transport: SharedMemoryTransport | None = None) -> Pending | None:
    """tensor = `scale` x the sum of every rank's `tensor` (in place; pre-scaled where summed on the wire)."""
    if (shm := _shared_memory(tensor, group, transport)) is not None:
        return _handle(Pending([shm.all_reduce(tensor, scale)]), async_op)
    if scale != 1.0:
        tensor.mul_(scale)
    work = dist.all_reduce(tensor, group=group, async_op=async_op)
    return Pending([work]) if async_op else None
