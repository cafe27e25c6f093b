"""The compute slice: MFU without offload on GPT-2 XL (1.56B, micro-batch 8 x 1024, bf16) at stages 0 and 3,
eager, under compile, in FP8 (torchao, carried by gpu_prepare.sh), with the chunked loss, and combined.

Three processes, each with its share of the budget, cheapest first, so a slow compile cuts only the rows after
it: (A) eager and chunked loss, then plain PyTorch eager beside them; (B) compile=True and compile + chunked
loss; (C) FP8 and FP8 + compile. MFU counts model FLOPs (PaLM) over the GPU's dense bf16 peak (989 TFLOPS on an
H100 or H200), FP8 rows too; the compile time is a row's first step less its eager twin's. torch.compile's disk
caches outlive a process: a compile time is a cold one only on a fresh machine. Tiny (CPU) form: group A and the
FP8 rows (an error row there: float8 needs CUDA) in one process; no compile (minutes on the CPU).
"""
from __future__ import annotations

from gpu_slices.runner import Spec, log, measure_group, note_failures

XL, TINY_XL = (48, 25, 1600), (4, 2, 64)
# (group, label, precision, compile, chunked_loss); each zerogpt row at stages 0 and 3
VARIANTS = (("A", "eager", None, False, False), ("A", "chunked loss", None, False, True),
            ("B", "compile", None, True, False), ("B", "compile+chunked loss", None, True, True),
            ("C", "fp8", "fp8", False, False), ("C", "fp8+compile", "fp8", True, False))
WEIGHTS = dict(A=25, B=40, C=35)
TINY_LOSS_CHUNK = 32  # tokens per chunk in the tiny form: 4 chunks of a 2 x 64 micro-batch


def plan(args) -> dict[str, list[tuple[str, Spec]]]:
    """group -> [(variant, spec)], in the order they run."""
    batch = 2 if args.tiny else 8
    groups: dict[str, list[tuple[str, Spec]]] = {}

    def spec(system, stage, variant, precision, compile, chunked):
        chunk = TINY_LOSS_CHUNK if args.tiny and chunked else None  # None: GPTConfig's 256 tokens
        return Spec(system, TINY_XL if args.tiny else XL, stage=stage, batch=batch, seq=args.seq,
                    steps=args.steps + 2, warmup=args.warmup, vocab=args.vocab, precision=precision, compile=compile,
                    chunked_loss=chunked, loss_chunk_size=chunk,
                    label=f"{system} gpt2_xl" + (f" stage {stage}" if system == "zerogpt" else "")
                    + f" {variant} b{batch}x{args.seq}")
    for group, variant, precision, compile, chunked in VARIANTS:
        if args.tiny and compile:
            continue
        group = "A" if args.tiny else group
        groups.setdefault(group, []).extend(
            (variant, spec("zerogpt", stage, variant, precision, compile, chunked)) for stage in (0, 3))
    if "torch" in args.systems:
        groups["A"].append(("eager", spec("torch", 0, "eager", None, False, False)))
    return groups


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    groups = plan(args)
    rows = result["rows"] = []
    names = list(groups)
    for k, name in enumerate(names):
        log(f"  group {name}: " + ", ".join(dict.fromkeys(v for v, _ in groups[name])))
        got = measure_group(budget, [s for _, s in groups[name]], WEIGHTS[name],
                            sum(WEIGHTS[n] for n in names[k + 1:]), reserve, result["skipped"])
        rows += [dict(r, variant=variant) for (variant, _), r in zip(groups[name], got)]
        save()
    eager_first = {(r["spec"]["system"], r["spec"]["stage"]): r.get("first_step_s") for r in rows
                   if r["variant"] == "eager" and "error" not in r}
    table = []
    for r in rows:
        key = (r["spec"]["system"], r["spec"]["stage"])
        first, base = r.get("first_step_s"), eager_first.get(key)
        table.append(dict(system=key[0], stage=key[1], variant=r["variant"], mfu=r.get("mfu"), tflops=r.get("tflops"),
                          tokens_per_s=r.get("tokens_per_s"), peak_gpu_gib=r.get("peak_gpu_gib"),
                          first_step_s=first, first_loss=r["losses"][0] if r.get("losses") else None,
                          chunked_loss_ran=r.get("chunked_loss_ran"),
                          compile_s=first - base if r["spec"]["compile"] and None not in (first, base) else None,
                          error=f"{r['error']}: {r.get('detail', '')}"[:300] if "error" in r else None))
    note_failures(result, rows)
    result["table"] = table
    zerogpt = [t for t in table if t["system"] == "zerogpt" and t["mfu"]]
    best = max(zerogpt, key=lambda t: t["mfu"], default=None)
    figures = result["figures"]
    figures["mfu_best"] = best["mfu"] if best else None
    figures["mfu_best_what"] = f"GPT-2 XL b8, stage {best['stage']}, {best['variant']}" if best else None
    for stage in (0, 3):
        eager = [t["mfu"] for t in zerogpt if t["stage"] == stage and t["variant"] == "eager"]
        figures[f"mfu_eager_stage{stage}"] = eager[0] if eager else None
