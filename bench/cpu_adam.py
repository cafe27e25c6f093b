"""CPU Adam throughput: zerogpt CPUAdam (DeepSpeed op / torch fused fallback) vs torch AdamW
(for-loop, foreach, fused), against the machine's measured memory bandwidth.

    python bench/cpu_adam.py                       # 10M, 50M, 200M params
    python bench/cpu_adam.py --sizes 10 50 --json out.json

Byte model: one Adam step on fp32 reads param, grad, exp_avg, exp_avg_sq (16 B/param) and writes
param, exp_avg, exp_avg_sq (12 B/param): 28 B/param. A step streams far more bytes than it does
flops (~12 flops/param), so memory bandwidth is the ceiling: params/s <= bandwidth / 28 B.
Bandwidth is measured as a large out-of-cache copy (bytes read + written per second) and as a
STREAM-style triad (a = b + s*c: 2 reads + 1 write), interleaved with the optimizer steps. Note that
these counts ignore write-allocate reads, and that on few cores a 7-stream Adam kernel keeps more
misses in flight than a 2-stream copy, so a fused Adam can exceed the "copy" figure.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerogpt.atomic_write import write_json_atomic  # noqa: E402
from zerogpt.optim import CPUAdam, cpu_adam_backend  # noqa: E402

BYTES_PER_PARAM = 28  # 4 fp32 reads + 3 fp32 writes
TENSOR_NUMEL = 1 << 22  # params split into 4M-element tensors (16 MB), like a model's larger layers
COPY_NUMEL = 1 << 27  # 512 MiB fp32 copy probe, far out of cache


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """Copy and triad bandwidth in GB/s (bytes moved / s), best of `repeats`."""
    n = nbytes // 4
    src, dst, other = torch.rand(n), torch.empty(n), torch.rand(n)
    copy_s, triad_s = [], []
    for _ in range(repeats):
        t = time.perf_counter(); dst.copy_(src); copy_s.append(time.perf_counter() - t)
        t = time.perf_counter(); torch.add(src, other, alpha=0.5, out=dst); triad_s.append(time.perf_counter() - t)
    return {"copy_GBps": 2 * nbytes / min(copy_s) / 1e9, "triad_GBps": 3 * nbytes / min(triad_s) / 1e9}


def make_problem(num_params: int) -> list[torch.Tensor]:
    """fp32 params (with fp32 grads) split into TENSOR_NUMEL-sized tensors."""
    sizes = [TENSOR_NUMEL] * (num_params // TENSOR_NUMEL)
    if num_params % TENSOR_NUMEL:
        sizes.append(num_params % TENSOR_NUMEL)
    params = [torch.randn(s).requires_grad_() for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def time_contenders(builders: dict, num_params: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each contender, interleaved round-robin over `rounds` rounds.

    All contenders step the same params/grads (each with its own state, allocated by one untimed
    warm-up step), and the rounds interleave them, so background load on a shared machine hits
    every contender alike; report the best and the median round.
    """
    params = make_problem(num_params)
    opts = {name: build(params) for name, build in builders.items()}
    for opt in opts.values():
        opt.step()
    src, other, dst = torch.rand(COPY_NUMEL), torch.rand(COPY_NUMEL), torch.zeros(COPY_NUMEL)
    times: dict[str, list[float]] = {name: [] for name in [*opts, "copy", "triad"]}
    for _ in range(rounds):
        for name, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
        t = time.perf_counter()  # the bandwidth probes run in the same rounds, under the same load
        dst.copy_(src)
        times["copy"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.add(src, other, alpha=0.5, out=dst)
        times["triad"].append(time.perf_counter() - t)
    del opts, params, src, other, dst
    gc.collect()
    return times


CONTENDERS = {
    "zerogpt CPUAdam (deepspeed op)": lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01, backend="deepspeed"),
    "zerogpt CPUAdam (torch-fused backend)": lambda ps: CPUAdam(ps, lr=1e-3, weight_decay=0.01, backend="torch"),
    "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200], help="millions of params")
    ap.add_argument("--steps", type=int, default=7, help="timed rounds per size (best and median reported)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    backend = cpu_adam_backend()  # builds the DeepSpeed op once (cached) if it can
    contenders = {k: v for k, v in CONTENDERS.items() if backend == "deepspeed" or "deepspeed" not in k}
    bw = measure_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"CPU Adam backend: {backend}")
    print(f"memory bandwidth: copy {bw['copy_GBps']:.1f} GB/s, triad {bw['triad_GBps']:.1f} GB/s "
          f"-> {bw['copy_GBps'] * 1e9 / BYTES_PER_PARAM / 1e6:.0f} Mparams/s at {BYTES_PER_PARAM} B/param\n")
    rows = []
    print("| params | optimizer | ms/step best (median) | Mparams/s | GB/s (28 B/param) | % of copy bandwidth |")
    print("|---:|---|---:|---:|---:|---:|")
    for millions in args.sizes:
        n = millions * 1_000_000
        times = time_contenders(contenders, n, args.steps)
        copy_gbps = 2 * 4 * COPY_NUMEL / min(times.pop("copy")) / 1e9  # bytes read + written
        triad_gbps = 3 * 4 * COPY_NUMEL / min(times.pop("triad")) / 1e9
        for name, ts in times.items():
            best, median = min(ts), statistics.median(ts)
            gbps = n * BYTES_PER_PARAM / best / 1e9
            row = dict(params=n, optimizer=name, ms_per_step_best=best * 1e3, ms_per_step_median=median * 1e3,
                       Mparams_per_s=n / best / 1e6, GBps=gbps, copy_GBps=copy_gbps, triad_GBps=triad_gbps,
                       pct_of_copy_bw=100 * gbps / copy_gbps)
            rows.append(row)
            print(f"| {millions}M | {name} | {best * 1e3:.1f} ({median * 1e3:.1f}) | {row['Mparams_per_s']:.0f} | "
                  f"{gbps:.1f} | {row['pct_of_copy_bw']:.0f}% |", flush=True)
        for probe, gb in (("copy", copy_gbps), ("triad a=b+s*c", triad_gbps)):
            print(f"| {millions}M | *{probe} probe, same rounds* | | {gb * 1e9 / BYTES_PER_PARAM / 1e6:.0f} at 28 B | "
                  f"{gb:.1f} | {100 * gb / copy_gbps:.0f}% |", flush=True)
    if args.json:
        write_json_atomic(args.json, dict(bandwidth=bw, backend=backend, threads=torch.get_num_threads(),
                                          rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
