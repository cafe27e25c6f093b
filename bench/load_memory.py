"""Host memory while loading a Hugging Face Llama checkpoint at ZeRO-3: zerogpt's streaming load beside
transformers' from_pretrained + zerogpt and DeepSpeed's zero.Init + from_pretrained (issue 39 point 2).

    python bench/load_memory.py                       # a random 551M Llama (18 x 1536, GQA 24/8 heads, ffn 4096,
                                                      # vocab 32000, untied), bf16 files, 2 gloo ranks, CPU
    python bench/load_memory.py --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 176 --vocab 1024   # tiny

The checkpoint is a random transformers LlamaForCausalLM saved with save_pretrained in bf16 (as Llama ships), in
shards of --shard-mb, cached under --cache-dir and reused while its shape is the same. Four ways load it, each on
fresh processes (one per rank), all at ZeRO stage 3 with --precision compute and torch AdamW built on the model's
parameters (no offload: on a CPU run the "device" is the host):
  streaming        model_zoo.from_pretrained(DIR) on the meta device, then zerogpt.initialize, which fills each
                   rank's shards from the safetensors files (the native type="hf" path);
  hf+zerogpt       model_zoo.build_model(dict(type="hf", path=DIR, generic=True)): transformers' AutoModelForCausalLM
                   .from_pretrained on every rank, then zerogpt.initialize (the old type="hf" path);
  hf-fp32+zerogpt  the same with dtype=torch.float32, the dtype transformers 4 loaded in by default (5 keeps the
                   checkpoint's);
  deepspeed        transformers.integrations.HfDeepSpeedConfig(ds_config) made before from_pretrained, so
                   transformers builds under deepspeed.zero.Init and loads through rank 0, then deepspeed.initialize.
Measured on every rank: the loading phase only, from before the model is built to initialize's return. Each rank
first loads a tiny checkpoint the same way (TINY: imports, op loads and first-time setup are not the load), then
takes its resident memory as the baseline and resets the kernel's peak counter (/proc/self/clear_refs <- 5);
afterwards it reads the peak (VmHWM). Peak delta = peak - baseline, private to the rank (the shared-memory pages
it touched, RssShmem, are taken out as in bench/step_memory.py), over the parameter count. A thread samples
RssFile every 10 ms: the file-backed (mmap'd checkpoint) part of the peak, an estimate. Also printed: the resident
memory once the model is built (before initialize), after the load (held), the engine's own model state (zerogpt:
engine.memory_stats(); DeepSpeed: its parameter partitions, fp32 partitions and gradient partition buffer), and
the largest tensor in fp32, for the claim "host memory while loading stays within the engine's model state plus
about one tensor". Adam's moments are lazy in every way (torch creates them at the first step): none holds them.
Every process: glibc malloc with a 64 KiB mmap threshold, so resident memory follows what is live, and zerogpt's
keep-freed-host-memory setting off (as bench/step_memory.py). The deepspeed way needs accelerate (transformers'
DeepSpeed integration imports it); without it that row says so and the others run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
from zerogpt.atomic_write import write_json_atomic  # noqa: E402
from step_memory import _reset_peak, _status_bytes  # noqa: E402
from step_time import run_job  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WAYS = ["streaming", "hf+zerogpt", "hf-fp32+zerogpt", "deepspeed"]
LR = 1e-4
MIB = 2**20


# -------------------------------------------------------------------------------------------------
# the checkpoint

def llama_config(args):
    """model_zoo's LlamaConfig of the benchmark's shape (transformers' config is made from it)."""
    from model_zoo.llama import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_seq,
                       rms_norm_eps=1e-5, pad_vocab_multiple=1)


def write_checkpoint(args, dtype: torch.dtype = torch.bfloat16, shard_mb: int = 300) -> str:
    """A random transformers LlamaForCausalLM of args' shape saved with save_pretrained in `dtype`, under
    args.cache_dir (reused when one of the same shape, dtype and shard size is there). Built in `dtype` on the CPU:
    the model's own bytes once, plus what save_pretrained needs for one shard. Returns the directory."""
    from model_zoo.llama_adapter import hf_config

    name = (f"zerogpt-bench-llama-v{args.vocab}-h{args.hidden}-f{args.ffn}-l{args.layers}-a{args.heads}"
            f"-kv{args.kv_heads}-p{args.max_seq}-{str(dtype).removeprefix('torch.')}-s{shard_mb}")
    directory = os.path.join(args.cache_dir, name)
    done = os.path.join(directory, ".complete")
    if os.path.isfile(done):
        return directory
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(hf_config(llama_config(args)), dtype=dtype)
    model.save_pretrained(directory, max_shard_size=f"{shard_mb}MB")
    del model
    open(done, "w").close()
    return directory


def checkpoint_facts(directory: str) -> dict:
    """Parameter count and the largest tensor (elements), from the files' headers."""
    import math

    from model_zoo.safetensors_source import SafetensorsDir

    source = SafetensorsDir(directory)
    numels = {name: math.prod(source.shape(name)) for name in source.names()}
    largest = max(numels, key=numels.get)
    return dict(params=sum(numels.values()), largest=largest, largest_numel=numels[largest],
                files=len({source._file[n] for n in numels}), bytes=source.describe()["bytes"])


# -------------------------------------------------------------------------------------------------
# one function per way: load, return (engine, model-state bytes by the engine's own account, a note)

def _zerogpt_config(args):
    import zerogpt

    return zerogpt.Config(dict(zero=dict(stage=3), precision=args.precision))


def _zerogpt_state_bytes(engine) -> int:
    stats = engine.memory_stats()
    return sum(stats[c][h] for c in stats for h in ("device", "host"))


def _zerogpt_initialize(model, args, note: str):
    import zerogpt
    from zerogpt.context import DistContext

    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config=_zerogpt_config(args),
                                ctx=DistContext.current())
    return engine, _zerogpt_state_bytes(engine), note


def load_streaming(directory: str, args, built):
    from model_zoo import from_pretrained

    model = from_pretrained(directory)  # meta: no storage
    built()
    return _zerogpt_initialize(model, args, "meta build, each rank's shards read from the files")


def load_hf_zerogpt(directory: str, args, built, dtype: torch.dtype | None = None):
    from model_zoo import build_model

    kwargs = {} if dtype is None else dict(dtype=dtype)
    model = build_model(dict(type="hf", path=directory, generic=True, **kwargs))  # the whole model, on every rank
    built()
    return _zerogpt_initialize(model, args, f"transformers' model in {next(model.parameters()).dtype} "
                                            f"({'dtype=' + str(dtype) if dtype else 'its default dtype'})")


def deepspeed_config(args, stage: int = 3, batch: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 25_000_000, "allgather_bucket_size": 25_000_000},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": args.precision == "bf16"}}


def load_deepspeed(directory: str, args, built):
    """transformers' documented non-Trainer DeepSpeed ZeRO-3 integration: HfDeepSpeedConfig before from_pretrained."""
    import importlib.util

    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError("transformers' DeepSpeed integration (HfDeepSpeedConfig) needs accelerate, which is not "
                           "installed: pip install 'accelerate>=1.1.0', or run --ways streaming hf+zerogpt")
    config = deepspeed_config(args)
    keep = HfDeepSpeedConfig(config)  # noqa: F841 -- must stay alive while from_pretrained runs
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    built()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    return engine, _deepspeed_state_bytes(engine), f"zero.Init partitions in {engine.module.dtype}"


def _deepspeed_state_bytes(engine) -> int:
    """DeepSpeed ZeRO-3's model state on this rank from its tensors: the parameter partitions (ds_tensor), the fp32
    partitions the optimizer steps, and the gradient partition buffer it allocates at initialize (in the gradient
    accumulation dtype: bf16 under bf16)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is not None and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for p in engine.module.parameters():
        add(getattr(p, "ds_tensor", None))
    optimizer = engine.optimizer
    for t in getattr(optimizer, "fp16_partitioned_groups_flat", []):
        add(t)
    for t in getattr(optimizer, "fp32_partitioned_groups_flat", []):
        add(t)
    add(getattr(optimizer, "grad_partitions_flat_buffer", None))
    return total


LOADERS = {"streaming": load_streaming, "hf+zerogpt": load_hf_zerogpt, "deepspeed": load_deepspeed,
           "hf-fp32+zerogpt": lambda d, a, b: load_hf_zerogpt(d, a, b, torch.float32)}


def _close(engine) -> None:
    (getattr(engine, "close", None) or getattr(engine, "destroy", None) or (lambda: None))()


TINY = dict(vocab=256, hidden=32, ffn=64, layers=1, heads=2, kv_heads=1, max_seq=64)
"""The warm-up checkpoint's shape: each way loads it once before the baseline, so the libraries' lazy imports, op
loads, thread pools and the engines' first-time setup are not counted as the load."""


# -------------------------------------------------------------------------------------------------
# measuring one rank

class _FileRssSampler(threading.Thread):
    """The largest RssFile seen, every `interval` seconds: the mmap'd checkpoint pages in the peak (an estimate)."""

    def __init__(self, interval: float = 0.01):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _status_bytes("RssFile"))
            self.done.wait(self.interval)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _status_bytes("RssFile"))


def _private_rss() -> int:
    return _status_bytes("VmRSS") - _status_bytes("RssShmem")


def measure_load(rank: int, way: str, directory: str, args) -> dict:
    """This rank's load of `directory` by `way`; rank 0 returns every rank's numbers."""
    torch.manual_seed(0)
    engine, *_ = LOADERS[way](args.warm_dir, args, lambda: None)  # warm-up: see TINY
    _close(engine)
    del engine
    gc.collect()
    dist.barrier()
    base = _private_rss()
    base_file = _status_bytes("RssFile")
    after_build = []
    sampler = _FileRssSampler()
    sampler.start()
    _reset_peak()
    start = time.perf_counter()
    engine, state, note = LOADERS[way](directory, args, lambda: after_build.append(_private_rss() - base))
    seconds = time.perf_counter() - start
    peak_file = sampler.stop()
    shmem = _status_bytes("RssShmem")
    peak = _status_bytes("VmHWM") - shmem
    gc.collect()
    held = _status_bytes("VmRSS") - shmem
    mine = dict(rank=rank, peak_delta=peak - base, built=after_build[0], held=held - base, state=state,
                seconds=seconds, file_peak=max(0, peak_file - base_file), baseline=base, note=note)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    _close(engine)
    return {"ranks": every}


# -------------------------------------------------------------------------------------------------
# report

def report(rows: dict[str, dict], facts: dict, args) -> str:
    n = facts["params"]
    largest = facts["largest_numel"] * 4
    lines = ["| way | rank | peak delta (MiB) | **bytes/param** | of it file-backed (MiB, sampled) | model built "
             "(MiB) | held after (MiB) | engine model state (MiB) | state bytes/param | peak - state (MiB) | "
             "= largest fp32 tensors | load s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for way, result in rows.items():
        if "error" in result:
            lines.append(f"| {way} | | failed: {result['error']} | | | | | | | | | |")
            continue
        for r in result["ranks"]:
            over = r["peak_delta"] - r["state"]
            lines.append(f"| {way} | {r['rank']} | {r['peak_delta'] / MIB:,.0f} | **{r['peak_delta'] / n:.2f}** | "
                         f"{r['file_peak'] / MIB:,.0f} | {r['built'] / MIB:,.0f} | {r['held'] / MIB:,.0f} | "
                         f"{r['state'] / MIB:,.0f} | "
                         f"{r['state'] / n:.2f} | {over / MIB:,.0f} | {over / largest:.2f} | {r['seconds']:.1f} |")
    notes = [f"- {way}: {result['ranks'][0]['note']}" for way, result in rows.items() if "error" not in result]
    return "\n".join(lines + [""] + notes)


def ratios(rows: dict[str, dict], facts: dict) -> list[str]:
    """Peak bytes/param of each way over streaming's, per rank and for the largest rank."""
    base = rows.get("streaming")
    if not base or "error" in base:
        return []
    out = []
    for way in WAYS[1:]:
        r = rows.get(way)
        if not r or "error" in r:
            continue
        per_rank = [a["peak_delta"] / b["peak_delta"] for a, b in zip(r["ranks"], base["ranks"])]
        worst = max(a["peak_delta"] for a in r["ranks"]) / max(b["peak_delta"] for b in base["ranks"])
        out.append(f"peak host bytes/param, {way} / streaming: "
                   + ", ".join(f"rank {i} {x:.2f}x" for i, x in enumerate(per_rank))
                   + f"; largest rank {worst:.2f}x")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096, help="intermediate_size (SwiGLU)")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-seq", type=int, default=2048, help="max_position_embeddings (RoPE: no table)")
    p.add_argument("--shard-mb", type=int, default=300, help="save_pretrained's max_shard_size")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"],
                   help="compute dtype of every engine (the files are bf16 either way)")
    p.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "zerogpt-bench-cache"),
                   help="where the checkpoint is written once and reused")
    p.add_argument("--port", type=int, default=29577)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    # what step_time's workers read: CPU, one thread per rank, glibc's malloc with zerogpt's setting off
    args.device, args.threads, args.host_memory = "cpu", 1, "default"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc as each spawned rank starts
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    t0 = time.perf_counter()
    directory = write_checkpoint(args, torch.bfloat16, args.shard_mb)
    args.warm_dir = write_checkpoint(argparse.Namespace(**TINY, cache_dir=args.cache_dir), torch.bfloat16)
    facts = checkpoint_facts(directory)
    print(f"checkpoint {directory}: {facts['params'] / 1e6:,.1f}M params, {facts['bytes'] / MIB:,.0f} MiB in "
          f"{facts['files']} file(s) ({time.perf_counter() - t0:.0f} s to make or find); largest tensor "
          f"{facts['largest']} ({facts['largest_numel'] / 1e6:.1f}M elements)", flush=True)
    rows = {}
    for way in args.ways:
        rows[way] = run_job(args, way, directory, measure=measure_load)
        print(f"{way}: {json.dumps(rows[way])}", flush=True)
    print(f"\nZeRO-3, {args.world} gloo ranks x 1 thread, precision {args.precision}, torch AdamW (moments lazy), "
          f"{facts['params'] / 1e6:,.1f}M params, largest tensor in fp32 {facts['largest_numel'] * 4 / MIB:,.0f} MiB, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print(report(rows, facts, args))
    summary = ratios(rows, facts)
    print("\n" + "\n".join(summary))
    if args.json:
        write_json_atomic(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "checkpoint": facts,
                                      "rows": rows, "ratios": summary})
    return rows


if __name__ == "__main__":
    main()
