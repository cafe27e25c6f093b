"""Tensor (TP2) and pipeline (PP2) parallelism beside ZeRO-3 and DDP: step time and per-rank peak memory.

    python bench/model_parallel.py                        # 2 gloo ranks on the CPU, GPT-2 6L-384, seq 256
    python bench/model_parallel.py --steps 6 --json /tmp/model_parallel.json

Every system trains the same model (GPT-2, dropout 0, fp32) from the same weights on the same global batch of
`--global-batch` sequences per optimizer step, with AdamW, one thread per rank:

    ddp        torch DDP, D=2: each rank half the batch, the whole model and optimizer state
    zerogpt-3  ZeRO-3, D=2: each rank half the batch, a half of every parameter, gradient and optimizer state
    tp2        zerogpt, T=2, D=1: each rank the whole batch, half of every matmul (Megatron's layout, DTensor)
    tp2-sp     tp2 with Megatron's sequence parallelism: between the matmuls, half of every sequence per rank
    pp2        zerogpt, P=2, D=1: half the layers per rank, the batch as `--micro-batches` micro-batches
               through torch's 1F1B schedule (the accumulation micro-batches, so the step is the same size)

Reported per system: the median step time after warm-up (forward, backward, optimizer step, communication;
every rank's step ends at a barrier), global tokens/s, the ratio to DDP's step time, and per rank: the
model-state bytes (parameters, gradients, fp32 masters and optimizer state, where they live) and the peak
resident memory of the process (ru_maxrss; the whole process: Python, torch, activations and buffers).
The loss of the first step is printed too: all of them compute the same step, so it must agree.

One GPU cannot show TP or PP: each needs a rank per device (NCCL refuses two ranks on one GPU). On a GPU
machine with several devices run it with `--device cuda`.
"""
from __future__ import annotations

import argparse
import os
import resource
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

SYSTEMS = ["ddp", "zerogpt-3", "tp2", "tp2-sp", "pp2"]
MODELS = {"gpt2_6l384": dict(n_layer=6, n_head=6, n_embd=384), "gpt2_small": dict(n_layer=12, n_head=12, n_embd=768),
          "gpt2_tiny": dict(n_layer=2, n_head=2, n_embd=64)}  # tiny: the smoke run of tests/test_bench.py
VOCAB = 50257
LR = 1e-4


def build_model(args) -> torch.nn.Module:
    from model_zoo.gpt import gpt2_small

    torch.manual_seed(0)
    return gpt2_small(**MODELS[args.model], dropout=0.0, max_position_embeddings=args.seq)


def global_batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (args.global_batch, args.seq + 1), generator=g)


def criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from model_zoo.gpt import GPTLMLoss

    return GPTLMLoss(shift=False)(logits, labels)


def adam_bytes(model: torch.nn.Module) -> dict:
    """A plain torch model's model state after a step: fp32 params, grads and Adam's two moments."""
    n = sum(p.numel() for p in model.parameters())
    return {"params": 4 * n, "grads": 4 * n, "master": 0, "optimizer": 8 * n}


def engine_bytes(engine) -> dict:
    return {category: sum(homes.values()) for category, homes in engine.memory_stats().items()}


def make_ddp(args, rank: int, world: int):
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(args)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per = args.global_batch // world

    def step(tokens: torch.Tensor) -> torch.Tensor:
        mine = tokens[rank * per:(rank + 1) * per]
        loss = criterion(ddp(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, lambda: adam_bytes(model)


def make_zero3(args, rank: int, world: int):
    import zerogpt

    with torch.device("meta"):  # as train_gpt builds it: each rank fills only its shards (DESIGN §7)
        model = build_model(args)
    cfg = zerogpt.Config(dict(zero=dict(stage=3), precision="fp32"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), criterion=criterion,
                                config=cfg, ctx=DistContext.current())
    per = args.global_batch // world

    def step(tokens: torch.Tensor) -> torch.Tensor:
        mine = tokens[rank * per:(rank + 1) * per]
        loss = criterion(engine(mine[:, :-1]), mine[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.detach()

    return step, lambda: engine_bytes(engine)


def make_model_parallel(args, tp: int, pp: int, sequence_parallel: bool = False):
    import zerogpt
    from zerogpt.parallel import ParallelDims
    from zerogpt.parallel.pipeline import Pipeline
    from zerogpt.parallel.plan import parallelize

    ctx = DistContext.current(args.device).with_mesh(ParallelDims(tp=tp, pp=pp, dp=1).build_mesh(args.device))
    parallel = parallelize(build_model(args), ctx.mesh, sequence_parallel)
    accum = args.micro_batches if pp > 1 else 1
    cfg = zerogpt.Config(dict(zero=dict(stage=1), precision="fp32", GRADIENT_ACCUMULATION=accum))
    engine = zerogpt.initialize(parallel, torch.optim.AdamW(parallel.module.parameters(), lr=LR), criterion,
                                config=cfg, ctx=ctx)
    pipeline = Pipeline(engine) if pp > 1 else None

    def step(tokens: torch.Tensor) -> torch.Tensor:
        if pipeline is not None:
            loss = pipeline.train_step([(t[:, :-1], t[:, 1:]) for t in tokens.chunk(accum)])
            pipeline.from_last_stage(loss)
        else:
            with engine.loss_context():
                loss = engine.criterion(engine(tokens[:, :-1]), tokens[:, 1:])
                engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.detach()

    return step, lambda: engine_bytes(engine)


def make_system(system: str, args, rank: int, world: int):
    if system == "ddp":
        return make_ddp(args, rank, world)
    if system == "zerogpt-3":
        return make_zero3(args, rank, world)
    if system == "tp2":
        return make_model_parallel(args, 2, 1)
    if system == "tp2-sp":
        return make_model_parallel(args, 2, 1, sequence_parallel=True)
    if system == "pp2":
        return make_model_parallel(args, 1, 2)
    raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")


def _worker(rank: int, world: int, args, init_file: str, system: str, queue) -> None:
    from zerogpt.host_memory import keep_freed_host_memory

    keep_freed_host_memory()  # every system on the same allocator (zerogpt's host policy; see step_time.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    try:
        step, state_bytes = make_system(system, args, rank, world)
        times, first_loss = [], None
        for i in range(args.warmup + args.steps):
            tokens = global_batch(i, args).to(args.device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(tokens)
            if args.device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            if i == 0:
                first_loss = float(loss)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        if args.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
        queue.put((rank, {"times": times, "first_loss": first_loss, "state_bytes": state_bytes(),
                          "peak_bytes": peak}))
    finally:
        dist.destroy_process_group()


def run_system(system: str, args) -> list[dict]:
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, args, os.path.join(tmp, "rdzv"), system, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.time() + args.timeout
        while len(results) < world:
            if time.time() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{system}: a rank failed or timed out (exit codes {[p.exitcode for p in procs]})")
            try:
                rank, out = queue.get(timeout=1)
                results[rank] = out
            except Exception:
                continue
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def summarize(system: str, ranks: list[dict], args) -> dict:
    step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))  # the slowest rank
    return {"system": system, "step_s": step, "tokens_per_s": args.global_batch * args.seq / step,
            # D=2 systems: each rank's loss is of its half of the batch; T=2 and P=2: every rank has the whole one
            "first_loss": statistics.mean(r["first_loss"] for r in ranks) if system in ("ddp", "zerogpt-3")
            else ranks[0]["first_loss"],
            "state_mib": [sum(r["state_bytes"].values()) / 2**20 for r in ranks],
            "peak_mib": [r["peak_bytes"] / 2**20 for r in ranks]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2_6l384")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (all ranks)")
    p.add_argument("--micro-batches", type=int, default=4, help="pp2: micro-batches per step through the pipeline")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per system before it counts as hung")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        p.error("--device cuda needs 2 GPUs: TP and PP put one rank on each (one GPU cannot show them)")
    if args.global_batch % (2 * args.micro_batches):
        p.error(f"--global-batch {args.global_batch} must divide by 2 (D=2) and by --micro-batches {args.micro_batches}")

    rows = []
    for system in args.systems:
        rows.append(summarize(system, run_system(system, args), args))
        print(f"  {system}: done", file=sys.stderr)
    ddp = next((r for r in rows if r["system"] == "ddp"), None)
    print(f"model {args.model}, seq {args.seq}, global batch {args.global_batch} sequences, 2 ranks on {args.device}, "
          f"{args.steps} timed steps")
    print(f"{'system':<10} {'step s':>8} {'tok/s':>8} {'vs DDP':>7} {'1st loss':>9} "
          f"{'state MiB r0/r1':>17} {'peak MiB r0/r1':>17}")
    for r in rows:
        ratio = f"{r['step_s'] / ddp['step_s']:.2f}x" if ddp else "-"
        state = "/".join(f"{m:.0f}" for m in r["state_mib"])
        peak = "/".join(f"{m:.0f}" for m in r["peak_mib"])
        print(f"{r['system']:<10} {r['step_s']:>8.3f} {r['tokens_per_s']:>8.0f} {ratio:>7} {r['first_loss']:>9.4f} "
              f"{state:>17} {peak:>17}")
    losses = [r["first_loss"] for r in rows]
    agree = max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    print(f"first-step losses agree within 1e-4 (the same step computed {len(rows)} ways): {'yes' if agree else 'NO'}")
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "rows": rows})
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
