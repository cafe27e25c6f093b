"""Where a CPU rank's host RAM goes: load, build, forward, backward and step of a Hugging Face Llama at ZeRO-3 with
the optimizer and the parameters offloaded (issue 47 point 6, "the host-RAM gap").

    python bench/host_gap.py                                # 44.6M Llama (4 x 512, vocab 32000), 2 gloo ranks
    python bench/host_gap.py --trim-after-load off          # without the malloc_trim after initialize

The checkpoint is a random transformers LlamaForCausalLM saved in bf16 (bench/load_memory.py's write_checkpoint).
Each rank (a fresh process, gloo, one thread) first loads a tiny checkpoint the same way and trains it a step
(load_memory's TINY: imports, op loads, thread pools and first-time setup are not the run), then loads it the native
way (model_zoo.from_pretrained on the meta device,
then zerogpt.initialize streams each rank's shards), then trains `--steps` steps of random tokens with the plain loss,
as train_gpt.py does. A thread samples the rank's resident memory (VmRSS less RssShmem: the shared collective staging
is the host's, not the rank's) every 2 ms and labels each sample with the phase running (load, forward, backward,
step). Beside it: what the rank counts (Engine.host_bytes(), the build line's "host RAM held while training") and what
zerogpt.memory_model predicts (estimate(): every home but disk on a CPU run, plus the activations), both above the
resident memory of the process before the load (interpreter, torch, gloo). Resident memory is read with glibc's own
malloc settings as a run has them (zerogpt's keep-freed-host-memory on), so freed blocks that glibc keeps show up
as they do in a real run.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
from load_memory import TINY, write_checkpoint  # noqa: E402
from step_time import run_job  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zerogpt.atomic_write import write_json_atomic  # noqa: E402

MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _private_rss() -> int:
    return _status("VmRSS") - _status("RssShmem")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back, over every arena (glibc's mallinfo2: uordblks + hblkhd)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _PhaseSampler(threading.Thread):
    """The largest private resident set seen in each labelled phase, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.phase, self.peaks, self.done = interval, "start", {}, threading.Event()
        self.in_use: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval)

    def sample(self) -> None:
        rss = _private_rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
        self.in_use[self.phase] = max(self.in_use.get(self.phase, 0), _malloc_in_use())

    def enter(self, phase: str) -> None:
        self.sample()
        self.phase = phase
        self.sample()

    def stop(self) -> dict:
        self.sample()
        self.done.set()
        self.join()
        return self.peaks


def _config(args):
    import zerogpt

    return zerogpt.Config(dict(zero=dict(stage=3, offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu")),
                               precision="fp32", BATCH_SIZE=args.batch, SEQ_LEN=args.seq))


def _prediction(engine, model, args) -> dict:
    """memory_model.estimate for this run, per home, and the host RAM a CPU rank needs (host_ram: every home but
    disk, what the homes share on a CPU counted once)."""
    from zerogpt.memory_model import ModelShape, estimate

    shape = ModelShape.from_config(model.config)
    est = estimate(shape, stage=3, world_size=dist.get_world_size(), precision="fp32", offload_optimizer="cpu",
                   offload_param="cpu", seq_len=args.seq, batch=args.batch, prefetch=engine.config.zero.prefetch,
                   bucket_mb=engine.config.zero.shard_strategy.bucket_mb, gpu_overhead=0, on_gpu=False)
    return dict(device=est["totals"]["device"], host=est["totals"]["host"], total=est["host_ram"],
                shared=est["shared"], activations=est["activations"]["total"],
                logits=est["activations"]["logits"], buffers=sum(est["buffers"].values()),
                states=sum(sum(h.values()) for h in est["model_states"].values()), params=shape.num_params)


def _loss(engine, x: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss as the Trainer computes it: the logits die when this returns, before backward."""
    out = engine(x[:, :-1])
    return engine.criterion(getattr(out, "logits", out), x[:, 1:])


def _train(directory: str, args, steps: int) -> None:
    """Load `directory` as the measured run does and train `steps` steps, then close (the warm-up)."""
    import zerogpt
    from model_zoo import from_pretrained
    from model_zoo.loss import GPTLMLoss
    from zerogpt.context import DistContext

    model = from_pretrained(directory)
    engine = zerogpt.initialize(model, dict(type="HybridAdam", lr=1e-4), GPTLMLoss(shift=False), config=_config(args),
                                ctx=DistContext.current())
    for _ in range(steps):
        engine.backward(_loss(engine, torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1))))
        engine.step()
    engine.close()
    del engine, model
    gc.collect()


def measure_gap(rank: int, _system: str, directory: str, args) -> dict:
    import zerogpt
    from model_zoo import from_pretrained
    from model_zoo.loss import GPTLMLoss
    from zerogpt.context import DistContext

    torch.manual_seed(rank)
    _train(args.warm_dir, args, steps=1)  # imports, op loads, thread pools and first-time setup are not the run's
    if args.keep not in ("on", "off") and not args.keep.startswith("mmap>"):
        raise ValueError(f"--keep on|off|mmap>MIB, got {args.keep!r}")
    if args.keep == "off":
        os.environ["ZEROGPT_KEEP_HOST_MEMORY"] = "0"
    else:
        os.environ.pop("ZEROGPT_KEEP_HOST_MEMORY", None)
    gc.collect()
    dist.barrier()
    base, base_in_use, base_file = _private_rss(), _malloc_in_use(), _status("RssFile")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM <- VmRSS: the exact peak from here on, whatever the sampler misses
    sampler = _PhaseSampler()
    sampler.start()
    sampler.enter("load")
    model = from_pretrained(directory)
    engine = zerogpt.initialize(model, dict(type="HybridAdam", lr=1e-4), GPTLMLoss(shift=False), config=_config(args),
                                ctx=DistContext.current())
    if args.keep.startswith("mmap>"):  # blocks from this size up mapped fresh and unmapped on free
        _libc.mallopt(-4, 65536)  # M_MMAP_MAX back to glibc's default
        _libc.mallopt(-3, int(args.keep[5:]) * MIB)  # M_MMAP_THRESHOLD
    if args.trim_after_load == "on":
        from zerogpt.host_memory import release_freed_host_memory
        release_freed_host_memory()
    sampler.enter("built")
    built = _private_rss()
    file_pages = _status("RssFile")
    counted = engine.host_bytes()
    predicted = _prediction(engine, model, args)
    g = torch.Generator().manual_seed(rank)
    held = []
    for _ in range(args.steps):
        x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), generator=g)
        sampler.enter("forward")
        loss = _loss(engine, x)
        sampler.enter("backward")
        engine.backward(loss)
        del loss
        sampler.enter("step")
        engine.step()
        sampler.enter("between steps")
        held.append(_private_rss() - base)
    peaks = {phase: rss - base for phase, rss in sampler.stop().items()}
    peaks["VmHWM"] = _status("VmHWM") - _status("RssShmem") - base
    mine = dict(rank=rank, base=base, built=built - base, held_between_steps=held, peaks=peaks,
                peak=max(peaks.values()), rss_file_built=file_pages - base_file,
                in_use={phase: b - base_in_use for phase, b in sampler.in_use.items()}, counted=counted,
                predicted=predicted)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    engine.close()
    return {"ranks": every}


def report(result: dict, args) -> str:
    lines = [f"Llama {args.layers} x {args.hidden} (ffn {args.ffn}, vocab {args.vocab}, heads {args.heads}/"
             f"{args.kv_heads}), {args.world} ranks, ZeRO-3, optimizer + params offloaded, fp32, batch {args.batch} x "
             f"seq {args.seq}, keep-freed {args.keep}, malloc_trim after load {args.trim_after_load}",
             "| rank | params | predicted (MiB, B/param) | of it activations / logits | counted by host_bytes | "
             "built | between steps | peak load / fwd / bwd / step (MiB) | peak (B/param) | peak / predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["ranks"]:
        n, p, k = r["predicted"]["params"], r["predicted"], r["peaks"]
        phases = " / ".join(f"{k.get(ph, 0) / MIB:,.0f}" for ph in ("load", "forward", "backward", "step"))
        lines.append(f"| {r['rank']} | {n / 1e6:.1f}M | {p['total'] / MIB:,.0f} ({p['total'] / n:.1f}) | "
                     f"{p['activations'] / MIB:,.0f} / {p['logits'] / MIB:,.0f} | {r['counted'] / MIB:,.0f} "
                     f"({r['counted'] / n:.1f}) | {r['built'] / MIB:,.0f} | "
                     f"{', '.join(f'{h / MIB:,.0f}' for h in r['held_between_steps'])} | {phases} | "
                     f"{r['peak'] / MIB:,.0f} ({r['peak'] / n:.1f}) | {r['peak'] / p['total']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1376, help="intermediate_size (SwiGLU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--keep", default="on", help="zerogpt's keep-freed-host-memory setting")
    p.add_argument("--trim-after-load", default="off", choices=["on", "off"],
                   help="call malloc_trim once initialize returns (on top of what initialize does itself)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "zerogpt-bench-cache"))
    p.add_argument("--port", type=int, default=29581)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.device, args.threads = "cpu", 1
    args.host_memory = "default" if args.keep == "off" else "keep"
    directory = write_checkpoint(args, torch.bfloat16)
    args.warm_dir = write_checkpoint(argparse.Namespace(**TINY, cache_dir=args.cache_dir), torch.bfloat16)
    start = time.perf_counter()
    result = run_job(args, "zerogpt", directory, measure=measure_gap)
    if "error" in result:
        print(result["error"])
        return result
    print(report(result, args))
    for r in result["ranks"]:
        print(f"rank {r['rank']} RssFile once built, above the start {r['rss_file_built'] / MIB:,.0f} MiB; malloc in use, peak above the start (MiB): "
              + ", ".join(f"{ph} {b / MIB:,.0f}" for ph, b in r["in_use"].items()))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        write_json_atomic(args.json, dict(args={k: str(v) for k, v in vars(args).items()}, **result))
    return result


if __name__ == "__main__":
    main()
