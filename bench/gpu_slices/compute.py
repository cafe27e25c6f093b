"""The compute slice: MFU without offload on GPT-2 XL (1.56B, micro-batch 8 x 1024, bf16) at stages 0 and 3, eager,
under compile, in FP8 (torchao, carried by gpu_prepare.sh), with the chunked loss, and combined; then the levers
toward the 52% goal (issue 46.2): micro-batch 12 (pytorch/ao#1297's 49.9% anchor, plain PyTorch beside it), CUDA
graphs (torch.compile's reduce-overhead mode: each compiled block replayed as one graph) and the
max-autotune-no-cudagraphs mode. (The fused-norm lever is GPT-2's own LayerNorm kernel, and compiled, inductor's
fusion of it with the residual add: the eager and compile rows; a Llama's RMSNorm is torch's fused rms_norm.)

Five processes, each with its share of the budget, cheapest first, so a slow compile cuts only the rows after it:
(A) eager and chunked loss, then plain PyTorch eager beside them; (B) compile=True and compile + chunked loss; (C)
FP8 and FP8 + compile; (D) micro-batch 12, compiled, zerogpt and plain PyTorch, and CUDA graphs; (E) max-autotune,
last (its autotuning is the slowest compile). Every row clips the gradient norm to 1.0 (CLIP), as training does:
plain PyTorch with clip_grad_norm_, zerogpt in its step (since 2026-11-29; the H200's rows of 2026-11-28 did not
clip). MFU counts model FLOPs (PaLM) over the GPU's dense bf16 peak (989 TFLOPS on an H100 or H200), FP8 rows too;
the compile time is a row's first step less its eager twin's. torch.compile's disk caches outlive a process: a
compile time is a cold one only on a fresh machine. Tiny (CPU) form: group A and the FP8 rows (an error row there:
float8 needs CUDA) in one process; no compile (minutes on the CPU), listed under `tiny_omitted`.

The Llama family's slices (compute_llama.py) run through the same `measure_groups` and `summarize`.
"""
from __future__ import annotations

import os
from dataclasses import replace

from gpu_slices.mfu import table_figures
from gpu_slices.runner import Spec, log, measure_group, note_failures

XL, TINY_XL = (48, 25, 1600), (4, 2, 64)
CLIP = 1.0  # every row clips its gradient norm, as the shipped configs train (and nanoGPT, torchtitan by default)
LEVER_BATCH = 12
LEVER_MODE = "max-autotune-no-cudagraphs"
GRAPHS_MODE = "reduce-overhead"  # inductor's triton.cudagraphs
# (group, variant, precision, compile, chunked_loss, stages, batch: None = the slice's, compile mode)
VARIANTS = (("A", "eager", None, False, False, (0, 3), None, None),
            ("A", "chunked loss", None, False, True, (0, 3), None, None),
            ("B", "compile", None, True, False, (0, 3), None, None),
            ("B", "compile+chunked loss", None, True, True, (0, 3), None, None),
            ("C", "fp8", "fp8", False, False, (0, 3), None, None),
            ("C", "fp8+compile", "fp8", True, False, (0, 3), None, None),
            ("D", "compile", None, True, False, (0, 3), LEVER_BATCH, None),
            ("D", f"compile {GRAPHS_MODE}", None, True, False, (0,), None, GRAPHS_MODE),
            ("E", f"compile {LEVER_MODE}", None, True, False, (0,), None, LEVER_MODE))
# issue 46.3: the chunked loss's backends side by side at stage 0 (model_zoo.loss.LOSS_BACKENDS): "chunked loss" is
# zerogpt's own kernel (forced "torch"); a library's row runs where it is installed (Spec.loss_backend)
LOSS_KERNEL_ROWS = (("torch", "chunked loss"), ("cce", "chunked loss cce"), ("liger", "chunked loss liger"))
TORCH_ROWS = (("A", "eager", False, None), ("D", "compile", True, LEVER_BATCH))  # (group, variant, compile, batch)
WEIGHTS = dict(A=20, B=20, C=20, D=20, E=20)
TINY_LOSS_CHUNK = 32  # tokens per chunk in the tiny form: 4 chunks of a 2 x 64 micro-batch
PROFILED = ("eager", "chunked loss")  # zerogpt's rows at the slice's batch that profile one more step each: where
# the chunked loss's time goes (0.78x the plain loss at stage 0 on the H200, 0.66x at stage 3), kernel by kernel


def profile_name(variant: str, stage: int) -> str:
    """The profile file (in --out) of a PROFILED row."""
    return f"profile_compute_{variant.replace(' ', '_')}_z{stage}.txt"


def plan(args) -> dict[str, list[tuple[str, Spec]]]:
    """group -> [(variant, spec)], in the order they run (tiny: one group A, compile rows omitted)."""
    base_batch = 2 if args.tiny else 8
    groups: dict[str, list[tuple[str, Spec]]] = {}

    def spec(system, stage, variant, precision, compile, chunked, batch, mode):
        chunk = TINY_LOSS_CHUNK if args.tiny and chunked else None  # None: GPTConfig's 1024 tokens at most
        profile = (os.path.join(args.out, profile_name(variant, stage))
                   if system == "zerogpt" and variant in PROFILED and not batch else None)
        batch = batch or base_batch  # the levers' own (compiled: never in the tiny form)
        return Spec(system, TINY_XL if args.tiny else XL, stage=stage, batch=batch, seq=args.seq,
                    steps=args.steps + 2, warmup=args.warmup, vocab=args.vocab, precision=precision, compile=compile,
                    chunked_loss=chunked, loss_chunk_size=chunk, compile_mode=mode, profile_to=profile, clip=CLIP,
                    label=f"{system} gpt2_xl" + (f" stage {stage}" if system == "zerogpt" else "")
                    + f" {variant} b{batch}x{args.seq}")
    for group, variant, precision, compile, chunked, stages, batch, mode in VARIANTS:
        if args.tiny and compile:
            continue
        groups.setdefault("A" if args.tiny else group, []).extend(
            (variant, with_loss_backend(spec("zerogpt", stage, variant, precision, compile, chunked, batch, mode)))
            for stage in stages)
        if variant == "chunked loss":
            groups["A"].extend((name, replace(spec("zerogpt", 0, name, None, False, True, None, None),
                                              loss_backend=backend))
                               for backend, name in LOSS_KERNEL_ROWS[1:] if library_installed(backend))
    if "torch" in args.systems:
        for group, variant, compile, batch in TORCH_ROWS:
            if not (args.tiny and compile):
                groups.setdefault("A" if args.tiny else group, []).append(
                    (variant, spec("torch", 0, variant, None, compile, False, batch, None)))
    return groups


def with_loss_backend(spec: Spec) -> Spec:
    """A chunked-loss spec measures zerogpt's own kernel ("torch"), whatever libraries are installed."""
    return replace(spec, loss_backend="torch") if spec.chunked_loss else spec


def library_installed(backend: str) -> bool:
    """Whether the loss backend's library is installed here (a library row runs only where it is)."""
    from model_zoo.loss import available_loss_backends

    return backend in available_loss_backends("cuda")


def omitted_in_tiny(args, plan_of=None) -> list[str]:
    """The labels of the full form's rows (`plan_of(args)`, default this slice's plan) that the tiny form leaves out
    (compile: minutes of C++ codegen on the CPU); [] for a full run."""
    if not args.tiny:
        return []
    full = (plan_of or plan)(type(args)(**dict(vars(args), tiny=False)))
    return [s.label for g in full.values() for _, s in g if s.compile]


def measure_groups(args, budget, result: dict, save, groups: dict[str, list[tuple[str, Spec]]],
                   weights: dict[str, float], later_weight: float = 0.0) -> list[dict]:
    """Each group in its own process with its share of the budget (what one leaves flows to the next; groups of
    `later_weight` in all still follow these); the rows, each with its `variant`, appended to result["rows"] and
    saved after every group. Returns this call's rows."""
    reserve = int(args.host_reserve_gib * 2**30)
    rows = result.setdefault("rows", [])
    names, measured = list(groups), []
    for k, name in enumerate(names):
        log(f"  group {name}: " + ", ".join(dict.fromkeys(v for v, _ in groups[name])))
        got = measure_group(budget, [s for _, s in groups[name]], weights[name],
                            sum(weights[n] for n in names[k + 1:]) + later_weight, reserve, result["skipped"])
        new = [dict(r, variant=variant) for (variant, _), r in zip(groups[name], got)]
        rows += new
        measured += new
        save()
    return measured


def summarize(rows: list[dict]) -> list[dict]:
    """The table of a compute slice: one entry per row, with the compile time (first step less the eager twin's
    at the same stage and batch) and the error, if any."""
    def key(r):
        return r["spec"]["system"], r["spec"]["stage"], r["spec"]["batch"]
    eager_first = {key(r): r.get("first_step_s") for r in rows if r["variant"] == "eager" and "error" not in r}
    table = []
    for r in rows:
        first, base = r.get("first_step_s"), eager_first.get(key(r))
        table.append(dict(system=r["spec"]["system"], stage=r["spec"]["stage"], variant=r["variant"],
                          batch=r["spec"]["batch"], mfu=r.get("mfu"), tflops=r.get("tflops"),
                          tokens_per_s=r.get("tokens_per_s"), peak_gpu_gib=r.get("peak_gpu_gib"),
                          first_step_s=first, first_loss=r["losses"][0] if r.get("losses") else None,
                          chunked_loss_ran=r.get("chunked_loss_ran"), oom_batches=r.get("oom_batches"),
                          compile_s=first - base if r["spec"]["compile"] and None not in (first, base) else None,
                          error=f"{r['error']}: {r.get('detail', '')}"[:300] if "error" in r else None))
    return table


def run(args, budget, result: dict, save) -> None:
    result["tiny_omitted"] = omitted_in_tiny(args)
    rows = measure_groups(args, budget, result, save, plan(args), WEIGHTS)
    note_failures(result, rows)
    table = result["table"] = summarize(rows)
    figures = result["figures"]
    # issue 42's figures, kept under their names; issue 46's per stage and the speed ratios (mfu.table_figures)
    figures.update(table_figures("gpt2xl", table))
    figures["mfu_best"] = figures["gpt2xl_mfu_best"]
    figures["mfu_best_what"] = f"GPT-2 XL, {figures['gpt2xl_mfu_best_what']}" if figures["mfu_best"] else None
    for stage in (0, 3):
        eager = [t["mfu"] for t in table if t["system"] == "zerogpt" and t["stage"] == stage and t["mfu"]
                 and t["variant"] == "eager" and t["batch"] == (2 if args.tiny else 8) and not t["error"]]
        figures[f"mfu_eager_stage{stage}"] = eager[0] if eager else None
    result["profiles"] = sorted(f for f in os.listdir(args.out) if f.startswith("profile_compute_"))
