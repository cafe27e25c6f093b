"""What zerogpt's keep-freed-host-memory costs and buys on a CPU run (issue 47 point 6: "shrink what need not be
there"): step time, minor page faults per step and peak RSS of one rank of a 2-rank ZeRO-2 CPU run, under glibc's
three settings that matter:

    heap     zerogpt's (zerogpt/host_memory.py): every block from the heap, the heap never trimmed
    cap32    the heap never trimmed, blocks of 32 MiB and more mmapped (glibc's largest fixed mmap threshold): the
             middle ground, small blocks reused, large ones returned
    default  glibc's own (dynamic mmap threshold, trimming)

    python bench/malloc_modes.py                      # 6L-384 GPT (30M, vocab 50257), 4 x 256 tokens, 2 rounds
    python bench/malloc_modes.py --json bench/results/malloc_modes_cpu_DATE.json

Each mode runs in fresh processes (a malloc setting is process-wide and cannot be undone), the modes alternating
round by round so the VM's drift falls on all of them; the figures are medians over steps 4-8 of rank 0.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("heap", "cap32", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def set_mode(mode: str) -> None:
    """The mode's glibc settings, before anything large is allocated; zerogpt's own setting stays off."""
    libc = ctypes.CDLL("libc.so.6")
    if mode == "heap":
        assert libc.mallopt(_M_TRIM_THRESHOLD, -1) and libc.mallopt(_M_MMAP_MAX, 0)
    elif mode == "cap32":
        assert libc.mallopt(_M_TRIM_THRESHOLD, -1) and libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    os.environ["ZEROGPT_KEEP_HOST_MEMORY"] = "0"


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(rank: int, mode: str, args, port: int, queue) -> None:
    set_mode(mode)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import zerogpt
    from model_zoo import GPTLMLoss, build_model, gpt2_tiny

    ctx = zerogpt.launch_from_torch(seed=0)
    model = build_model(dict(type=gpt2_tiny, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                             max_position_embeddings=args.seq), vocab_size=args.vocab)
    engine = zerogpt.initialize(model, dict(type="HybridAdam", lr=1e-4), GPTLMLoss(shift=False),
                                config=zerogpt.Config(dict(zero=dict(stage=2), precision="fp32")), ctx=ctx)
    engine.logger.setLevel("WARNING")
    g = torch.Generator().manual_seed(rank)
    seconds, faults = [], []
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.backward(engine.criterion(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
        engine.zero_grad()
        seconds.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if rank == 0:
        def median(xs):
            return sorted(xs)[len(xs) // 2]
        queue.put(dict(mode=mode, step_s=median(seconds[3:]), faults_per_step=median(faults[3:]),
                       peak_rss_mib=_peak_rss() / 2**20))
    ctx.destroy()


def run_mode(mode: str, args, port: int) -> dict:
    spawn = mp.get_context("spawn")
    queue = spawn.SimpleQueue()
    procs = [spawn.Process(target=worker, args=(r, mode, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
    if any(p.exitcode != 0 for p in procs):
        return dict(mode=mode, error=f"exit codes {[p.exitcode for p in procs]}")
    return queue.get()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for k in range(args.rounds):
        for mode in args.modes.split(","):
            rows.append(dict(run_mode(mode, args, 29611 + len(rows)), round=k))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'mode':8}{'step s':>10}{'faults/step':>13}{'peak RSS MiB':>14}   (medians over rounds; rank 0)")
    summary = {}
    for mode in args.modes.split(","):
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        if ok:
            summary[mode] = {key: sorted(r[key] for r in ok)[len(ok) // 2]
                             for key in ("step_s", "faults_per_step", "peak_rss_mib")}
            s = summary[mode]
            print(f"{mode:8}{s['step_s']:>10.2f}{s['faults_per_step']:>13,}{s['peak_rss_mib']:>14,.0f}")
    if args.json:
        from zerogpt.atomic_write import write_json_atomic

        write_json_atomic(args.json, dict(args=vars(args), rows=rows, summary=summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
