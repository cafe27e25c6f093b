"""The Llama slices (llama1b, llama3b): MFU without offload on the Llama family (issue 46.1) at stages 0 and 3, in four
modes (eager, compile, chunked loss, FP8 + compile), with transformers' LlamaForCausalLM (SDPA, fused AdamW, bf16
autocast) beside them at the same batch. Llama-3.2-1B at sequence 2048; Llama-3.2-3B at sequence 4096.

The micro-batch is found first: zerogpt's eager stage-0 row starts at START_BATCH and halves on every GPU
out-of-memory (gpu_measure's fit_batch) until one fits; every other row runs at that batch. Then, as the compute
slice (compute.py), one process per group with its share of the budget, cheapest first: (A) eager at stage 3, the
chunked loss at both, plain PyTorch; (B) compile; (C) FP8 + compile. Every row clips the gradient norm to 1.0, as
compute.py's. MFU is PaLM's count with GQA and the 128k head (gpu_slices/mfu.py) over the GPU's dense bf16 peak.
Tiny (CPU) form: the same model names at a 2-layer, 64-wide shape (tied, GQA), the fit row and group A; no compile
(`tiny_omitted`).
"""
from __future__ import annotations

from dataclasses import replace

from gpu_slices.compute import CLIP, LOSS_KERNEL_ROWS, library_installed, measure_groups, omitted_in_tiny, summarize
from gpu_slices.mfu import table_figures
from gpu_slices.runner import Spec, log, note_failures

MODELS = {  # slice -> (model_zoo.llama size, (layers, q heads, width), sequence, the name in labels)
    "llama1b": ("llama3_2_1b", (16, 32, 2048), 2048, "llama3.2-1b"),
    "llama3b": ("llama3_2_3b", (28, 24, 3072), 4096, "llama3.2-3b"),
}
START_BATCH = 8
TINY_SHAPE, TINY_BATCH, TINY_LOSS_CHUNK = (2, 4, 64), 2, 32
# (group, variant, system, precision, compile, chunked_loss, stages); "fit" runs first, alone
VARIANTS = (("fit", "eager", "zerogpt", None, False, False, (0,)),
            ("A", "eager", "zerogpt", None, False, False, (3,)),
            ("A", "chunked loss", "zerogpt", None, False, True, (0, 3)),
            ("A", "eager", "torch", None, False, False, (0,)),
            ("B", "compile", "zerogpt", None, True, False, (0, 3)),
            ("C", "fp8+compile", "zerogpt", "fp8", True, False, (0, 3)))
WEIGHTS = {"fit": 20, "A": 30, "B": 25, "C": 25}


def plan(slice_name: str, args, batch: int | None = None) -> dict[str, list[tuple[str, Spec]]]:
    """group -> [(variant, spec)] at `batch` (None: the start, START_BATCH; tiny: TINY_BATCH); tiny: the fit
    group and A only."""
    model, shape, seq, name = MODELS[slice_name]
    if args.tiny:
        shape, seq = TINY_SHAPE, args.seq
    batch = batch or (TINY_BATCH if args.tiny else START_BATCH)
    groups: dict[str, list[tuple[str, Spec]]] = {}
    for group, variant, system, precision, compile, chunked, stages in VARIANTS:
        if (args.tiny and compile) or (system not in args.systems and group != "fit"):  # the fit row always runs
            continue
        for stage in stages:
            label = f"{system} {name}" + (f" stage {stage}" if system == "zerogpt" else "") + \
                f" {variant} b{batch}x{seq}"
            spec = Spec(system, shape, model=model, stage=stage, batch=batch, seq=seq, steps=args.steps + 2,
                        warmup=args.warmup, vocab=args.llama_vocab, precision=precision, compile=compile,
                        chunked_loss=chunked, loss_chunk_size=TINY_LOSS_CHUNK if args.tiny and chunked else None,
                        loss_backend="torch" if chunked else None, fit_batch=group == "fit", label=label,
                        clip=CLIP)
            groups.setdefault(group, []).append((variant, spec))
            if chunked and stage == 0:  # the library loss kernels beside zerogpt's own, where installed
                groups[group].extend((lib_variant, replace(spec, loss_backend=backend,
                                                           label=label.replace(variant, lib_variant)))
                                     for backend, lib_variant in LOSS_KERNEL_ROWS[1:] if library_installed(backend))
    return groups


def run(slice_name: str, args, budget, result: dict, save) -> None:
    """The fit row, then the other groups at the batch it found; the table and the figures under `slice_name`."""
    result["tiny_omitted"] = omitted_in_tiny(args, lambda a: plan(slice_name, a))
    fit = measure_groups(args, budget, result, save, {"fit": plan(slice_name, args)["fit"]}, WEIGHTS,
                         later_weight=sum(w for g, w in WEIGHTS.items() if g != "fit"))
    fitted = [r for r in fit if "error" not in r]
    if fitted:
        batch = fitted[0]["spec"]["batch"]
        result["batch"] = batch
        log(f"  batch {batch}" + (f" (out of GPU memory at {fitted[0]['oom_batches']})"
                                  if fitted[0].get("oom_batches") else ""))
        rest = {g: rows for g, rows in plan(slice_name, args, batch).items() if g != "fit"}
        measure_groups(args, budget, result, save, rest, WEIGHTS)
    elif fit:  # (not started: the budget's `skipped` line says so)
        result["errors"].append("the fit row found no batch that trains: no other row was run")
    rows = result["rows"]
    note_failures(result, rows)
    result["table"] = summarize(rows)
    result["figures"].update(table_figures(slice_name, result["table"]))
