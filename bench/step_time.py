"""Training step time: zerogpt ZeRO stages 1/2/3 beside DeepSpeed ZeRO 1/2/3, PyTorch FSDP2 and DDP, in one run.

    python bench/step_time.py                               # 6L-384 GPT-2 and gpt2_small, 2 gloo ranks, CPU
    python bench/step_time.py --models gpt2_6l384 --steps 4 --json /tmp/step_time.json
    python bench/step_time.py --device cuda --world 1 ...    # on a GPU machine (NCCL for world > 1)

Every system trains the same model (GPT-2, dropout 0, fp32 on CPU / bf16 on CUDA) on the same random
tokens with AdamW, one rank per process, one thread per rank (2 ranks = the 2 cores of the CI VM). Each
system's step is forward + backward + optimizer step and includes its communication.

The compute floor is one rank's share of the compute (same micro-batch, forward + backward + AdamW) in
plain torch with no communication, on one process while the others wait: the best a data-parallel
system can do. `floor2` is that compute on every rank at once: what sharing the machine's cores and
memory bandwidth costs before any byte is exchanged. Both floors are measured inside every system's job,
on the same processes, interleaved step by step with the system's own steps (the order rotating), so a
shared machine's slow spells hit a system and its floors alike. Reported per system: median step time
(after warm-up; with `--rounds R`, over all R runs on fresh processes, in alternating order), global
tokens/s, and the paired ratios: the median over steps of (system step / the floor steps beside it).
"vs DeepSpeed" divides DeepSpeed's paired ratio by zerogpt's at the same stage, so it is drift-free too.

Host memory: zerogpt keeps freed host memory in the process (zerogpt/host_memory.py), which makes CPU
steps much faster. So that no system and no floor gets an allocator the others lack, every process of
every job gets that same setting by default (`--host-memory keep`); `--host-memory default` runs all of
them, zerogpt included, on glibc's default malloc.
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

MODELS = {
    "gpt2_6l384": dict(n_layer=6, n_head=6, n_embd=384),
    "gpt2_small": dict(n_layer=12, n_head=12, n_embd=768),
}
SYSTEMS = ["ddp", "fsdp2", "deepspeed-1", "zerogpt-1", "deepspeed-2", "zerogpt-2", "deepspeed-3", "zerogpt-3"]
GLOO_SYSTEMS = ["zerogpt-1-gloo", "zerogpt-2-gloo", "zerogpt-3-gloo"]  # on request: ranks' comm over gloo, not /dev/shm
LR = 1e-4


def build_model(name: str, seq: int, device: str) -> torch.nn.Module:
    from model_zoo.gpt import gpt2_small

    torch.manual_seed(0)
    return gpt2_small(**MODELS[name], dropout=0.0, max_position_embeddings=seq).to(device)


def batch(rank: int, step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)


def loss_of(model, tokens: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    from model_zoo.gpt import GPTLMLoss

    tokens = tokens.to(device)
    with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens[:, :-1])
    return GPTLMLoss(shift=False)(logits, tokens[:, 1:])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


# -------------------------------------------------------------------------------------------------
# one function per system: build, then return a step() that trains on one micro-batch

def make_plain(model, args, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)  # the fastest plain-torch Adam, CPU too

    def step(tokens):
        loss = loss_of(model, tokens, args.device, args.dtype)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def make_ddp(model, args, rank):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[rank] if args.device == "cuda" else None)
    return make_plain(ddp, args, rank)


def make_fsdp2(model, args, rank):
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return make_plain(model, args, rank)


def make_deepspeed(model, args, rank, stage):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": 25_000_000, "allgather_bucket_size": 25_000_000},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
              "bf16": {"enabled": args.dtype == torch.bfloat16}}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(tokens):
        tokens = tokens.to(engine.device)
        from model_zoo.gpt import GPTLMLoss
        loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step


def make_zerogpt(model, args, rank, stage):
    import zerogpt
    from model_zoo.gpt import GPTLMLoss

    precision = "bf16" if args.dtype == torch.bfloat16 else "fp32"
    cfg = zerogpt.Config(dict(zero=dict(stage=stage), precision=precision))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg,
                                ctx=DistContext.current())
    engine.logger.setLevel("WARNING")

    def step(tokens):
        tokens = tokens.to(args.device)
        loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss
    return step


def make_system(system: str, model, args, rank):
    if system == "ddp":
        return make_ddp(model, args, rank)
    if system == "fsdp2":
        return make_fsdp2(model, args, rank)
    name, stage, *transport = system.split("-")
    if transport == ["gloo"]:
        os.environ["ZEROGPT_SHM_COMM"] = "0"
    return (make_deepspeed if name == "deepspeed" else make_zerogpt)(model, args, rank, int(stage))


# -------------------------------------------------------------------------------------------------
# timing

def time_system(rank: int, system: str, model_name: str, args) -> dict:
    """The system's steps interleaved with the two floors' (on a second, plain copy of the model)."""
    step = make_system(system, build_model(model_name, args.seq, args.device), args, rank)
    plain = make_plain(build_model(model_name, args.seq, args.device), args, rank)
    kinds = {"system": step, "floor": plain if rank == 0 else None, "floor2": plain}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    losses = []
    for i in range(args.warmup + args.steps):
        tokens = batch(rank, i, args)
        first = i % len(kinds)
        names = list(kinds)[first:] + list(kinds)[:first]  # rotate who goes first
        for kind in names:
            sync(args.device)
            t0 = time.perf_counter()
            loss = kinds[kind](tokens) if kinds[kind] is not None else None  # floor: the other ranks wait
            sync(args.device)
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - t0)
            if kind == "system":
                losses.append(loss.detach().item())
    return {"times": times["system"], "floor_times": times["floor"], "floor2_times": times["floor2"],
            "losses": losses}


def _worker(rank: int, world: int, args, init_file: str, system: str, model_name: str, queue,
            measure=None) -> None:
    torch.set_num_threads(args.threads)
    if args.host_memory == "keep":  # every system and floor on the same allocator: zerogpt's host-memory policy
        from zerogpt.host_memory import keep_freed_host_memory
        keep_freed_host_memory()
    else:  # glibc's default everywhere, zerogpt included
        os.environ["ZEROGPT_KEEP_HOST_MEMORY"] = "0"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = (measure or time_system)(rank, system, model_name, args)
    except Exception as e:  # report the failure in the table instead of dropping the run
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def run_job(args, system: str, model_name: str, measure=None) -> dict:
    """One system (and its floors) on fresh processes: nothing a previous system allocated or left
    initialised (DeepSpeed engines, FSDP state, allocator caches) can slow it down or run it out of RAM.
    `measure(rank, system, model_name, args) -> dict` replaces time_system (bench/step_memory.py)."""
    world = args.world
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="zerogpt-bench-"), "rdzv")
    procs = [ctx.Process(target=_worker, args=(r, world, args, init_file, system, model_name, queue, measure))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=args.timeout)
    except Exception:
        result = {"error": f"no result within {args.timeout:.0f}s (exit codes {[p.exitcode for p in procs]})"}
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return result


def merge_rounds(results: list[dict]) -> dict:
    """One system's rounds as one result: medians over every timed step of every round."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    merged = {key: [t for r in results for t in r[key]] for key in ("times", "floor_times", "floor2_times")}
    merged.update({f"vs_{floor}": statistics.median(s / f for s, f in zip(merged["times"], merged[f"{floor}_times"]))
                   for floor in ("floor", "floor2")})
    return {"median_s": statistics.median(merged["times"]), **merged, "losses": results[0]["losses"],
            "rounds": len(results)}


def report(rows: list[dict], args) -> str:
    tokens = args.batch * args.seq * args.world
    lines = ["| model | system | step ms (median) | tokens/s | vs DeepSpeed, same stage (paired) | "
             "vs compute floor (paired) | vs floor2 (paired) |", "|---|---|---:|---:|---:|---:|---:|"]
    ok = [r for r in rows if "error" not in r]
    for model in dict.fromkeys(r["model"] for r in rows):
        for floor, per_rank in (("floor", 1), ("floor2", args.world)):
            times = [t for r in ok if r["model"] == model for t in r[f"{floor}_times"]]
            if times:
                ms = statistics.median(times)
                lines.append(f"| {model} | {floor} (every job) | {ms * 1e3:,.0f} | "
                             f"{per_rank * args.batch * args.seq / ms:,.0f} | | | |")
    by_key = {(r["model"], r["system"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | failed: {r['error']} | | | | |")
            continue
        ds = by_key.get((r["model"], "deepspeed-" + r["system"].split("-")[1])) if "-" in r["system"] else None
        vs_ds = (f"{ds['vs_floor'] / r['vs_floor']:.2f}x faster" if r["system"].startswith("zerogpt") and ds
                 and "error" not in ds else "")
        lines.append(f"| {r['model']} | {r['system']} | {r['median_s'] * 1e3:,.0f} | {tokens / r['median_s']:,.0f} | "
                     f"{vs_ds} | {r['vs_floor']:.2f}x | {r['vs_floor2']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + GLOO_SYSTEMS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, in alternating order, on fresh processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--host-memory", default="keep", choices=["keep", "default"],
                   help="keep: every process (peers and floors too) keeps freed host memory the way zerogpt "
                        "does (zerogpt/host_memory.py); default: glibc malloc as is, zerogpt too")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")

    rows = []
    for model_name in args.models:
        runs: dict[str, list[dict]] = {system: [] for system in args.systems}
        for round_index in range(args.rounds):
            # Alternate the order so slow spells of a shared machine do not always hit the same systems.
            order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
            for system in order:
                result = run_job(args, system, model_name)
                runs[system].append(result)
                ms = statistics.median(result["times"]) * 1e3 if "times" in result else float("nan")
                print(f"round {round_index + 1}/{args.rounds} {model_name} {system}: {ms:,.0f} ms "
                      f"{result.get('error', '')}", flush=True)
        for system, results in runs.items():
            rows.append({"model": model_name, "system": system, **merge_rounds(results)})
    order = {s: i for i, s in enumerate(SYSTEMS + GLOO_SYSTEMS)}
    rows.sort(key=lambda r: (args.models.index(r["model"]), order[r["system"]]))
    print(f"\n{args.world} ranks x {args.threads} thread(s), micro-batch {args.batch} x {args.seq} tokens, "
          f"{args.device}, host memory {args.host_memory}, torch {torch.__version__}\n")
    print(report(rows, args))
    if args.json:
        write_json_atomic(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
