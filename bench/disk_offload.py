"""Disk tier throughput: what the optimizer step gets from the disk beside what the disk gives (issue 30 point 3).

    python bench/disk_offload.py                         # GPT-2 8 x 1024 (~130M params), files under /var/tmp
    python bench/disk_offload.py --path /nvme/dir --json disk.json

The step with zero.offload_optimizer=dict(device='disk') reads every chunk's fp32 master and Adam state from
memory-mapped files and writes them back (12 bytes/param each way in fp32). Before each timed step the state
files' pages are written out and dropped from the page cache (fsync, then posix_fadvise DONTNEED: no root needed),
so the step reads the disk, not RAM. Printed per step: the state bytes read + written over the step's seconds,
alone (what training waits for; the kernel writes the dirty pages back behind it) and with the files' fsync
after it (the writes on the disk too). The disk's own sequential figure: a file of --file-mb written in 8 MiB
blocks and fsynced, its pages dropped, then read back; (write + read bytes) / (write + read seconds).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from zerogpt.atomic_write import write_json_atomic  # noqa: E402

BLOCK = 8 * 2**20


def _drop_pages(path: str) -> None:
    """Write a file's dirty pages out, then drop it from the page cache (the next read comes from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_sequential(directory: str, nbytes: int) -> dict:
    """dd-style: write `nbytes` in 8 MiB blocks + fsync (a new file, then again over its blocks, as a step rewrites
    its state files), drop the pages, read back. Rates in MB/s; write_mb_s is the rewrite's."""
    path = os.path.join(directory, "zerogpt-disk-bench.bin")
    block = os.urandom(BLOCK)
    try:
        first_s, write_s = (_write(path, block, nbytes // BLOCK, mode) for mode in ("wb", "r+b"))
        _drop_pages(path)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(BLOCK):
                pass
        read_s = time.perf_counter() - start
    finally:
        os.unlink(path)
    size = nbytes // BLOCK * BLOCK
    return dict(bytes=size, first_write_mb_s=size / first_s / 1e6, write_mb_s=size / write_s / 1e6,
                read_mb_s=size / read_s / 1e6,
                read_write_mb_s=2 * size / (write_s + read_s) / 1e6)


def _write(path: str, block: bytes, blocks: int, mode: str) -> float:
    start = time.perf_counter()
    with open(path, mode, buffering=0) as f:
        for _ in range(blocks):
            f.write(block)
        os.fsync(f.fileno())
    return time.perf_counter() - start


def step_throughput(args, directory: str) -> dict:
    """Train a GPT with the optimizer state on disk; time steps whose state comes from the disk."""
    import torch

    import zerogpt
    from model_zoo.gpt import GPT, GPTConfig
    from zerogpt.context import DistContext
    from zerogpt.optim import HybridAdam

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=args.layers, n_head=max(args.hidden // 64, 1), n_embd=args.hidden,
                              vocab_size=args.vocab, max_position_embeddings=args.seq))
    cfg = dict(precision="fp32", host=dict(cpu_adam="torch"),
               zero=dict(stage=3, offload_param=dict(device="cpu"),
                         offload_optimizer=dict(device="disk", path=directory)))
    engine = zerogpt.initialize(model, dict(type=HybridAdam, lr=1e-4), config=cfg,
                                ctx=DistContext(0, 1, torch.device("cpu"), local_rank=0))
    files = [os.path.join(engine.placement.disk_dir, name) for name in os.listdir(engine.placement.disk_dir)]
    state_bytes = sum(t.numel() * t.element_size() for s in engine.sharded_optim.states.values()
                      for t in s.tensors())
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    step_s, flushed_s = [], []
    for _ in range(args.steps):
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        for path in files:
            _drop_pages(path)
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        flushed_s.append(time.perf_counter() - start)
        engine.zero_grad()
    engine.close()
    best, best_flushed = min(step_s), min(flushed_s)
    return dict(params=engine.num_params(), state_bytes=state_bytes, step_s=best, step_flushed_s=best_flushed,
                step_mb_s=2 * state_bytes / best / 1e6, step_flushed_mb_s=2 * state_bytes / best_flushed / 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir(),
                   help="directory on the disk to measure (the offload files and the sequential test file)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps (the fastest is reported)")
    p.add_argument("--file-mb", type=int, default=1024, help="size of the sequential write+read test file")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    os.makedirs(args.path, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.path) as directory:
        disk = disk_sequential(directory, max(args.file_mb, 8) * 2**20)
        step = step_throughput(args, directory)
    ratio = step["step_mb_s"] / disk["read_write_mb_s"]
    ratio_flushed = step["step_flushed_mb_s"] / disk["read_write_mb_s"]
    print(f"disk {args.path}: sequential write {disk['write_mb_s']:.0f} MB/s (a new file "
          f"{disk['first_write_mb_s']:.0f}), read {disk['read_mb_s']:.0f} MB/s, "
          f"write+read {disk['read_write_mb_s']:.0f} MB/s ({disk['bytes'] / 2**20:.0f} MiB file)")
    print(f"optimizer step, {step['params'] / 1e6:.1f}M params, {step['state_bytes'] / 2**20:.0f} MiB of state "
          f"read + written: {step['step_s']:.2f} s = {step['step_mb_s']:.0f} MB/s; with the files' fsync "
          f"{step['step_flushed_s']:.2f} s = {step['step_flushed_mb_s']:.0f} MB/s")
    print(f"step / disk = {ratio:.2f} (with fsync {ratio_flushed:.2f})")
    if args.json:
        write_json_atomic(args.json, dict(path=args.path, disk=disk, step=step, ratio=ratio,
                                          ratio_flushed=ratio_flushed))


if __name__ == "__main__":
    main()
