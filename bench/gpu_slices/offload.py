"""The offload slice: GPT-2 XL (1.56B) at stage 3 with the optimizer on the host, zerogpt against DeepSpeed
ZeRO-Offload, at two batch shapes in the same run: the shipped config's (configs/gpt2_xl_zero3_offload.py: its
micro-batch x accumulation x seq, bucket and prefetch) and 16k tokens per step (16 x 1024, one micro-batch), both
clipping the gradient norm as the config does (its clip_grad_norm; DeepSpeed's gradient_clipping: a clipped step is
one whose speculative host step is taken again; the H200's rows of 2026-11-28 did not clip).
zerogpt's group ends with two lever rows, last so that a short budget cuts them first: the 16k step with bf16 Adam
moments (`state_dtype="bf16"`: the host step moves 20 bytes per param, not 28; DeepSpeed has no such moments), and
the 16k step with the host step on 80% of the cores (`host.step_threads`, SuperOffload's share: the rest stay with
the thread that launches forward and backward, which the host step runs beside).

Each system runs its two shapes in its own process with half the budget left: tokens/s, h2d/d2h bytes per step,
the optimizer-step call's wall seconds with the device synchronized around it (host work the backward did not
hide) and zerogpt's own host-step seconds (engine.last_host_step_s, the goal's "host step for 1.56B"), CPU
user/sys seconds per step. zerogpt's 16k row also profiles one more step into DIR/profile_offload.txt.
"""
from __future__ import annotations

import os

from gpu_slices.runner import REPO, Spec, log, measure_group, note_failures

SHIPPED_CONFIG = "configs/gpt2_xl_zero3_offload.py"
XL, TINY_XL = (48, 25, 1600), (4, 2, 64)


def shipped_shape(args) -> dict:
    """The shipped config's micro-batch, accumulation, sequence and ZeRO knobs (tiny: its shape shrunk)."""
    import zerogpt

    cfg = zerogpt.Config.from_file(os.path.join(REPO, SHIPPED_CONFIG))
    zero = dict(cfg.zero)
    strategy = zero.get("shard_strategy")
    out = dict(batch=cfg.BATCH_SIZE, accum=cfg.GRADIENT_ACCUMULATION, seq=cfg.SEQ_LEN, stage=zero["stage"],
               clip=cfg.clip_grad_norm,
               bucket_mb=getattr(strategy, "bucket_mb", None), prefetch=zero.get("prefetch"),
               offload="cpu+param" if dict(zero.get("offload_param") or {}).get("device") == "cpu" else "cpu")
    if args.tiny:
        out.update(batch=2, accum=max(1, out["accum"]), seq=args.seq)
    return out


def specs_for(system: str, args) -> list[Spec]:
    shipped, shape = shipped_shape(args), TINY_XL if args.tiny else XL
    k16_batch = 1 if args.tiny else 16
    extra = dict(bucket_mb=shipped["bucket_mb"], prefetch=shipped["prefetch"]) if system == "zerogpt" else {}
    common = dict(stage=3, checkpoint=True, vocab=args.vocab, time_step=True, steps=args.steps, warmup=args.warmup,
                  clip=shipped["clip"])
    profile = os.path.join(args.out, "profile_offload.txt") if system == "zerogpt" else None
    specs = [Spec(system, shape, offload=shipped["offload"], batch=shipped["batch"], accum=shipped["accum"],
                  seq=shipped["seq"], label=f"{system} shipped {shipped['batch']}x{shipped['seq']}x{shipped['accum']}",
                  **common, **extra),
             Spec(system, shape, offload="cpu", batch=k16_batch, seq=args.seq, profile_to=profile,
                  label=f"{system} 16k {k16_batch}x{args.seq}", **common)]
    if system == "zerogpt" and not args.tiny:  # tiny: the bf16 moments need the host-Adam op built
        specs.append(Spec(system, shape, offload="cpu", batch=k16_batch, seq=args.seq, state_dtype="bf16",
                          label=f"{system} 16k {k16_batch}x{args.seq}, bf16 moments", **common))
        cores = len(os.sched_getaffinity(0))
        threads = max(1, cores * 4 // 5)
        specs.append(Spec(system, shape, offload="cpu", batch=k16_batch, seq=args.seq, host_step_threads=threads,
                          label=f"{system} 16k {k16_batch}x{args.seq}, host step on {threads} of {cores} cores",
                          **common))
    return specs


def _pick(row: dict | None, key: str):
    return None if row is None or "error" in row else row.get(key)


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    result["shipped_shape"] = shipped_shape(args)
    rows: dict[str, list[dict | None]] = {}
    systems = [s for s in ("zerogpt", "deepspeed") if s in args.systems]
    for s in ("zerogpt", "deepspeed"):
        if s not in systems:
            result["skipped"].append(f"{s}: not in --systems {','.join(args.systems)}")
    for k, system in enumerate(systems):
        log(f"  {system}: the shipped config's shape, then 16k tokens per step")
        got = measure_group(budget, specs_for(system, args), 1, len(systems) - k - 1, reserve, result["skipped"])
        rows[system] = got + [None] * (4 - len(got))
        result["rows"] = [r for rs in rows.values() for r in rs if r]
        save()
    figures = result["figures"]
    z_shipped, z_16k, z_16k_bf16, z_16k_threads = rows.get("zerogpt", [None] * 4)
    d_shipped, d_16k, *_ = rows.get("deepspeed", [None] * 4)
    figures.update(shipped_zerogpt_tokens_per_s=_pick(z_shipped, "tokens_per_s"),
                   shipped_deepspeed_tokens_per_s=_pick(d_shipped, "tokens_per_s"),
                   k16_zerogpt_tokens_per_s=_pick(z_16k, "tokens_per_s"),
                   k16_deepspeed_tokens_per_s=_pick(d_16k, "tokens_per_s"),
                   k16_bf16_moments_zerogpt_tokens_per_s=_pick(z_16k_bf16, "tokens_per_s"),
                   k16_bf16_moments_host_step_s=_pick(z_16k_bf16, "engine_host_step_s"),
                   k16_host_step_threads_tokens_per_s=_pick(z_16k_threads, "tokens_per_s"),
                   k16_host_step_threads_host_step_s=_pick(z_16k_threads, "engine_host_step_s"),
                   host_step_s=_pick(z_shipped, "engine_host_step_s") or _pick(z_16k, "engine_host_step_s"))
    if _pick(z_shipped, "engine_host_step_s") is None and figures["host_step_s"] is not None:
        figures.setdefault("notes", {})["host_step_s"] = "from the 16k row"
    note_failures(result, result.get("rows", []))
    if os.path.exists(os.path.join(args.out, "profile_offload.txt")):
        result["profile"] = "profile_offload.txt"
