"""Training speed of the native Llama under zerogpt beside the same weights as transformers' LlamaForCausalLM under
zerogpt and under DeepSpeed, ZeRO stages 1-3, one run (issue 39 point 7).

    python bench/llama_speed.py                 # 8 x 512 Llama (GQA 8/4 heads, ffn 1408, vocab 32000), 2 gloo ranks
    python bench/llama_speed.py --stages 3 --steps 2 --systems native hf-zerogpt

One random transformers LlamaForCausalLM is saved with save_pretrained in fp32 (bench/load_memory.py's
write_checkpoint, cached under --cache-dir), and three systems train it from those files, fp32, torch AdamW (lr 1e-4),
on the same random tokens, one thread per rank:
  native        model_zoo.from_pretrained(DIR) (model_zoo/llama.py on meta, shards streamed) + zerogpt.initialize;
  hf-zerogpt    model_zoo.build_model(dict(type="hf", path=DIR, generic=True)): transformers' LlamaForCausalLM
                + zerogpt.initialize (the same engine: only the model differs);
  hf-deepspeed  transformers' LlamaForCausalLM + deepspeed.initialize at the same stage.
A step is forward + backward + optimizer step on one micro-batch, communication included. The three systems of one
stage are built side by side on the same two processes and stepped in turn, the order rotating, so a shared
machine's slow spells hit them alike; ratios are paired (per step, then the median). Reported per system: median
step time, global tokens/s, native's speed over the system's (other step time / native step time: above 1, native
is faster), the fastest step, the CPU seconds per step (process time, all threads; a step's is its busier rank's)
with the same ratio taken by CPU time, and the first step's loss (the same weights and tokens give the same loss:
a check that the three compute the same thing). Wall time swings with a shared machine's other jobs, CPU time much less; between the two zerogpt systems
(one engine, the same waits) the CPU-time ratio isolates the model's own cost. It does not compare engines: a wait
that spins counts as CPU time, one that sleeps does not. Every process keeps freed host memory the way zerogpt does
(bench/step_time.py's default).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
from zerogpt.atomic_write import write_json_atomic  # noqa: E402
from load_memory import deepspeed_config, write_checkpoint  # noqa: E402
from step_time import run_job, sync  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SYSTEMS = ["native", "hf-zerogpt", "hf-deepspeed"]
LR = 1e-4


def batch(rank: int, step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)


# -------------------------------------------------------------------------------------------------
# one function per system: build from the checkpoint, return step(tokens) -> loss and close()

def _zerogpt_step(engine):
    from model_zoo.loss import GPTLMLoss

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss
    return step, engine.close


def _zerogpt(model, stage: int):
    import zerogpt
    from zerogpt.context import DistContext

    model.train()  # from_pretrained hands transformers' models back in eval mode
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                config=zerogpt.Config(dict(zero=dict(stage=stage), precision="fp32")),
                                ctx=DistContext.current())
    engine.logger.setLevel("WARNING")
    return _zerogpt_step(engine)


def make_native(directory: str, stage: int, args):
    from model_zoo import from_pretrained

    return _zerogpt(from_pretrained(directory), stage)


def make_hf_zerogpt(directory: str, stage: int, args):
    from model_zoo import build_model

    return _zerogpt(build_model(dict(type="hf", path=directory, generic=True)), stage)


def make_hf_deepspeed(directory: str, stage: int, args):
    import deepspeed
    from transformers import AutoModelForCausalLM

    from model_zoo.loss import GPTLMLoss

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=deepspeed_config(argparse.Namespace(precision="fp32"), stage,
                                                              args.batch))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step, getattr(engine, "destroy", lambda: None)


MAKERS = {"native": make_native, "hf-zerogpt": make_hf_zerogpt, "hf-deepspeed": make_hf_deepspeed}


# -------------------------------------------------------------------------------------------------
# timing one stage on one pair of processes

def time_stage(rank: int, stage: str, directory: str, args) -> dict:
    """Build every system at this stage, step them in rotating order, tear them down."""
    built, results = {}, {}
    for system in args.systems:
        try:
            built[system] = MAKERS[system](directory, int(stage), args)
            results[system] = {"times": [], "cpu_times": [], "losses": []}
        except Exception as e:  # report the failure in the table instead of dropping the run
            results[system] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    names = list(built)
    for i in range(args.warmup + args.steps):
        tokens = batch(rank, i, args)
        first = i % max(1, len(names))
        for system in names[first:] + names[:first]:
            sync("cpu")
            t0, c0 = time.perf_counter(), time.process_time()
            loss = built[system][0](tokens)
            sync("cpu")
            if i >= args.warmup:
                results[system]["times"].append(time.perf_counter() - t0)
                results[system]["cpu_times"].append(time.process_time() - c0)
            results[system]["losses"].append(loss.item())
        if rank == 0:
            print(f"  stage {stage} step {i}: " + ", ".join(
                f"{s} {results[s]['times'][-1] * 1e3:,.0f} ms" for s in names if results[s]["times"]), flush=True)
    for system in names:
        built[system][1]()
        # a step's CPU time is its busier rank's: a rank that waits for the other sleeps in gloo (no CPU time)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, results[system]["cpu_times"])
        results[system]["cpu_times"] = [max(step) for step in zip(*every)]
    return results


# -------------------------------------------------------------------------------------------------
# report

def _paired(times: list[float], native: list[float]) -> tuple[float, float, float]:
    """Over steps, this system's time / native's: median, 25th and 75th percentile (the noise left after pairing)."""
    r = [a / b for a, b in zip(times, native)]
    q1, _, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else (r[0],) * 3
    return statistics.median(r), q1, q3


def report(by_stage: dict[int, dict], args) -> tuple[str, list[str]]:
    tokens = args.batch * args.seq * args.world
    lines = ["| stage | system | step ms (median) | tokens/s | native speed / this system's (paired median "
             "[IQR]) | fastest step ms | CPU s per step | native / this, by CPU time (paired) | first-step loss |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    summary = []
    for stage, results in by_stage.items():
        native = results.get("native", {})
        for system in args.systems:
            r = results.get(system, {"error": "not run"})
            if "error" in r:
                lines.append(f"| {stage} | {system} | failed: {r['error']} | | | | | | |")
                continue
            ms = statistics.median(r["times"])
            vs, vs_cpu = "", ""
            if system != "native" and "times" in native:
                ratio, q1, q3 = _paired(r["times"], native["times"])
                cpu_ratio = _paired(r["cpu_times"], native["cpu_times"])[0]
                vs, vs_cpu = f"{ratio:.2f}x [{q1:.2f}-{q3:.2f}]", f"{cpu_ratio:.2f}x"
                summary.append(f"stage {stage}: native / {system} tokens/s = {ratio:.2f}x (by CPU time "
                               f"{cpu_ratio:.2f}x)")
            lines.append(f"| {stage} | {system} | {ms * 1e3:,.0f} | {tokens / ms:,.0f} | {vs} | "
                         f"{min(r['times']) * 1e3:,.0f} | {statistics.median(r['cpu_times']):.2f} | {vs_cpu} | "
                         f"{r['losses'][0]:.6f} |")
        first = [results[s]["losses"][0] for s in args.systems if "losses" in results.get(s, {})]
        if len(first) > 1:
            spread = (max(first) - min(first)) / min(first)
            summary.append(f"stage {stage}: first-step losses agree within 1e-5 (relative): "
                           f"{'yes' if spread <= 1e-5 else 'NO'} (spread {spread:.1e})")
    return "\n".join(lines), summary


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408, help="intermediate_size (SwiGLU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per rank (sequences)")
    p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=6, help="timed steps per system and stage")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "zerogpt-bench-cache"),
                   help="where the checkpoint is written once and reused")
    p.add_argument("--port", type=int, default=29578)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    # what step_time's workers read: CPU, one thread per rank, zerogpt's host-memory setting in every process
    args.device, args.threads, args.host_memory = "cpu", 1, "keep"
    args.max_seq = max(args.seq, 64)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    directory = write_checkpoint(args, torch.float32, shard_mb=4096)
    print(f"checkpoint {directory}; systems {', '.join(args.systems)}; stages {args.stages}", flush=True)
    by_stage = {}
    for stage in args.stages:
        by_stage[stage] = run_job(args, str(stage), directory, measure=time_stage)
        if "error" in by_stage[stage]:
            by_stage[stage] = {s: by_stage[stage] for s in args.systems}
    from model_zoo import from_pretrained

    params = from_pretrained(directory).num_params()  # on the meta device: the count only
    print(f"\nLlama {args.layers} x {args.hidden} ({params / 1e6:.1f}M params), {args.world} gloo ranks x 1 thread, "
          f"micro-batch {args.batch} x {args.seq} tokens per rank, fp32, torch AdamW, torch {torch.__version__}\n")
    table, summary = report(by_stage, args)
    print(table + "\n\n" + "\n".join(summary))
    if args.json:
        write_json_atomic(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "params": params,
                                      "stages": by_stage, "summary": summary})
    return by_stage


if __name__ == "__main__":
    main()
