"""The gradient's way from a chunk's reduction to its `ChunkState`, with one owner.

The grad hooks (zero/grad_hooks.py) launch each chunk's reduction and hand the chunk here (`GradPath.hand_over`);
the path finishes the reduction and gives the chunk's ChunkState (zero/chunk_state.py) its gradient shard, final
once `finish()` returns (Engine.step calls it). It owns what lies between: the copy stream and the device->host
copies in flight (CUDA, offloaded gradients), the fp32 sums that keep offloaded gradients on the device over the
micro-steps (`EnginePlan.accumulate_on_device`), whether a shard that crossed is kept as it crossed
(`keeps_as_crossed`), and the bytes that rule holds (`unallocated_grad_bytes`, with zerogpt/memory_model.py's
`step_grad_itemsize`). When to reduce and when to step is the Engine's.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch

from zerogpt.memory_model import step_grad_itemsize
from zerogpt.zero.chunk import Chunk
from zerogpt.zero.chunk_state import ChunkState
from zerogpt.zero.offload import Placement, Traffic, start_d2h


class GradPath:
    """Reduced gradient shards on their way to the trainable chunks' `ChunkState`s.

    Args:
        states: the ChunkStates by chunk index (ShardedOptimizer's), the gradients' destinations.
        placement: allocates the fp32 shards at the grad home and the device sums.
        traffic: counts each shard that crosses between device and host.
        hand_over_at_launch: hand each chunk over right after its reduction is launched, so copies run under the
            rest of backward (stream-ordered waits on CUDA: the host does not block; a CUDA run with offloaded
            gradients also gets a copy stream); else at the end of backward (gloo's waits block the host).
        accumulate_on_device: offloaded gradients are summed over the micro-steps in an fp32 shard on the device
            and cross to the host once per step.
        stage, accumulation: what decides whether a step's gradient crosses to the host once (memory_model.py).
        host_step_waits: the host step runs on its own worker and waits there for the copies it reads
            (zero/host_step.py): this thread leaves the copies kept as they crossed in flight.
        on_final: told of each chunk's whole gradient for the step as it starts for the host (the state, the
            gradient, its copy's event): zero/host_step.py's speculative step, where the plan has one.
    """

    def __init__(self, states: dict[int, ChunkState], placement: Placement, traffic: Traffic, *,
                 hand_over_at_launch: bool, accumulate_on_device: bool, stage: int, accumulation: int,
                 host_step_waits: bool = False,
                 on_final: Callable[[ChunkState, torch.Tensor, Any], None] | None = None) -> None:
        self.states = states
        self.placement = placement
        self.traffic = traffic
        self.hand_over_at_launch = hand_over_at_launch
        self.accumulate_on_device = accumulate_on_device
        self.stage = stage
        self.accumulation = accumulation
        # CUDA with offloaded grads: each chunk's reduced shard is copied to the host on a side stream as soon as its
        # reduction is launched, so the copies run under the rest of backward.
        self.copy_stream = (torch.cuda.Stream(placement.device)
                            if hand_over_at_launch and placement.device.type == "cuda" else None)
        # Reduced grad shards still being copied device->host: (fp32 host shard to add the copy into, or None when
        # the copy is kept as the gradient; staging copy; event).
        self._pending_d2h: list[tuple[torch.Tensor | None, torch.Tensor, torch.cuda.Event | None]] = []
        # chunk index -> fp32 grad shard on the device, the sum of this step's micro-steps (accumulate_on_device)
        self._device_sums: dict[int, torch.Tensor] = {}
        self._last_reduce = True  # this backward's reduction is the step's last (its sum goes to the host)
        self.host_step_waits = host_step_waits
        self.on_final = on_final

    def begin(self, last_reduce: bool) -> None:
        """A backward whose reductions are (`last_reduce`) or are not the step's last begins."""
        self._last_reduce = last_reduce

    def keeps_as_crossed(self, state: ChunkState) -> bool:
        """Whether a reduced shard handed over now, as the step's whole gradient of this chunk, is kept for the
        step as it crossed to the host (the compute dtype: 2 bytes/param in bf16) instead of being added into
        an fp32 shard.

        The fp32 shard would hold the same values, so the step is the same bit for bit; what goes is 2
        bytes/param of host RAM held from backward to the step (issue 30 point 1) and the pass that converted
        the gradient into it. CPUAdam's host step reads bf16 as it is; other optimizers get a chunk's fp32
        copy at the step (ChunkState.step).
        """
        return state.grad is None and state.grad_home == "host"

    def hand_over(self, chunk: Chunk) -> None:
        """Finish a chunk's launched reduction and bring the result to its ChunkState.

        Offloaded grads (`grad_home` host): with `accumulate_on_device` the reduced shard is added into an fp32 shard
        on the device, which goes to the host once, at the step's last reduction; otherwise each reduced shard goes
        to the host. On CUDA this runs on the copy stream: waiting for the collective makes that stream (not the
        host) wait, and the device->host copy is queued behind it. The CPU runs the same code on no stream.
        """
        index = chunk.plan.index
        state = self.states[index]
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # grads written by backward (world 1)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            reduced = chunk.finish_reduce()
            if stream is not None:
                reduced.record_stream(stream)  # not reused by backward until this stream has read it
            # (a step's only reduction, as a pipeline schedule makes, goes to the host as it is)
            if self.accumulate_on_device and (index in self._device_sums or not self._last_reduce):
                if index not in self._device_sums:  # made on this stream, which alone uses and frees it; the
                    # first micro-step's shard is copied in, not added to zeros (one pass, not two)
                    self._device_sums[index] = reduced.to(torch.float32, copy=True)
                else:
                    self._device_sums[index].add_(reduced)
                if not self._last_reduce:
                    return
                reduced = self._device_sums.pop(index)  # the step's sum crosses once
            self.traffic.copied("device", state.grad_home, reduced)
            self.deliver(state, reduced)

    def deliver(self, state: ChunkState, reduced: torch.Tensor) -> torch.Tensor:
        """Give `state` the reduced shard `reduced` (on the copy stream, if any). Returns where it lands: the host
        copy kept as it crossed, or the fp32 grad shard it is added into.

        An offloaded shard that is the step's whole gradient of the chunk (`keeps_as_crossed`) has its squared norm
        taken from `reduced`, where it is, so an offloaded step does not read the host gradient once more for the
        clip norm (on a GPU: at device bandwidth, on the copy stream, right after its device->host copy is queued).
        """
        if self._last_reduce and self.keeps_as_crossed(state):  # the step's one crossing, kept as it lands
            crossed, event = start_d2h(reduced)
            state.take_grad(crossed, state.sumsq(reduced))
            if event is not None:
                self._pending_d2h.append((None, crossed, event))
            if self.on_final is not None:
                self.on_final(state, crossed, event)
            return crossed
        grad = self._add(state, reduced)  # adds when on the same device (CPU; grads on device)
        if reduced.device != grad.device:
            # Start this chunk's device->host copy, then add the copies that have landed into their
            # host shards, never blocking the host on one still in flight (backward keeps queueing
            # work meanwhile). A plain non-blocking .to('cpu') then add_ would read the bytes too early.
            self._pending_d2h.append((grad, *start_d2h(reduced)))
            self._finish_d2h(landed_only=True)
        return grad

    def _add(self, state: ChunkState, reduced: torch.Tensor) -> torch.Tensor:
        """Sum a reduced gradient shard into the state's fp32 grad shard (allocated on first use); returns it.

        The first shard of a step becomes the grad shard itself when it already is one (fp32, this chunk's size,
        at the grad home, nothing to pin): no second buffer beside it and no copy (at one rank, the chunk's whole
        local gradient buffer). In another dtype there, it is upcast into the new grad shard: one pass, where
        zeros and an add would be two (8 bytes/param of a bf16 step's traffic). The step reads a gradient summed
        here for its norm.
        """
        placement = self.placement
        if state.grad is None and reduced.numel() == state.master.numel() \
                and reduced.device == placement.torch_device(state.grad_home) \
                and not (state.grad_home == "host" and placement.device.type == "cuda"):
            grad = reduced.to(torch.float32)  # itself when fp32
            state.take_grad(grad)
            return grad
        if state.grad is None:
            state.take_grad(placement.empty(state.master.numel(), torch.float32, state.grad_home,
                                            f"grad{state.index}"))
        if reduced.device == state.grad.device:
            state.grad.add_(reduced)
        return state.grad

    def _finish_d2h(self, landed_only: bool = False) -> None:
        """Add pending grad copies into their shards, in order: all of them (waiting), or those landed. A copy kept
        as it crossed, with the host step on its worker, is that worker's to wait for."""
        while self._pending_d2h:
            shard, staging, event = self._pending_d2h[0]
            if shard is None and self.host_step_waits:
                self._pending_d2h.pop(0)
                continue
            if event is not None:
                if landed_only and not event.query():
                    return
                event.synchronize()
            if shard is not None:  # None: the copy is the gradient itself (kept as it crossed)
                shard.add_(staging)
            self._pending_d2h.pop(0)

    def finish(self) -> None:
        """Before the step: every copy in flight landed and added (or left to the host step's worker, which waits
        for the device work queued before its launch), and the compute stream ordered after the copy stream (the
        norms taken there at hand-over). The states' gradients are final."""
        self._finish_d2h()
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.placement.device).wait_stream(self.copy_stream)

    def clear(self) -> None:
        """Drop what is in transit (zero_grad): pending copies and the device sums."""
        self._pending_d2h.clear()
        self._device_sums.clear()

    def device_sums(self) -> list[torch.Tensor]:
        """The fp32 sums held on the device between micro-steps (memory accounting)."""
        return list(self._device_sums.values())

    def unallocated_grad_bytes(self, homes: tuple[str, ...]) -> int:
        """Bytes of the gradient shards a step will hold in `homes` that are not allocated now (between steps:
        all of them): per element the compute dtype's where the step's one crossing is kept as it crossed, else
        an fp32 shard's (memory_model.step_grad_itemsize, the rule the memory model states)."""
        return sum(s.master.numel() * step_grad_itemsize(self.stage, self.accumulation, s.chunk.dtype.itemsize,
                                                         kept_as_crossed=self.keeps_as_crossed(s))
                   for s in self.states.values() if s.grad is None and s.grad_home in homes)
