"""How the chunks' host steps run: their compute copies staged for the device, and the step behind the next forward.

Two things a GPU run adds to the plain chunk-by-chunk step of zero/sharded_optim.py, fixed at build
(`EnginePlan.stages_compute_copies`, `host_step_overlaps`). A host master whose param shard is on the device has
its compute copy written by the host step into one of two pinned buffers (`HostStaging`), whose copy to the device
overlaps the next chunk's step. Where every master is on the host and stepped by CPUAdam's host step, the chunks'
steps run on a worker thread behind the next forward (`HostStep.launch`), each chunk's first use waiting for its
own step. The update itself is ChunkState.step's (zero/chunk_state.py); norm, clip and flag are known before.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from zerogpt.optim.host_adam import HOST_ADAM_DTYPES
from zerogpt.zero.chunk_state import ChunkState, hyperparameters
from zerogpt.zero.offload import Placement

if TYPE_CHECKING:  # the wait hooks are given, and only removed at close: no import of the hooks
    from zerogpt.zero.step_wait_hooks import StepWaitHooks


class HostStaging:
    """Two pinned host buffers, used in turn: the host step writes one chunk's compute copy into one while the
    other's copy to the device may still be in flight; taking a buffer waits for its last copy (an event).
    On a GPU run pinned, whatever zero.offload_optimizer.pin_memory says of the state (two buffers of the largest
    chunk; a copy out of pageable memory would not be queued but made on the spot), with an event per copy."""

    def __init__(self, numel: int, dtype: torch.dtype, placement: Placement) -> None:
        self.queued = placement.device.type == "cuda"
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=self.queued) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def take(self, numel: int) -> torch.Tensor:
        """The next buffer's first `numel` elements, once the copy that last read it has finished."""
        self.turn ^= 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
            self.events[self.turn] = None
        return self.buffers[self.turn][:numel]

    def sent(self) -> None:
        """The copy out of the buffer last taken is queued: record when it will have read it."""
        if self.queued:
            self.events[self.turn] = torch.cuda.Event()
            self.events[self.turn].record()


class HostStep:
    """The staging of compute copies, and the step behind the next forward over the chunks' `ChunkState`s.

    Args:
        states: the trainable chunks' states by chunk index (ShardedOptimizer's).
        stage: the ZeRO stage (stage 3 gathers each chunk in forward, which waits for its step).
        behind_forward: run the host step behind the next forward where it can (a GPU computing: on a CPU run
            forward and host step would share the cores).
        stage_copies: compute copies of host masters bound for param shards on the device go through pinned
            staging (a GPU run).
        step_waits: stages 0-2: the modules' pre-forward hooks that wait for their chunks' step (None: none).
        threads: the worker's torch threads (host.step_threads; None: as many as the training thread has).
    """

    def __init__(self, states: dict[int, ChunkState], placement: Placement, *, stage: int, behind_forward: bool,
                 stage_copies: bool, step_waits: StepWaitHooks | None = None, speculate: bool = False,
                 param_groups: Callable[[], list[dict]] = list, threads: int | None = None) -> None:
        self.states = states
        self.threads = threads or torch.get_num_threads()
        self.param_groups = param_groups  # the user's optimizer's groups, read when a speculative step is queued
        self.placement = placement  # a disk master's pages: read ahead of its step, evicted after it
        self.stage_copies = stage_copies
        self.step_waits = step_waits
        # The worker only computes on the host (device copies and collectives stay on this thread, in the same order
        # on every rank), and a chunk's first use in forward must wait for its own step: stage 3 gathers each chunk,
        # stages 0-2 have `step_waits` hooks.
        self.overlaps = behind_forward and (stage == 3 or step_waits is not None) and all(
            s.home != "device" and s.steps_on_host for s in states.values())
        """Whether each step runs behind the next forward (`launch`) rather than in place."""
        self.staging: HostStaging | None = None  # made on first use (a GPU run, params on the device)
        self.pending: dict[int, Future] = {}
        """chunk index -> its overlapped step, still to be finished on this thread (`finish`)."""
        self.last_step_s = 0.0
        """Seconds the chunks' overlapped steps took in the last one that has finished."""
        self._step_s = 0.0  # summed by the worker as an overlapped step's chunks finish
        self._worker: ThreadPoolExecutor | None = None
        self._h2d_stream: Any = None  # an overlapped step's compute copies to the device (the worker's stream)
        # A step taken as each gradient arrives, before the norm is known (`speculate_chunk`): each chunk that can
        # has a spare set of master and moments the step writes, so the state it started from survives until
        # `launch` settles it (the norm said no clip and no non-finite gradient: the spare set becomes the state;
        # else the chunk steps again from the state, as without speculation).
        self.spares: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if speculate and self.overlaps and _host_ram_holds_spares(states):
            self.spares = {i: _spare_set(s, placement) for i, s in states.items() if s.can_speculate}
        self.stood = self.redone = 0
        """Speculative chunk steps that stood, and that were taken again (a clip, a non-finite gradient, new rates)."""
        self.speculated: dict[int, tuple[Future, dict]] = {}
        """chunk index -> its speculative step this backward, still to be settled by `launch` (or `abandon`), and the
        hyperparameters it took."""

    # -- staging ----------------------------------------------------------------------------------------

    def staging_for(self, state: ChunkState) -> torch.Tensor | None:
        """A pinned buffer for the compute copy of a host master whose param shard is on the device (CUDA,
        optimizer offloaded without the params): the host step writes the copy there in the compute dtype, so
        2 bytes/param cross the bus instead of the fp32 master's 4, and the cast needs no pass of its own."""
        shard = state.chunk.shard
        if state.master_is_param_shard or not (self.stage_copies and state.chunk.shard_home == "device") \
                or not state.steps_on_host or shard.dtype not in HOST_ADAM_DTYPES:
            return None
        if self.staging is None:
            largest = max(s.master.numel() for s in self.states.values())
            self.staging = HostStaging(largest, shard.dtype, self.placement)
        return self.staging.take(shard.numel())

    def send(self, shard: torch.Tensor, staged: torch.Tensor, ready: Any = None) -> Any:
        """Copy a staged compute copy into its param shard. With `ready` (an overlapped step on a GPU: the device
        work queued at its launch), from the worker thread on the worker's own stream after it, returning the
        copy's event; without, on the current stream (the plain step; a CPU run whose plan stages copies)."""
        if ready is None:
            shard.copy_(staged, non_blocking=True)
            self.staging.sent()
            return None
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(shard.device)
        with torch.cuda.device(shard.device), torch.cuda.stream(self._h2d_stream):  # both are per thread
            self._h2d_stream.wait_event(ready)
            shard.copy_(staged, non_blocking=True)
            self.staging.sent()  # recorded on this stream: the buffer is free once the copy has read it
            copied = torch.cuda.Event()
            copied.record(self._h2d_stream)
        return copied

    # -- the step as each gradient arrives ----------------------------------------------------------------------

    def speculate_chunk(self, state: ChunkState, grad: torch.Tensor, landed: Any) -> None:
        """Queue `state`'s step on the worker now that `grad`, its whole gradient for this step, is on its way to the
        host (`landed`: the CUDA event of its copy, None on a CPU), with no clip and no non-finite check: those
        need every chunk's gradient. Called by zero/grad_path.py during backward, in backward order; chunks without
        a spare set step at `launch` as before."""
        if state.index not in self.spares:
            return
        taken = frozen(self.param_groups()[state.group_index])
        self.speculated[state.index] = (self._start_worker().submit(self._speculative_step, state, taken, grad,
                                                                    landed), taken)

    def _start_worker(self) -> ThreadPoolExecutor:
        """The worker thread, started on first use with `threads` torch threads of its own (the kernels' OpenMP team
        is the calling thread's: the training thread keeps its count)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerogpt-host-step",
                                              initializer=torch.set_num_threads, initargs=(self.threads,))
        return self._worker

    def _speculative_step(self, state: ChunkState, group: dict, grad: torch.Tensor, landed: Any) -> tuple[bool, Any]:
        """On the worker: wait for the gradient's copy (which follows the chunk's last use in backward, so its param
        shard may be overwritten), then step into the spare set. Returns as `_timed_step` does."""
        if landed is not None:
            landed.synchronize()
        start = time.perf_counter()
        staged = self.staging_for(state)
        wrote = state.speculate(group, 1.0, grad, self.spares[state.index], out=staged)
        copied = self.send(state.chunk.shard, staged, landed) if staged is not None and wrote else None
        self._step_s += time.perf_counter() - start
        return wrote, copied

    def _settle(self, state: ChunkState, group: dict, scalars: Future, grad: torch.Tensor | None, ready: Any,
                speculated: tuple[Future, dict]) -> tuple[bool, Any]:
        """On the worker, once the norm is known: the speculative step stands where it equals the step the norm asks
        for (no clip factor other than 1, a finite gradient, the hyperparameters `engine.step()` was called with)
        and becomes the state; else the chunk steps again from its state, untouched, with the factor, flag and
        those hyperparameters, and its compute copy is written again."""
        future, taken = speculated
        done = future.result()
        factor, found_inf = scalars.result()
        stands = (factor is None or float(factor) == 1.0) and (found_inf is None or not found_inf.item()) \
            and same_values(taken, group)
        if stands:
            state.commit(self.spares[state.index])
            self.stood += 1
            return done
        self.redone += 1
        return self._timed_step(state, group, scalars, grad, ready, None)

    def abandon(self) -> None:
        """Drop speculative steps no `launch` settled (a backward whose step was not taken; a checkpoint between
        the two): each chunk's compute copy is written again from its state, which they never changed."""
        for index, (future, _) in self.speculated.items():  # done before the shards are written again
            _, copied = future.result()
            shard = self.states[index].chunk.shard
            if copied is not None:  # its copy to the device, queued on the worker's stream, lands first
                torch.cuda.current_stream(shard.device).wait_event(copied)
            self.states[index].write_back()
        self.speculated.clear()

    # -- the step behind the next forward ------------------------------------------------------------------

    def launch(self, param_groups: list[dict], factor: torch.Tensor | None, found_inf: torch.Tensor | None,
               device: torch.device) -> None:
        """Queue each chunk's step on a worker thread, in chunk (forward) order, and return.

        The non-finite flag and the clip factor are device tensors the caller computed; the worker waits for them (a
        CUDA event, on its own thread) and reads them to the host before its first chunk, so the training thread
        never blocks here: the result is the plain step's bit for bit. A chunk's first use in the next forward waits
        for its own step (`Chunk.pending_step`: stage 3's gather, stages 0-2's StepWaitHooks), so the next forward's
        first blocks start while later chunks still step; `finish()` waits for all. `param_groups`: the user's
        optimizer's, which the chunks follow.
        """
        self._start_worker()
        # the device work queued so far (the norm, the flag, the gradients' copies to the host, backward's last
        # reads of the param shards) comes before the step reads them and overwrites the shards
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        # the worker, not the training thread, waits for that work and reads the scalars (first in its queue)
        scalars = self._worker.submit(_scalars_on_host, factor, found_inf, ready)
        # the worker steps with the hyperparameters as they are now: the training thread may change the live groups
        # before it reads them (an LR schedule stepped right after engine.step())
        taken = [frozen(group) for group in param_groups]
        order = list(self.states.values())
        for state, following in zip(order, order[1:] + [None]):
            group = taken[state.group_index]
            speculated = self.speculated.pop(state.index, None)
            if speculated is not None:
                self.pending[state.index] = self._worker.submit(self._settle, state, group, scalars, state.grad,
                                                                ready, speculated)
            else:
                self.pending[state.index] = self._worker.submit(self._timed_step, state, group, scalars,
                                                                state.grad, ready, following)
            state.chunk.pending_step = lambda index=state.index: self._finish_chunk(index)

    def _timed_step(self, state: ChunkState, group: dict, scalars: Future, grad: torch.Tensor | None,
                    ready: Any, following: ChunkState | None) -> tuple[bool, Any]:
        """One chunk's step on the worker thread, its seconds added to this step's host time. Returns whether the
        step wrote the compute copy, and the event of its copy to the device when it went through the staging
        buffers (issued here, on the worker's own stream, so it overlaps the next chunk's step as in the plain
        step; the main stream waits for it in `_finish_chunk`). A disk-offloaded step reads the `following`
        chunk's pages ahead and lets this one's go, as the plain step does."""
        factor, found_inf = scalars.result()  # done already: it was queued first on this one worker
        start = time.perf_counter()
        if following is not None:
            for t in following.tensors():
                self.placement.prefetch(t)
        staged = self.staging_for(state)
        wrote = state.step(group, factor, found_inf, grad, out=staged)
        copied = self.send(state.chunk.shard, staged, ready) if staged is not None and wrote else None
        if not wrote and state.home == "disk":  # the write-back reads the master: while its pages are in RAM
            state.write_back()
            wrote = True
        for t in state.tensors():
            self.placement.evict(t)
        self._step_s += time.perf_counter() - start  # one worker thread: no other writer
        return wrote, copied

    def _finish_chunk(self, index: int) -> None:
        """Wait for one chunk's overlapped step (re-raising its error here) and finish its write-back."""
        state = self.states[index]
        state.chunk.pending_step = None
        wrote, copied = self.pending.pop(index).result()
        if copied is not None:  # the new shard, copied on the worker's stream: the compute waits for it alone
            torch.cuda.current_stream(state.chunk.shard.device).wait_event(copied)
        elif not wrote:
            state.write_back()
        if state.chunk.persistent_full:  # stages 0-2: every rank's new shard into `full`
            state.chunk.all_gather_full()
        if not self.pending:  # the last chunk: the step is complete
            self.last_step_s, self._step_s = self._step_s, 0.0

    def finish(self) -> None:
        """Wait for every chunk of an overlapped step; a no-op when none is pending."""
        for index in list(self.pending):
            self._finish_chunk(index)

    def close(self) -> None:
        """Finish a pending step, stop the worker thread and take the stages 0-2 wait hooks off."""
        self.abandon()
        self.finish()
        if self.step_waits is not None:
            self.step_waits.remove()
            self.step_waits = None
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


def frozen(group: dict) -> dict:
    """A param group's hyperparameters as they are now, for a step a worker takes later: a copy no change to the
    group reaches (tensors cloned), where the live group could change before the worker reads it."""
    return {key: _copied(value) for key, value in hyperparameters(group).items()}


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    return value


def same_values(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values (or dicts of them) are equal: tensors by their elements."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


def _host_ram_holds_spares(states: dict[int, ChunkState]) -> bool:
    """Whether the host has room for a spare master and moments per chunk with half its available RAM to spare:
    the speculative step is a speed-up, never worth an out-of-memory kill."""
    import psutil

    needed = sum(s.master.numel() * (4 + 2 * s.state["exp_avg"].element_size())
                 for s in states.values() if s.can_speculate)
    return 2 * needed <= psutil.virtual_memory().available


def _spare_set(state: ChunkState, placement: Placement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's second master and moments, where its own live (pinned host RAM): what a speculative step writes."""
    moments = state.state["exp_avg"].dtype
    return (placement.empty(state.master.numel(), torch.float32, "host", f"spare_master{state.index}"),
            placement.empty(state.master.numel(), moments, "host", f"spare_exp_avg{state.index}"),
            placement.empty(state.master.numel(), moments, "host", f"spare_exp_avg_sq{state.index}"))


def _scalars_on_host(factor: torch.Tensor | None, found_inf: torch.Tensor | None,
                     ready: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """On the worker thread: wait for the device work before `ready` (a CUDA event; None on CPU), then read the
    clip factor and the non-finite flag to the host, so the training thread never blocks on them."""
    if ready is not None:
        ready.synchronize()
    return (None if factor is None else factor.to("cpu"), None if found_inf is None else found_inf.to("cpu"))
