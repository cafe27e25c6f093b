"""Will it fit? Bytes per rank on GPU, host and disk for a GPT trained with zerogpt, before you launch.

    python -m zerogpt_tools.estimate --model gpt2_xl --stage 3 --offload cpu --world 1 --gpu-mem 80GiB

With --compile (the config's `compile = True`) stage 3 gathers each transformer block whole and --prefetch counts
whole modules ahead, so the chunk buffers are those of a block and the next --prefetch modules.

The arithmetic is zerogpt/memory_model.py's (model states as the engine holds them, activations, chunk buffers in
flight; preflight refuses a run with the same numbers). Unlike DeepSpeed's estimators it also counts
activations, disk offload, precision and buffers, and compares the totals with the capacities given.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from data_pipeline.cli_args import parse_size
from model_zoo.gpt import SIZES, GPTConfig
from zerogpt.cli import HelpFormatter
from zerogpt.memory_model import (CATEGORIES, HOMES, PRECISIONS, ModelShape, activation_bytes, buffer_bytes, estimate,
                                  model_state_bytes, zero_paper_bytes)

__all__ = ["MODELS", "ModelShape", "model_state_bytes", "activation_bytes", "buffer_bytes", "estimate", "main"]


def _shape(size: dict) -> ModelShape:
    c = GPTConfig(**size)
    return ModelShape(layers=c.n_layer, hidden=c.n_embd, heads=c.n_head, vocab=c.vocab_size,
                      positions=c.max_position_embeddings, pad_vocab_multiple=c.pad_vocab_multiple)


MODELS: dict[str, ModelShape] = {name: _shape(size) for name, size in SIZES.items()}
"""model_zoo's GPT sizes (gpt2_tiny ... gpt2_xl) as shapes."""


# -- CLI -------------------------------------------------------------------------------------------

def _fmt(n: int) -> str:
    if n == 0:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def format_report(est: dict, shape: ModelShape, args: argparse.Namespace) -> str:
    """The human-readable table printed by the CLI."""
    psi = est["num_params"]
    lines = [f"zerogpt estimate: {args.model_name} = {psi / 1e9:.3f}B params ({shape.layers} layers, hidden "
             f"{shape.hidden}, {shape.heads} heads, vocab {shape.vocab}); stage {args.stage}, world {args.world}, "
             f"{args.precision}, offload optimizer={args.offload} param={args.offload_param}"
             f"{'; compiled: blocks gathered whole' if args.compile and args.stage == 3 else ''}",
             f"per rank; seq {args.seq_len} x micro-batch {args.batch} x accumulation {args.grad_accum} = "
             f"{args.seq_len * args.batch * args.grad_accum:,} tokens/rank/step; activation checkpointing "
             f"{'on' if args.checkpoint else 'off'}; attention {'SDPA/flash' if not args.eager_attention else 'eager'}",
             "", f"{'':24}{'GPU':>13}{'host':>13}{'disk':>13}"]
    row = lambda name, d: lines.append(f"{name:24}" + "".join(f"{_fmt(d.get(h, 0)):>13}" for h in HOMES))
    for cat in CATEGORIES:
        row(cat, est["model_states"][cat])
    states_total = {h: sum(est["model_states"][c][h] for c in CATEGORIES) for h in HOMES}
    row("= model states", states_total)
    acts = est["activations"]
    row("activations", {"device": acts["total"]})
    row("chunk buffers", est["buffers"])
    row("CUDA ctx/workspace", {"device": est["gpu_overhead"]})
    row("= total", est["totals"])
    name, paper = zero_paper_bytes(psi, args.stage, args.world)
    lines += ["", f"activations: {_fmt(acts['layers'])} in {shape.layers} layers "
              f"({_fmt(acts['per_layer'])} per layer un-checkpointed, Korthikanti et al. 2022), "
              f"{_fmt(acts['logits'])} logits/loss, {_fmt(acts['embeddings'])} embeddings",
              f"ZeRO paper (mixed precision, Adam): stage {args.stage} = {name} = {_fmt(paper)} per rank; "
              f"ours: {_fmt(sum(states_total.values()))} (fp32 grad shards on the device: +2 B/param/N; offloaded, "
              f"a step's one crossing stays in the compute dtype; fp32 precision aliases master and param)"]
    for home, cap, flag in (("device", args.gpu_mem, "--gpu-mem"), ("host", args.host_mem, "--host-mem"),
                            ("disk", args.disk_space, "--disk")):
        need = est["totals"][home] * (args.world // args.nodes if home != "device" else 1)
        ranks = args.world // args.nodes
        scope = "per GPU" if home == "device" else f"per node ({ranks} rank{'s' if ranks > 1 else ''})"
        if cap is None and need == 0:
            continue
        if cap is None:
            lines.append(f"{home:6}: needs {_fmt(need)} {scope} (pass {flag} to check the fit)")
        else:
            verdict = "FITS" if need <= cap else "DOES NOT FIT"
            lines.append(f"{home:6}: needs {_fmt(need)} {scope} of {_fmt(cap)} -> {verdict} "
                         f"({100 * need / cap:.0f}%)")
    return "\n".join(lines)


def _capacity(text: str) -> int:
    """A memory or disk capacity: a size below 1 MiB is a number given without its unit (`--gpu-mem 80`)."""
    nbytes = parse_size(text)
    if nbytes < 2**20:
        raise argparse.ArgumentTypeError(f"{text!r} is {nbytes} bytes; give the unit, e.g. {text}GiB or {text}GB")
    return nbytes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerogpt_tools.estimate", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    # model
    p.add_argument("--model", default="gpt2_small", choices=sorted(MODELS), help="size from the table")
    p.add_argument("--layers", type=int, help="custom: number of blocks (overrides --model)")
    p.add_argument("--hidden", type=int, help="custom: width n_embd")
    p.add_argument("--heads", type=int, help="custom: attention heads")
    p.add_argument("--vocab", type=int, help="custom: vocabulary size")
    # ZeRO
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (GPUs)")
    p.add_argument("--nodes", type=int, default=1, help="hosts sharing the ranks (host RAM is per node)")
    p.add_argument("--offload", default="none", choices=("none", "cpu", "disk"), help="optimizer offload")
    p.add_argument("--offload-param", default="none", choices=("none", "cpu"), help="param offload (stage 3)")
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="Adam's moments with the optimizer offloaded (zero.offload_optimizer.state_dtype)")
    p.add_argument("--prefetch", type=int, default=2,
                   help="stage 3: chunks gathered ahead (with --compile: whole modules, blocks or embeddings/head)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="chunk size; 0 = one param per chunk")
    p.add_argument("--compile", action="store_true",
                   help="compile = True: stage 3 gathers each block whole (a block's chunks at once, not one chunk)")
    # workload
    p.add_argument("--precision", default="bf16", choices=tuple(PRECISIONS), help="training precision")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1, help="accumulation steps (stages 2-3 with the optimizer offloaded: an fp32 gradient shard sums on the GPU)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--eager-attention", action="store_true", help="attention that stores s x s scores")
    p.add_argument("--dropout", action="store_true", help="dropout > 0 (1-byte masks are stored)")
    # capacities
    p.add_argument("--gpu-mem", type=_capacity, help="e.g. 80GiB or 80G (2**30), 80GB (10**9)")
    p.add_argument("--host-mem", type=_capacity, help="host RAM per node, e.g. 128GB")
    p.add_argument("--disk", dest="disk_space", type=_capacity, help="free space at the offload path")
    p.add_argument("--gpu-overhead", type=parse_size, default=2**30, help="CUDA context + workspaces")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = MODELS[args.model]
    custom = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab") if getattr(args, k)}
    args.model_name = args.model if not custom else "custom"
    if custom:
        shape = ModelShape(**{**asdict(shape), **custom})
        if shape.hidden % shape.heads:
            raise SystemExit(f"--hidden {shape.hidden} must be divisible by --heads {shape.heads}")
    if args.world % args.nodes:
        raise SystemExit(f"--world {args.world} must be a multiple of --nodes {args.nodes}")
    try:
        est = estimate(shape, args.stage, args.world, args.precision, args.offload, args.offload_param,
                       args.seq_len, args.batch, args.checkpoint, not args.eager_attention, args.dropout,
                       args.prefetch, args.bucket_mb, args.gpu_overhead, args.grad_accum,
                       optimizer_bytes_per_param=4 if args.state_dtype == "bf16" else 8,
                       gather_per_block=args.compile)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if args.json:
        print(json.dumps(dict(est, model=args.model_name, shape=asdict(shape)), indent=1))
    else:
        print(format_report(est, shape, args))
    fits = all(cap is None or est["totals"][h] * (1 if h == "device" else args.world // args.nodes) <= cap
               for h, cap in (("device", args.gpu_mem), ("host", args.host_mem), ("disk", args.disk_space)))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
