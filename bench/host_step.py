"""The offloaded optimizer's host step in ns per parameter, against DeepSpeed's CPU Adam op alone on the same
tensors (issue 29 point 3: the op alone is the floor; goal: the engine's host step <= 1.2x of it).

    python bench/host_step.py                        # 64M-element shards x 4, then a 124M-param engine step
    python bench/host_step.py --shard-m 16 --shards 2 --engine-layers 2 --json out.json

Kernel rows step the same fp32 master shards (gradients fp32, the compute copy bf16, as in a bf16 run with
parameters offloaded), each contender with its own state, interleaved round by round so background load hits all
alike; best and median of the rounds:
- "deepspeed op alone": DeepSpeed's cpu_adam adam_update over (master, grad, m, v): the floor.
- "deepspeed op + passes": what the engine did before the fused op: unscale/clip pass over the gradient, the op,
  then a cast pass of the master into the compute copy.
- "zerogpt fused, fp32 moments" / "bf16 moments": zerogpt/optim/host_adam.py, all of it in one pass.
The engine row times `ShardedOptimizer.step()` of a real stage-3 engine with parameters and optimizer offloaded,
bf16, clipping on (grad norm, non-finite check, per-slot weight decay and the fused chunk steps), per parameter,
each step right after DeepSpeed's op alone on shards of the engine's sizes (its own floor, under the same load).
The norm of each chunk's gradient is taken at its hand-over, in backward (on a GPU: on the device), so the step
does not include it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerogpt.atomic_write import write_json_atomic  # noqa: E402
from zerogpt.optim.cpu_adam import _load_deepspeed_op  # noqa: E402
from zerogpt.optim.host_adam import host_adam_step  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# The bench's own optimizer id in DeepSpeed's op: far from CPUAdam's ids (0, 1, ...), which an engine's
# optimizers destroy when they are collected
BENCH_OPT_ID = 1_000_000
FLOOR = "deepspeed op alone"


class Shards:
    """One contender's tensors: fp32 masters and moments (or bf16 moments), bf16 compute copies; shared grads."""

    def __init__(self, grads: list[torch.Tensor], moments: torch.dtype) -> None:
        self.grads = grads
        self.master = [torch.randn_like(g) for g in grads]
        self.m = [torch.zeros_like(g, dtype=moments) for g in grads]
        self.v = [torch.zeros_like(g, dtype=moments) for g in grads]
        self.out = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
        self.step_count = 0


def deepspeed_step(s: Shards, op, passes: bool) -> None:
    s.step_count += 1
    b1, b2 = HYPER["betas"]
    for master, grad, m, v, out in zip(s.master, s.grads, s.m, s.v, s.out):
        if passes:
            grad.mul_(1.0)  # the clip factor's pass (a multiply by 1.0 keeps the shared gradients unchanged)
        op.adam_update(BENCH_OPT_ID, s.step_count, HYPER["lr"], b1, b2, HYPER["eps"], HYPER["weight_decay"], True,
                       master, grad, m, v)
        if passes:
            out.copy_(master)


def fused_step(s: Shards) -> None:
    s.step_count += 1
    for i, (master, grad, m, v, out) in enumerate(zip(s.master, s.grads, s.m, s.v, s.out)):
        host_adam_step(master, grad, m, v, step=s.step_count, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                       weight_decay=HYPER["weight_decay"], adamw=True, grad_scale=1.0, out=out, seed=i)


def kernel_rows(shard_numel: int, shards: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each contender over the same gradients, interleaved."""
    op = _load_deepspeed_op()[0]
    if op is None:
        raise SystemExit("DeepSpeed's cpu_adam op did not build here: install deepspeed and ninja (it is the floor)")
    op.create_adam(BENCH_OPT_ID, HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"], True, False)
    grads = [torch.randn(shard_numel) for _ in range(shards)]
    contenders = {
        FLOOR: (Shards(grads, torch.float32), lambda s: deepspeed_step(s, op, passes=False)),
        "deepspeed op + passes": (Shards(grads, torch.float32), lambda s: deepspeed_step(s, op, passes=True)),
        "zerogpt fused, fp32 moments": (Shards(grads, torch.float32), fused_step),
        "zerogpt fused, bf16 moments": (Shards(grads, torch.bfloat16), fused_step),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for shards_, step in contenders.values():
        step(shards_)  # warm: first-touch of the state pages
    for _ in range(rounds):
        for name, (shards_, step) in contenders.items():
            start = time.perf_counter()
            step(shards_)
            times[name].append(time.perf_counter() - start)
    return times


def engine_row(layers: int, rounds: int, state_dtype: str) -> tuple[int, list[float], list[float]]:
    """(params, seconds per ShardedOptimizer.step(), seconds of the floor) of a stage-3 fully offloaded bf16
    GPT-2-small-width engine. Each step is timed right after DeepSpeed's op alone on shards of the engine's own
    sizes, so both see the same background load."""
    import zerogpt
    from model_zoo.gpt import GPT, GPTConfig
    from tests.zero.reference import cpu_ctx
    from zerogpt.optim import HybridAdam

    op = _load_deepspeed_op()[0]
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=12, n_embd=768, vocab_size=50257, max_position_embeddings=64))
    cfg = dict(precision="bf16", clip_grad_norm=1.0, zero=dict(
        stage=3, offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu", state_dtype=state_dtype)))
    engine = zerogpt.initialize(model, dict(type=HybridAdam, **HYPER), config=cfg, ctx=cpu_ctx())
    tokens = torch.randint(0, 50257, (1, 17), generator=torch.Generator().manual_seed(0))
    floor = Shards([torch.randn(s.master.numel()) for s in engine.sharded_optim.states.values()], torch.float32)
    times, floor_times = [], []
    for i in range(rounds + 1):
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()))
        start = time.perf_counter()
        deepspeed_step(floor, op, passes=False)
        middle = time.perf_counter()
        engine.sharded_optim.step()
        if i:  # the first step faults its state pages in
            floor_times.append(middle - start)
            times.append(time.perf_counter() - middle)
        engine.zero_grad()
    params = engine.num_params()
    engine.close()
    return params, times, floor_times


def paired_ratio(times: list[float], floor_times: list[float]) -> float:
    """The median over rounds of (this round's time / the floor's in the same round): the machine's speed drifts
    between rounds, and a ratio of bests taken from different rounds carries that drift."""
    return statistics.median(t / f for t, f in zip(times, floor_times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shard-m", type=int, default=64, help="millions of elements per shard")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine-layers", type=int, default=12, help="0 skips the engine row")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    n = args.shard_m * 1_000_000 * args.shards
    times = kernel_rows(args.shard_m * 1_000_000, args.shards, args.rounds)
    floor = min(times[FLOOR]) / n * 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.shards} shards x {args.shard_m}M")
    print("| host step | ns/param best (median) | x DeepSpeed op alone: best / best (median of the rounds' ratios) |"
          "\n|---|---:|---:|")
    rows = []
    for name, ts in times.items():
        best, median = min(ts) / n * 1e9, statistics.median(ts) / n * 1e9
        paired = paired_ratio(ts, times[FLOOR])
        rows.append(dict(step=name, params=n, ns_per_param_best=best, ns_per_param_median=median,
                         x_floor=best / floor, x_floor_paired_median=paired))
        print(f"| {name} | {best:.3f} ({median:.3f}) | {best / floor:.2f}x ({paired:.2f}x) |", flush=True)
    for state_dtype in ("fp32", "bf16") if args.engine_layers else ():
        params, ts, floor_ts = engine_row(args.engine_layers, args.rounds, state_dtype)
        best, median = min(ts) / params * 1e9, statistics.median(ts) / params * 1e9
        own_floor = min(floor_ts) / params * 1e9
        paired = paired_ratio(ts, floor_ts)
        name = f"engine ShardedOptimizer.step, {params / 1e6:.0f}M params, {state_dtype} moments"
        rows.append(dict(step=name, params=params, ns_per_param_best=best, ns_per_param_median=median,
                         x_floor=best / own_floor, x_floor_paired_median=paired, floor_ns_per_param=own_floor))
        print(f"| {name} | {best:.3f} ({median:.3f}) | {best / own_floor:.2f}x ({paired:.2f}x) of its own floor "
              f"run beside it, {own_floor:.3f} |", flush=True)
    if args.json:
        write_json_atomic(args.json, dict(threads=torch.get_num_threads(), floor_ns_per_param=floor, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
