"""Will it fit? Bytes per rank on GPU, host and disk for a model trained with zerogpt, before you launch.

    python -m zerogpt_tools.estimate --model gpt2_xl --stage 3 --offload cpu --world 1 --gpu-mem 80GiB
    python -m zerogpt_tools.estimate --model llama3_8b --offload cpu --offload-param cpu --state-dtype bf16 \
        --seq-len 8192 --batch 8 --checkpoint --chunked-loss --gpu-mem 80GiB --host-mem 128GiB
    python -m zerogpt_tools.estimate --model gpt2_xl --plan auto --tokens-per-step 65536 --gpu-mem 24GiB \
        --host-mem 64GiB --gpu 4090

--plan auto prints what the config's plan="auto" would choose for these capacities (zerogpt/planner/: the fastest
predicted plan that fits, untried: trial steps need the machine itself), the flags given on the command line kept
fixed. A plan that DOES NOT FIT is followed by the flags of the fastest one that would, or by the smallest change.

--model is any size of model_zoo's GPT-2 (gpt2_tiny ... gpt2_xl) or Llama families (llama3_8b, qwen2_5_7b, ...).

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

from data_pipeline.cli_args import ArgumentParser, parse_size
from model_zoo.gpt import SIZES, GPTConfig
from model_zoo.llama import SIZES as LLAMA_SIZES
from model_zoo.llama import LlamaConfig
from zerogpt.cli import HelpFormatter
from zerogpt.config.dtypes import DTYPES
from zerogpt.memory_model import (CATEGORIES, HOMES, ModelShape, activation_bytes, buffer_bytes, estimate,
                                  model_state_bytes, zero_paper_bytes)
from zerogpt.planner.explain import explain
from zerogpt.planner.plan import CONFIG_KEYS, UNBOUNDED, Machine, Plan, PlanError, Workload
from zerogpt.planner.search import search
from zerogpt.planner.speed import default_constants

__all__ = ["MODELS", "ModelShape", "model_state_bytes", "activation_bytes", "buffer_bytes", "estimate", "main"]


MODELS: dict[str, ModelShape] = {
    **{name: ModelShape.from_config(GPTConfig(**size)) for name, size in SIZES.items()},
    **{name: ModelShape.from_config(LlamaConfig(**size)) for name, size in LLAMA_SIZES.items()}}
"""model_zoo's GPT sizes (gpt2_tiny ... gpt2_xl) and Llama-family sizes (llama_tiny, llama3_8b, qwen2_5_7b, ...)
as shapes."""


# -- CLI -------------------------------------------------------------------------------------------

def _fmt(n: int) -> str:
    if n == 0:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def _describe(shape: ModelShape) -> str:
    """The shape in a few words: GPT-2's layers, width, heads, vocab; a Llama's also kv heads, SwiGLU width, options."""
    if shape.family == "gpt2":
        return f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, vocab {shape.vocab}"
    head_dim = shape.q_width // shape.heads
    options = [o for o, on in (("qkv bias", shape.qkv_bias), ("qk-norm", shape.qk_norm)) if on]
    return (f"{shape.layers} layers, hidden {shape.hidden}, {shape.heads} q / {shape.n_kv_heads} kv heads of "
            f"{head_dim}, SwiGLU {shape.ffn_width}, {'tied' if shape.tied else 'untied'} vocab {shape.vocab}"
            + "".join(f", {o}" for o in options))


def _dominant(est: dict, home: str) -> tuple[str, int]:
    """The largest term of one home's total: a model-state category, the activations, buffers or CUDA context."""
    terms = {cat: est["model_states"][cat][home] for cat in CATEGORIES}
    terms["optimizer state"] = terms.pop("optimizer")
    terms["chunk buffers"] = est["buffers"][home]
    if home == "device":
        terms["activations"], terms["CUDA ctx/workspace"] = est["activations"]["total"], est["gpu_overhead"]
    return max(terms.items(), key=lambda kv: kv[1])


def run_estimate(shape: ModelShape, args: argparse.Namespace, state_dtype: str | None = None) -> dict:
    """`memory_model.estimate` with the CLI's arguments (`state_dtype` replaces --state-dtype)."""
    moments = 4 if (state_dtype or args.state_dtype) == "bf16" else 8  # Adam's two moments per param
    return estimate(shape, args.stage, args.world, args.precision, args.offload, args.offload_param,
                    args.seq_len, args.batch, args.checkpoint, not args.eager_attention, args.dropout,
                    args.prefetch, args.bucket_mb, args.gpu_overhead, args.grad_accum,
                    optimizer_bytes_per_param=moments, gather_per_block=args.compile,
                    loss_chunk=args.loss_chunk_size if args.chunked_loss else 0)


def format_report(est: dict, shape: ModelShape, args: argparse.Namespace) -> str:
    """The human-readable table printed by the CLI."""
    psi = est["num_params"]
    moments = f" ({args.state_dtype} moments)" if args.offload != "none" else ""
    lines = [f"zerogpt estimate: {args.model_name} = {psi / 1e9:.3f}B params ({_describe(shape)}); stage "
             f"{args.stage}, world {args.world}, {args.precision}, offload optimizer={args.offload}{moments} "
             f"param={args.offload_param}"
             f"{'; compiled: blocks gathered whole' if args.compile and args.stage == 3 else ''}",
             f"per rank; seq {args.seq_len} x micro-batch {args.batch} x accumulation {args.grad_accum} = "
             f"{args.seq_len * args.batch * args.grad_accum:,} tokens/rank/step; activation checkpointing "
             f"{'on' if args.checkpoint else 'off'}; attention {'SDPA/flash' if not args.eager_attention else 'eager'}"
             f"{f'; loss chunked by {args.loss_chunk_size} tokens' if args.chunked_loss else ''}",
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
    dominant = [f"{'GPU' if h == 'device' else h} {what} {_fmt(n)} ({100 * n / est['totals'][h]:.0f}%)"
                for h in HOMES if est["totals"][h] for what, n in [_dominant(est, h)]]
    lines.append("dominated by: " + "; ".join(dominant))
    for home, cap, flag in (("device", args.gpu_mem, "--gpu-mem"), ("host", args.host_mem, "--host-mem"),
                            ("disk", args.disk_space, "--disk")):
        ranks = args.world // args.nodes
        need = est["totals"][home] * (ranks if home != "device" else 1)
        scope = "per GPU" if home == "device" else f"per node ({ranks} rank{'s' if ranks > 1 else ''})"
        if cap is None and need == 0:
            continue
        if cap is None:
            lines.append(f"{home:6}: needs {_fmt(need)} {scope} (pass {flag} to check the fit)")
            continue
        verdict = "FITS" if need <= cap else "DOES NOT FIT"
        # host RAM also holds what the model does not count: the OS, each process (CUDA context, pinned
        # staging), the data loader; say how much is left for them when it is little
        left = f", {_fmt(cap - need)} left for the OS, processes and data" if home == "host" and need <= cap else ""
        lines.append(f"{home:6}: needs {_fmt(need)} {scope} of {_fmt(cap)} -> {verdict} "
                     f"({100 * need / cap:.0f}%{left})")
        if need > 0.9 * cap and home != "device" and args.offload != "none" and args.state_dtype == "fp32":
            less = run_estimate(shape, args, state_dtype="bf16")["totals"][home] * (ranks if home != "device" else 1)
            lines.append(f"{'':8}with --state-dtype bf16 (Adam's moments in bf16, "
                         f"zero.offload_optimizer.state_dtype=bf16): {_fmt(less)} -> "
                         f"{'FITS' if less <= cap else 'DOES NOT FIT'} ({100 * less / cap:.0f}%)")
    return "\n".join(lines)


_PLAN_FLAGS = dict(stage="stage", offload_optimizer="offload", offload_param="offload_param",
                   state_dtype="state_dtype", micro_batch="batch", accumulation="grad_accum", checkpoint="checkpoint",
                   chunked_loss="chunked_loss", bucket_mb="bucket_mb", prefetch="prefetch")
"""Plan field -> this tool's argument (dest) that sets it: what --plan auto keeps fixed when given."""


def plan_flags(plan: Plan) -> str:
    """The command-line flags of this tool that describe `plan`."""
    flags = [f"--stage {plan.stage}", f"--offload {plan.offload_optimizer}", f"--offload-param {plan.offload_param}",
             f"--state-dtype {plan.state_dtype}", f"--batch {plan.micro_batch}", f"--grad-accum {plan.accumulation}",
             f"--bucket-mb {plan.bucket_mb:g}", f"--prefetch {plan.prefetch}"]
    flags += [flag for flag, on in (("--checkpoint", plan.checkpoint), ("--chunked-loss", plan.chunked_loss)) if on]
    return " ".join(flags)


def plan_for(shape: ModelShape, args: argparse.Namespace, fixed: dict) -> tuple:
    """The planner's search for these arguments' workload and capacities (a capacity not given: no limit)."""
    tokens = args.tokens_per_step or args.seq_len * args.batch * args.grad_accum * args.world
    work = Workload(shape=shape, seq_len=args.seq_len, tokens_per_step=tokens, world=args.world,
                    precision="bf16" if args.precision == "fp8" else args.precision, fixed=fixed,
                    disk_path="(--disk)" if args.disk_space else None, compile=args.compile,
                    loss_chunk=args.loss_chunk_size)
    machine = Machine(device_bytes=args.gpu_mem or UNBOUNDED, host_bytes=args.host_mem or UNBOUNDED,
                      disk_bytes=args.disk_space, local_ranks=args.world // args.nodes, on_gpu=True,
                      name=args.gpu, gpu_overhead=args.gpu_overhead)
    return work, machine, search(work, machine, default_constants(machine))


def _given(argv: list[str] | None) -> set[str]:
    """The arguments given on the command line (their dests), not defaulted."""
    p, unset = build_parser(), object()  # not a string: argparse does not convert it
    p.set_defaults(**dict.fromkeys(vars(p.parse_args([])), unset))
    return {dest for dest, value in vars(p.parse_args(argv)).items() if value is not unset}


def plan_report(shape: ModelShape, args: argparse.Namespace, given: set[str]) -> str:
    """--plan auto: the choice's table and its flags."""
    fixed = {field: getattr(args, dest) for field, dest in _PLAN_FLAGS.items() if dest in given}
    if "batch" in given and "grad_accum" not in given and not args.tokens_per_step:
        fixed.pop("micro_batch")  # the batch sized the tokens per step only when none was given
    try:
        work, machine, choice = plan_for(shape, args, fixed)
    except PlanError as e:  # a fixed key is this tool's flag here
        message = str(e)
        for field, key in CONFIG_KEYS.items():
            if field in _PLAN_FLAGS:
                message = message.replace(f"{key}=", f"--{_PLAN_FLAGS[field].replace('_', '-')} ")
        raise PlanError(message.replace("(fixed in the config)", "(given)")) from None
    return explain(choice, choice.best, work, machine) + f"\nchosen: {plan_flags(choice.best.plan)}"


def would_fit(shape: ModelShape, args: argparse.Namespace) -> str:
    """After DOES NOT FIT: the flags of the fastest plan for the same tokens per step that fits, or the planner's
    one line on the smallest change."""
    try:
        _, _, choice = plan_for(shape, args, {})
    except PlanError as e:
        return str(e)
    return f"fits with: {plan_flags(choice.best.plan)} (python -m zerogpt_tools.estimate --plan auto explains)"


def _size(text: str) -> int:
    """A size flag's bytes; parse_size's message (the accepted forms) in argparse's error, not 'invalid value'."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    """A count flag (--batch, --seq-len, ...): an int >= 1, where 0 or less would give negative memory."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _capacity(text: str) -> int:
    """A memory or disk capacity: a size below 1 MiB is a number given without its unit (`--gpu-mem 80`)."""
    nbytes = _size(text)
    if nbytes < 2**20:
        raise argparse.ArgumentTypeError(f"{text!r} is {nbytes} bytes; give the unit, e.g. {text}GiB or {text}GB")
    return nbytes


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m zerogpt_tools.estimate", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    # model
    p.add_argument("--model", default="gpt2_small", choices=sorted(MODELS), help="size from the table")
    p.add_argument("--layers", type=int, help="custom: number of blocks (overrides --model)")
    p.add_argument("--hidden", type=int, help="custom: width n_embd")
    p.add_argument("--heads", type=int, help="custom: attention heads")
    p.add_argument("--vocab", type=int, help="custom: vocabulary size")
    p.add_argument("--kv-heads", type=int, help="custom (Llama family): k/v heads, grouped-query attention")
    p.add_argument("--head-dim", type=int, help="custom (Llama family): width of one head (default hidden/heads)")
    p.add_argument("--ffn", type=int, help="custom (Llama family): SwiGLU width (intermediate_size)")
    # ZeRO
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (GPUs)")
    p.add_argument("--nodes", type=_positive, default=1, help="hosts sharing the ranks (host RAM is per node)")
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
    p.add_argument("--precision", default="bf16", choices=tuple(DTYPES), help="training precision")
    p.add_argument("--seq-len", type=_positive, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=_positive, default=1, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=_positive, default=1, help="accumulation steps (stages 2-3 with the optimizer offloaded: an fp32 gradient shard sums on the GPU)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--eager-attention", action="store_true", help="attention that stores s x s scores")
    p.add_argument("--chunked-loss", action="store_true",
                   help="the model's chunked_loss = True: one chunk's logits at a time, not (seq x batch x vocab)")
    p.add_argument("--loss-chunk-size", type=_positive, default=GPTConfig.loss_chunk_size,
                   help="tokens per chunk of the chunked loss (the model's loss_chunk_size)")
    p.add_argument("--dropout", action="store_true", help="dropout > 0 (1-byte masks are stored)")
    # capacities
    p.add_argument("--gpu-mem", type=_capacity, help="e.g. 80GiB or 80G (2**30), 80GB (10**9)")
    p.add_argument("--host-mem", type=_capacity, help="host RAM per node, e.g. 128GB")
    p.add_argument("--disk", dest="disk_space", type=_capacity, help="free space at the offload path")
    p.add_argument("--gpu-overhead", type=_size, default=2**30, help="CUDA context + workspaces")
    p.add_argument("--gpu", default="H100", help="GPU model for --plan auto's speed model (H100, A100, 4090, ...)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    # plan="auto"
    p.add_argument("--plan", default="manual", choices=("manual", "auto"),
                   help="auto: choose stage, offload, micro-batch x accumulation, checkpointing for the capacities "
                        "(the flags given stay fixed)")
    p.add_argument("--tokens-per-step", type=_positive,
                   help="tokens per optimizer step over all ranks (default seq-len x batch x grad-accum x world)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = _given(argv)
    shape = MODELS[args.model]
    custom = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "kv_heads", "head_dim", "ffn")
              if getattr(args, k)}
    args.model_name = args.model if not custom else "custom"
    if args.world % args.nodes:
        raise SystemExit(f"error: --world {args.world} must be a multiple of --nodes {args.nodes}")
    if args.plan == "manual" and args.state_dtype == "bf16" and args.offload == "none":  # the config refuses it too
        raise SystemExit("error: --state-dtype bf16 is for optimizer state on the host or disk (the fused host Adam "
                         "step keeps it); add --offload cpu or --offload disk")
    try:
        if custom:  # kv_heads, head_dim and ffn left unset follow the new hidden/heads (their family's defaults)
            shape = ModelShape(**{**asdict(shape), **custom})
        if args.plan == "auto":
            print(plan_report(shape, args, given))
            return 0
        est = run_estimate(shape, args)
    except ValueError as e:  # PlanError too: bad input, a fixed flag that leaves nothing, nothing fits
        raise SystemExit(f"error: {e}")
    if args.json:
        print(json.dumps(dict(est, model=args.model_name, shape=asdict(shape)), indent=1))
    else:
        print(format_report(est, shape, args))
    fits = all(cap is None or est["totals"][h] * (1 if h == "device" else args.world // args.nodes) <= cap
               for h, cap in (("device", args.gpu_mem), ("host", args.host_mem), ("disk", args.disk_space)))
    if not fits and not args.json:
        print(would_fit(shape, args))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
