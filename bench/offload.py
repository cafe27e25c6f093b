"""Offload overhead: the training step with optimizer state (and stage-3 params) off the device, against
the same step without offload, and against DeepSpeed ZeRO-Offload at the same stage.

    python bench/offload.py                                  # CPU: small GPT, stages 2 and 3, 1 and 2 gloo ranks
    python bench/offload.py --world 1 --stages 2 --steps 4 --json /tmp/offload.json
    python bench/offload.py --world 1 --stages 2 3 --accum 16 --no-deepspeed   # 16 micro-steps per step
    python bench/offload.py --device cuda --world 1          # GPU: the same table on the GPU (real PCIe
                                                             # copies), then the largest GPT that trains
                                                             # on this GPU with CPU offload

Every system trains the same GPT-2 (dropout 0, fp32 on CPU, bf16 on CUDA) on the same random tokens with
the fused CPU Adam(W) (zerogpt HybridAdam / DeepSpeed's DeepSpeedCPUAdam under offload; on CPU both
use the same cpu_adam kernel), one rank per process. zerogpt modes: `none`, `cpu` (master + Adam state
on the host), `cpu+param` (also param shards, stage 3), `disk` (master + Adam state in memory-mapped
files under --disk-path). Reported: median step time (--accum micro-steps of forward + backward, then the
step, communication included), the ratio to zerogpt `none` at the same stage and world size, where this
rank's model state lives by the engine's own accounting (`engine.memory_stats()`), and the bytes one
optimizer step copied host->device and device->host on rank 0 (`engine.last_step_traffic`).

On a CPU-only machine "device" and "host" are the same RAM: the numbers measure the bookkeeping of
offload (extra fp32 master copy, chunk-by-chunk step, write-back, page-cache traffic for disk), not
PCIe transfers. The systems of one stage are built side by side and stepped in turn (alternating
order), so background load hits all of them alike; ratios are per step (paired), then the median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerogpt.atomic_write import write_json_atomic  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from zerogpt.context import DistContext

MODELS = {  # GPT-2 shapes (vocab 50257, tied head); params incl. the 50304 x n_embd embedding
    "gpt2_4l256": dict(n_layer=4, n_head=4, n_embd=256),    # 16.2M
    "gpt2_6l384": dict(n_layer=6, n_head=6, n_embd=384),    # 30.4M
    "gpt2_small": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
}
MODES = ("none", "cpu", "cpu+param", "disk")
LR = 1e-4


def build_model(name: str, seq: int, checkpoint: bool = False, **shape) -> torch.nn.Module:
    from model_zoo.gpt import gpt2_small

    torch.manual_seed(0)
    return gpt2_small(**(MODELS[name] if name in MODELS else shape), dropout=0.0, max_position_embeddings=seq,
                      checkpoint=checkpoint)


def batch(rank: int, step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


# -------------------------------------------------------------------------------------------------
# one function per system: build, return (step(tokens) -> loss, memory_stats() or None, close())

def make_zerogpt(model, args, stage: int, mode: str, disk_dir: str):
    import zerogpt
    from model_zoo.gpt import GPTLMLoss
    from zerogpt.optim import HybridAdam

    zero = dict(stage=stage, offload_optimizer=dict(device={"cpu+param": "cpu"}.get(mode, mode), path=disk_dir))
    if mode == "cpu+param":
        zero["offload_param"] = dict(device="cpu", device_budget=args.device_budget)
    precision = "bf16" if args.device == "cuda" else "fp32"
    engine = zerogpt.initialize(model, HybridAdam(model.parameters(), lr=LR), config=zerogpt.Config(
        dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=args.accum)), ctx=DistContext.current())
    engine.logger.setLevel("WARNING")

    def step(tokens):
        tokens = tokens.to(args.device)
        for _ in range(args.accum):  # the same micro-batch each time: the bytes and the work are what count
            loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        return loss
    return step, engine.memory_stats, engine.close, lambda: engine.last_step_traffic


def make_deepspeed(model, args, stage: int, mode: str, disk_dir: str):
    import deepspeed
    from model_zoo.gpt import GPTLMLoss

    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 25_000_000, "allgather_bucket_size": 25_000_000}
    if mode in ("cpu", "cpu+param"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
    if mode == "cpu+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
              "zero_optimization": zero, "steps_per_print": 1 << 30,
              # AdamW from the config: DeepSpeedCPUAdam under offload, FusedAdam otherwise
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "bf16": {"enabled": args.device == "cuda"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(tokens):
        tokens = tokens.to(engine.device)
        for _ in range(args.accum):
            loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        return loss
    return step, None, lambda: None, None


# -------------------------------------------------------------------------------------------------
# timing: all systems of one stage are built side by side and stepped in turn, so every step of every
# system meets the same background load (a shared 2-core VM swings 2-3x within a minute); ratios to
# zerogpt `none` are taken step by step (paired), then the median.

def _mib_by_home(stats: dict | None) -> dict:
    if stats is None:
        return {}
    return {h: round(sum(stats[c][h] for c in stats) / 2**20, 1) for h in ("device", "host", "disk")}


def time_stage(rank: int, stage: int, systems: list[str], args, disk_dir: str) -> dict:
    """Build every system of one stage, step them in alternating order, tear them down."""
    built, results = {}, {}
    for system in systems:
        name, _, mode = system.split(":")
        try:
            model = build_model(args.model, args.seq).to(args.device)
            make = make_zerogpt if name == "zerogpt" else make_deepspeed
            built[system] = make(model, args, stage, mode, disk_dir)
            results[system] = {"times": [], "losses": []}
        except Exception as e:  # report the failure in the table instead of dropping the run
            results[system] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    names = list(built)
    for i in range(args.warmup + args.steps):
        tokens = batch(rank, i, args)
        for system in (names if i % 2 == 0 else names[::-1]):
            step = built[system][0]
            sync(args.device)
            t0 = time.perf_counter()
            loss = step(tokens)
            sync(args.device)
            if i >= args.warmup:
                results[system]["times"].append(time.perf_counter() - t0)
            results[system]["losses"].append(loss.item())
        if rank == 0:
            print(f"  stage {stage} step {i}: " + ", ".join(
                f"{s.split(':', 1)[0]}:{s.rsplit(':', 1)[1]} {results[s]['times'][-1] * 1e3:,.0f} ms"
                for s in names if results[s]["times"]), flush=True)
    for system, (_, memory_stats, close, traffic) in built.items():
        results[system]["mem_mib"] = _mib_by_home(memory_stats() if memory_stats else None)
        if traffic is not None:  # the last optimizer step's copies between host (or disk) and device
            results[system]["h2d_bytes"], results[system]["d2h_bytes"] = traffic().h2d_bytes, traffic().d2h_bytes
        close()
    return results


def _worker(rank: int, args, init_file: str, queue) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=args.world)
    disk_dir = tempfile.mkdtemp(prefix="zerogpt-bench-offload-", dir=args.disk_path)
    results = {}
    for stage in args.stages:
        results.update(time_stage(rank, stage, systems_for(stage, args), args, disk_dir))
    os.rmdir(disk_dir)  # empty: every engine removed its own files on close
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def run_world(args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="zerogpt-bench-"), "rdzv")
    procs = [ctx.Process(target=_worker, args=(r, args, init_file, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=args.timeout)
    for p in procs:
        p.join()
    return results


def systems_for(stage: int, args) -> list[str]:
    modes = [m for m in MODES if m != "cpu+param" or stage == 3]
    out = [f"zerogpt:{stage}:{m}" for m in modes]
    if args.deepspeed:
        out += [f"deepspeed:{stage}:{m}" for m in ("none", "cpu") + (("cpu+param",) if stage == 3 else ())]
    return out


def _paired(r: dict, base: dict) -> tuple[float, float, float, float]:
    """Over steps, (this / base): median, 25th and 75th percentile; and the median of (this - base) in
    ms. Each pair was timed in the same round, so the quartiles show the noise left after pairing."""
    ratios = [a / b for a, b in zip(r["times"], base["times"])]
    diffs = [(a - b) * 1e3 for a, b in zip(r["times"], base["times"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return statistics.median(ratios), q1, q3, statistics.median(diffs)


def report(rows: list[dict], args) -> str:
    lines = ["| world | stage | system | offload | step ms (median) | vs zerogpt none (paired median [IQR], ms) | "
             "vs DeepSpeed same offload (paired) | max rel loss diff vs zerogpt none | "
             "model state MiB device / host / disk (rank 0) | h2d / d2h MiB per step (rank 0) |",
             "|---:|---:|---|---|---:|---:|---:|---:|---|---:|"]
    by_key = {(r["world"], r["system"]): r for r in rows}
    for r in rows:
        name, stage, mode = r["system"].split(":")
        if "error" in r:
            lines.append(f"| {r['world']} | {stage} | {name} | {mode} | failed: {r['error']} | | | | | |")
            continue
        base = by_key.get((r["world"], f"zerogpt:{stage}:none"))
        ds = by_key.get((r["world"], f"deepspeed:{stage}:{mode}"))
        vs_none, vs_ds, dloss = "", "", ""
        if base and "error" not in base and r is not base:
            ratio, q1, q3, extra_ms = _paired(r, base)
            vs_none = f"{ratio:.2f}x [{q1:.2f}-{q3:.2f}] ({extra_ms:+,.0f} ms)"
            dloss = f"{max(abs(a - b) / b for a, b in zip(r['losses'], base['losses'])):.1e}"
        if name == "zerogpt" and ds and "error" not in ds:
            ratio = _paired(ds, r)[0]
            vs_ds = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        mem = " / ".join(f"{r['mem_mib'].get(h, 0):,.1f}" for h in ("device", "host", "disk")) if r["mem_mib"] else "n/a"
        traffic = f"{r['h2d_bytes'] / 2**20:,.2f} / {r['d2h_bytes'] / 2**20:,.2f}" if "h2d_bytes" in r else "n/a"
        lines.append(f"| {r['world']} | {stage} | {name} | {mode} | {r['median_s'] * 1e3:,.0f} | {vs_none} | "
                     f"{vs_ds} | {dloss} | {mem} | {traffic} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# GPU only: the largest GPT that trains on this GPU with CPU offload

GPU_LADDER = [  # (name, n_layer, n_embd, n_head): GPT-2 sizes, then GPT-3-style widths
    ("gpt2_xl 1.5B", 48, 1600, 25), ("2.7B", 32, 2560, 32), ("6.7B", 32, 4096, 32),
    ("13B", 40, 5120, 40), ("20B", 44, 6144, 48),
]


def gpu_largest(args) -> list[dict]:
    """Stage 3, bf16, CPU optimizer + param offload, activation checkpointing, micro-batch 1 x seq.

    Climbs the ladder until a size fails (device OOM, host RAM) and reports each size's step time.
    """
    import zerogpt
    from model_zoo.gpt import GPTLMLoss
    from zerogpt_tools.estimate import model_state_bytes
    from zerogpt.optim import HybridAdam

    host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = []
    for name, n_layer, n_embd, n_head in GPU_LADDER:
        with torch.device("meta"):
            numel = sum(p.numel() for p in build_model("", args.gpu_seq, n_layer=n_layer, n_embd=n_embd,
                                                       n_head=n_head).parameters())
        # host RAM: the fp32 model as built (4 B/param) + offloaded model states; the kernel's OOM killer
        # would end the whole run instead of raising, so stop before a size that cannot fit
        states = model_state_bytes(numel, 3, 1, "bf16", "cpu", "cpu")
        host_need = 4 * numel + sum(states[c]["host"] for c in states)
        if host_need > 0.9 * host_ram:
            rows.append(dict(model=name, params=numel, error=f"needs ~{host_need / 2**30:.0f} GiB host RAM, "
                                                             f"machine has {host_ram / 2**30:.0f} GiB"))
            print(f"  {name}: skipped ({rows[-1]['error']})", flush=True)
            break
        try:
            model = build_model("", args.gpu_seq, checkpoint=True, n_layer=n_layer, n_embd=n_embd, n_head=n_head)
            zero = dict(stage=3, offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu"))
            engine = zerogpt.initialize(model, HybridAdam(model.parameters(), lr=LR),
                                        config=zerogpt.Config(dict(zero=zero, precision="bf16")),
                                        ctx=DistContext.current())
            engine.logger.setLevel("WARNING")
            times = []
            for i in range(3):
                tokens = torch.randint(0, 50257, (1, args.gpu_seq + 1), device="cuda")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step_s = statistics.median(times[1:])
            rows.append(dict(model=name, params=numel, step_s=step_s, tokens_per_s=args.gpu_seq / step_s,
                             peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30))
            print(f"  {name}: {numel / 1e9:.2f}B params, {step_s:.2f} s/step, peak GPU "
                  f"{rows[-1]['peak_gpu_gib']:.1f} GiB", flush=True)
            engine.close()
            del engine, model
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        except (torch.cuda.OutOfMemoryError, RuntimeError, MemoryError) as e:
            rows.append(dict(model=name, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            print(f"  {name}: failed ({rows[-1]['error']})", flush=True)
            break
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2_4l256", choices=list(MODELS))
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--world", nargs="+", type=int, default=[1, 2], help="rank counts to run (one run each)")
    p.add_argument("--batch", type=int, default=2, help="micro-batch per rank (sequences)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--device-budget", type=lambda v: v if v == "auto" else int(v), default=0,
                   help="cpu+param: zero.offload_param.device_budget, bytes or 'auto' (param shards kept on the device)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per system")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="skip DeepSpeed ZeRO-Offload")
    p.add_argument("--disk-path", default=None, help="directory for disk offload (default: the temp dir)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--gpu-seq", type=int, default=1024, help="GPU section: sequence length")
    p.add_argument("--port", type=int, default=29547)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine; the GPU section did not run "
                         "(run without --device for the CPU table)")

    rows = []
    worlds, threads = args.world, args.threads
    for world in worlds:
        args.world, args.threads = world, threads or max(1, (os.cpu_count() or 1) // world)
        print(f"world {world} x {args.threads} thread(s): "
              + ", ".join(s for st in args.stages for s in systems_for(st, args)), flush=True)
        for system, res in run_world(args).items():
            row = {"world": world, "threads": args.threads, "system": system, **res}
            if "error" not in res:
                row["median_s"] = statistics.median(res["times"])
            rows.append(row)
    args.world, args.threads = worlds, threads
    order = {s: i for i, s in enumerate(s for st in args.stages for s in systems_for(st, args))}
    rows.sort(key=lambda r: (r["world"], order[r["system"]]))
    print(f"\nmodel {args.model}, micro-batch {args.batch} x {args.seq} tokens per rank x {args.accum} micro-steps, "
          f"{args.device}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print(report(rows, args))
    gpu_rows = []
    if args.device == "cuda":
        print("\nGPU: largest GPT that trains with CPU optimizer + param offload (stage 3, bf16, checkpointing)")
        gpu_rows = gpu_largest(args)
    if args.json:
        write_json_atomic(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                      "gpu": gpu_rows})


if __name__ == "__main__":
    main()
