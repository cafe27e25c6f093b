"""Reduce-scatter and all-gather through shared memory, for ranks that share one host's /dev/shm.

Why: gloo moves CPU tensors over loopback TCP, so every byte is copied through the kernel several times
by cores that would otherwise compute. Through one shared mapping a reduce-scatter is one write of the
input, one read of every rank's matching piece and one write of the summed shard; an all-gather is one
write of the shard and one read of the output (bench/README.md has the measurements).

How: the ranks map one /dev/shm file holding two staging buffers of `world` slots each. A collective is
cut into pieces that fit a slot; for each piece every rank writes its slot, all ranks meet at a barrier on
a private gloo group (which also checks that every rank is in the same collective with the same size), and
each rank reads what it needs. Pieces alternate between the two buffers, so the barrier of piece k also
proves every rank has finished reading piece k-2: one barrier per piece. Collectives run in order on one
worker thread per group, so they overlap backward and the optimizer step like gloo's.

The file is unlinked once every rank has mapped it (a killed run leaves nothing), and its pages are
reserved up front, so a full /dev/shm is a clear error at start-up, never a SIGBUS mid-step. Ranks that
cannot all map the same file get None from `open_transport` and stay on gloo. Nothing here is global:
`open_transport` returns a new transport, which its owner hands to each collective (`transport=` in comm.py,
`Chunk(transport=...)`) and closes. The engine opens one at initialize() when `host.shm_collectives` is on
(the default) and closes it at engine.close().
"""
from __future__ import annotations

import atexit
import concurrent.futures
import os
import queue
import threading
import time
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
STAGING_BYTES = 256 << 20  # per group; cut into 2 buffers x world slots
_KINDS = {"reduce_scatter": 1, "all_gather": 2, "all_reduce": 3}


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (kind or size) at the same point."""


class _Job:
    """Handle of one queued collective; `wait` re-raises the worker's error on the caller's thread."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wait(self) -> bool:
        self.future.result()
        return True


class SharedMemoryTransport:
    """Collectives for one process group whose ranks all map the same staging file (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, staging: torch.Tensor, sync: dist.ProcessGroup) -> None:
        self.group, self.sync = group, sync
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slot_bytes = _slot_bytes(self.world)
        self.buffers = staging.view(2, self.world, self.slot_bytes)
        self.pieces_done = 0
        self.closed = False
        # Every piece's barrier all-reduces this one tensor, which lives as long as the transport. A temporary
        # there, dropped by Python while gloo's worker still held the finished collective, was freed later on that
        # worker, which then needed the GIL to free its Python object: at interpreter exit, an abort.
        self._signal = torch.zeros(4, dtype=torch.int64)
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="zerogpt-shm-comm", daemon=True)
        self._worker.start()
        # A script that never calls close() (engine.close()) still stops the thread at exit, before the process
        # group is torn down (launch_from_torch registers that earlier, so it runs later): left to interpreter
        # shutdown, the thread and its gloo group went in no set order, and once in 16 runs the process aborted.
        atexit.register(self.close)

    # -- public collectives (async: each returns a handle with .wait()) ---------------------

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, scale: float = 1.0) -> _Job:
        """output = scale * (this rank's slice of the sum of every rank's `input`); input is left as is."""
        check_flat(output, input, self.world, "reduce_scatter")
        return self._submit(self._reduce_scatter, output, input, scale)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> _Job:
        """output = concat of every rank's `input`; `input` may be this rank's slice of `output`."""
        check_flat(input, output, self.world, "all_gather")
        return self._submit(self._all_gather, output, input)

    def all_reduce(self, tensor: torch.Tensor, scale: float = 1.0) -> _Job:
        """tensor = scale * the sum of every rank's `tensor`, bit-identical on every rank (any size)."""
        if not tensor.is_contiguous():
            raise ValueError("all_reduce: expected a contiguous tensor")
        return self._submit(self._all_reduce, tensor.view(-1), scale)

    # -- worker -----------------------------------------------------------------------------

    def _submit(self, fn, *args) -> _Job:
        if self.closed:
            raise RuntimeError(f"the shared-memory transport of rank {self.rank} of {self.world} is closed; "
                               f"a collective after engine.close() must not use it (pass transport=None)")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return _Job(future)

    def close(self) -> None:
        """Finish the queued collectives, stop the worker thread and unmap the staging file; a second call
        does nothing."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._worker.join()
        _wait_released(self._signal)
        self.buffers = None  # the mapping goes with its last reference

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            del job  # the tuple holds the job's tensors too (see below)
            error = None
            try:
                with torch.no_grad():
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the job
                error = e
            # Drop the job's tensors before waking the waiter: held by this loop's locals, the last job's
            # buffers (a stage-3 chunk the waiter releases next, say) would stay in memory until the next job.
            del fn, args
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
                del error

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The staging buffer of the next piece, as [world, slot elements] of `dtype`."""
        return self.buffers[self.pieces_done % 2].view(dtype)  # slot_bytes is a multiple of every element size

    def _meet(self, kind: str, numel: int) -> None:
        """Barrier of one piece that also checks every rank is in the same collective of the same size."""
        code = _KINDS[kind]
        sig = self._signal
        sig.copy_(torch.tensor([code, numel, -code, -numel]))
        dist.all_reduce(sig, op=dist.ReduceOp.MAX, group=self.sync)
        if sig[0] != code or sig[1] != numel or sig[2] != -code or sig[3] != -numel:
            raise CollectiveMismatch(
                f"rank {self.rank} of {self.world} is in {kind} of {numel} elements but another rank is in a "
                f"different collective or size; every rank must issue the same collectives, in the same order, "
                f"on tensors of the same size")
        self.pieces_done += 1

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, scale: float) -> None:
        shard = output.numel()
        source = input.view(self.world, shard)  # row r: the part of my input that rank r reduces
        per_piece = self._slots(input.dtype).shape[1] // self.world
        for lo in range(0, shard, per_piece):
            hi = min(lo + per_piece, shard)
            slots = self._slots(input.dtype)
            mine = slots[self.rank, : self.world * (hi - lo)].view(self.world, hi - lo)
            mine.copy_(source[:, lo:hi])
            self._meet("reduce_scatter", input.numel())
            pieces = slots[:, : self.world * (hi - lo)].view(self.world, self.world, hi - lo)[:, self.rank]
            _sum_rows(pieces, output[lo:hi], scale)

    def _all_reduce(self, tensor: torch.Tensor, scale: float) -> None:
        per_piece = self._slots(tensor.dtype).shape[1]
        for lo in range(0, tensor.numel(), per_piece):
            hi = min(lo + per_piece, tensor.numel())
            slots = self._slots(tensor.dtype)
            slots[self.rank, : hi - lo].copy_(tensor[lo:hi])
            self._meet("all_reduce", tensor.numel())
            _sum_rows(slots[:, : hi - lo], tensor[lo:hi], scale)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        shard = input.numel()
        target = output.view(self.world, shard)
        per_piece = self._slots(input.dtype).shape[1]
        for lo in range(0, shard, per_piece):
            hi = min(lo + per_piece, shard)
            slots = self._slots(input.dtype)
            slots[self.rank, : hi - lo].copy_(input.view(-1)[lo:hi])
            self._meet("all_gather", output.numel())
            target[:, lo:hi].copy_(slots[:, : hi - lo])


def _slot_bytes(world: int) -> int:
    """Big slots: every piece costs a barrier (~1-3 ms on gloo), so 64 MB slots at 2 ranks beat 8 MB ones
    by 40% on a 120 MB reduce-scatter. A multiple of 64 bytes, so every dtype views it whole."""
    return STAGING_BYTES // (2 * world) // 64 * 64


def _sum_rows(rows: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """out = scale * (rows[0] + rows[1] + ...), added in rank order so every rank gets the same bits.

    A chain of adds, not `sum(dim=0)`: torch's outer-dim reduction is 4x slower on CPU (34 vs 8 ms for
    2 x 15M fp32). Half-precision rows are added in fp32 and scaled before the cast back, since their
    sum may overflow where the mean would not.
    """
    if out.dtype == torch.float32:
        acc = torch.add(rows[0], rows[1], out=out)
    else:
        acc = rows[0].float().add_(rows[1])
    for row in rows[2:]:
        acc.add_(row)
    if scale != 1.0:
        acc.mul_(scale)
    if acc is not out:
        out.copy_(acc)


def check_flat(small: torch.Tensor, large: torch.Tensor, world: int, kind: str) -> None:
    """A flat collective's sizes: the large tensor is exactly `world` x the small one (a chunk padded for
    another world size fails here, on every path, instead of as a hang or a backend error)."""
    if large.numel() != small.numel() * world or not (small.is_contiguous() and large.is_contiguous()):
        raise ValueError(f"{kind}: expected contiguous tensors with the large one exactly {world} x the small one "
                         f"({world} ranks), got {large.numel()} and {small.numel()} elements")


def open_transport(group: dist.ProcessGroup | None) -> SharedMemoryTransport | None:
    """A new shared-memory transport for `group` (None: the default group); every rank of the group calls it at
    the same point. None when the group has one rank, or when its ranks cannot all map one file (another host,
    no /dev/shm): collectives then stay on gloo. The caller owns the transport and closes it.

    Example:
        >>> transport = open_transport(group)
        >>> reduce_scatter_flat(out, grads, group=group, transport=transport)  # zero/comm.py
        >>> transport.close()
    """
    if dist.get_world_size(group) < 2:
        return None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    sync = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    nbytes = 2 * world * _slot_bytes(world)
    name = [f"zerogpt-comm-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=ranks[0], group=sync)
    path, token = os.path.join(SHM_DIR, name[0]), name[0].encode()  # each rank looks in its own host's dir
    if rank == 0:
        try:
            _reserve(path, nbytes, token)
        except OSError:
            pass  # no /dev/shm, or too little of it: the file is missing and every rank sees that below
    dist.barrier(group=sync)
    staging = None
    if os.path.exists(path):  # absent: another host's /dev/shm (from_file would create it)
        staging = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if bytes(staging[: len(token)].tolist()) != token:
            staging = None
    ok = torch.tensor([int(staging is not None)], dtype=torch.int64)
    # all ranks on shared memory, or none; once it returns, every rank has mapped (or given up on) the file
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=sync)
    if rank == 0 and os.path.exists(path):
        os.unlink(path)
    _wait_released(ok)  # a run that fails right after this and exits must not leave it to gloo's worker
    if not ok.item():
        return None
    return SharedMemoryTransport(group, staging, sync)


def _wait_released(tensor: torch.Tensor, timeout_s: float = 5.0) -> None:
    """Wait, the GIL released, until no collective's work holds `tensor`: gloo's worker drops a finished
    collective just after its waiter wakes, so after the last barrier it may still hold one for a moment."""
    deadline = time.monotonic() + timeout_s
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)


def _reserve(path: str, nbytes: int, token: bytes) -> None:
    """Create the file with every page allocated (a full /dev/shm fails here, not with SIGBUS later)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.pwrite(fd, token, 0)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
