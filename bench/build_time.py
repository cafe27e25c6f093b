"""Build seconds: zerogpt's initialize of a meta-built GPT beside DeepSpeed's zero.Init + initialize (issue 30.4).

    python bench/build_time.py                          # GPT-2 16 x 1536 (532M), CPU, one gloo rank
    python bench/build_time.py --layers 8 --systems zerogpt

Each system builds the same GPT-2 (vocab 50257) for stage 3 with parameters and Adam state on the host, fp32,
in a fresh process (one rank, gloo), as the largest-model runs do: zerogpt from a model built on the meta device
(each shard filled by GPT.init_param_range), DeepSpeed from the model built under deepspeed.zero.Init with
offload_param and offload_optimizer to the CPU (DeepSpeedCPUAdam). Timed: from before the model's construction
to initialize() returning, so each system's init of the values is inside. Printed: seconds, the peak RSS of the
process, and the ratio zerogpt / DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from zerogpt.atomic_write import write_json_atomic  # noqa: E402


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _gpt_config(args):
    from model_zoo.gpt import GPTConfig

    return GPTConfig(n_layer=args.layers, n_head=args.hidden // 64, n_embd=args.hidden, vocab_size=50257,
                     max_position_embeddings=args.seq)


def build_zerogpt(args) -> float:
    import torch

    import zerogpt
    from model_zoo.gpt import GPT
    from zerogpt.context import DistContext
    from zerogpt.optim import HybridAdam

    cfg = zerogpt.Config(dict(precision="fp32", host=dict(cpu_adam=args.cpu_adam),
                              zero=dict(stage=3, offload_param=dict(device="cpu"),
                                        offload_optimizer=dict(device="cpu"))))
    HybridAdam([torch.nn.Parameter(torch.zeros(1))], backend=args.cpu_adam)  # the kernel loaded outside the timing
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_gpt_config(args))
    engine = zerogpt.initialize(model, dict(type=HybridAdam, lr=1e-4), config=cfg, ctx=DistContext.current())
    seconds = time.perf_counter() - start
    engine.close()
    return seconds


def build_deepspeed(args) -> float:
    import deepspeed
    import torch

    from model_zoo.gpt import GPT

    from deepspeed.ops.adam import DeepSpeedCPUAdam
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # the op loaded outside the timing, as zerogpt's
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": False}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    start = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=False):
        model = GPT(_gpt_config(args))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seconds = time.perf_counter() - start
    getattr(engine, "destroy", lambda: None)()
    return seconds


def _worker(system: str, args, init_file: str, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
        seconds = (build_zerogpt if system == "zerogpt" else build_deepspeed)(args)
        queue.put(dict(system=system, seconds=seconds, peak_rss=_peak_rss()))
    except Exception as e:  # reported, not raised: the other system still runs
        queue.put(dict(system=system, error=f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(system: str, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_worker, args=(system, args, os.path.join(tmp, "rendezvous"), queue))
        proc.start()
        proc.join(args.timeout)
        if proc.is_alive():
            proc.kill()
            return dict(system=system, error=f"timed out after {args.timeout} s")
    return queue.get() if not queue.empty() else dict(system=system, error=f"exit code {proc.exitcode}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--seq", type=int, default=64, help="max_position_embeddings (the positions table)")
    p.add_argument("--systems", nargs="+", default=["zerogpt", "deepspeed"], choices=["zerogpt", "deepspeed"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--cpu-adam", default="auto", choices=["auto", "deepspeed", "torch"], help="zerogpt's kernel")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = {}
    for system in args.systems:
        r = run(system, args)
        results[system] = r
        print(json.dumps(r), flush=True)
    ok = {s: r for s, r in results.items() if "seconds" in r}
    summary = dict(layers=args.layers, hidden=args.hidden, threads=args.threads, results=results)
    if len(ok) == 2:
        summary["ratio"] = ok["zerogpt"]["seconds"] / ok["deepspeed"]["seconds"]
        print(f"build seconds, GPT-2 {args.layers} x {args.hidden}: zerogpt {ok['zerogpt']['seconds']:.1f} s, "
              f"DeepSpeed {ok['deepspeed']['seconds']:.1f} s, ratio zerogpt / DeepSpeed = {summary['ratio']:.2f}")
    if args.json:
        write_json_atomic(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
