"""The largest slice: Llama-3.1-8B's shape at stage 3 with everything offloaded (parameters and optimizer on the
host) and bf16 Adam moments, zerogpt at the shipped config's step, then DeepSpeed ZeRO-Offload at the same size.

The depth is the deepest Llama-3 (widths of the 8B: 4096 hidden, 32 q / 8 kv heads, SwiGLU 14336, vocab 128256)
whose parameters times --largest-bytes-per-param fit the host RAM free less the reserve, capped at
--largest-max-layers (32: the 8B itself, the goal's size). One try each (a 9-minute slice holds one 8B build
per system): zerogpt builds on the meta device and fills each shard from the model's init_param_range, as
train_gpt.py does, then trains the step of configs/llama3_8b_zero3_offload.py as that file gives it (micro-batch x
accumulation x seq, chunked loss, checkpointing, bucket and prefetch: 8 x 1 x 8192 = 65,536 tokens now; lr,
weight decay and clipping are gpu_measure's, not the config's). DeepSpeed builds model_zoo's same module under
deepspeed.zero.Init (fp32 moments: it has no bf16 ones) and keeps its old step, 1 x --seq with the plain loss: it
has no chunked loss (the 65k-token step's logits alone would be 31 GiB in fp32, their gradient as much again), and
its try is for its build time and host bytes/param, not its speed. Recorded: params, host bytes/param (the larger
of the build's and the steps' peak RSS over the params), build seconds, step seconds, zerogpt's tokens/s at the
shipped step (`largest_tokens_per_s`: tokens per optimizer step / step seconds) and that step's shape, and what
stopped a try; a DeepSpeed killed while building gives how long it had built, a floor on its build time.
"""
from __future__ import annotations

import os

import psutil
import torch

import gpu_measure
from gpu_slices.runner import REPO, Spec, log, measure_group, note_failures

SHIPPED_CONFIG = "configs/llama3_8b_zero3_offload.py"
FULL, TINY = (32, 4096), (4, 64)  # (num_attention_heads, hidden_size)
TINY_BATCH, TINY_LOSS_CHUNK = 2, 32  # the tiny form's step: 2 x --seq (64) tokens, the loss in 4 chunks of 32
# Shares of the time left once the installs and op builds are done: ~400 s of the 540 (15 kept for the result;
# DeepSpeed's sdist install took 35 s on the 2-core VM, the two CPU Adam op builds are not yet timed on the GPU
# machine). zerogpt's try is one 8B build, then 1 warmup + 1 timed step of the shipped config's 65,536 tokens:
#   device: 57.9 GFLOP/token at seq 8192 (PaLM: 6N over the 7.5B non-embedding params = 45.0 G, + 12.9 G of
#     attention), x 4/3 for the checkpointed layers' recompute = 77 GFLOP/token, x 65,536 tokens = 5.1 PFLOP: ~13 s
#     at ~400 TFLOP/s (40% of the H100's dense bf16 peak, zerogpt's best MFU so far, GPT-2 XL, 2026-11-24);
#   host: Adam over 8.03B params, bf16 moments, 22 bytes/param through memory = 177 GB: 2-4 s at 40-80 GB/s, run
#     behind the next forward; 11 s at the first H100 run's 1.4 ns/param (1.56B in 2.15 s, older code), still
#     under the device's 13 s;
#   copies: 16 GB of bf16 params up twice (forward, recompute) and 16 GB of grads down, ~2 s at 25 GB/s, hidden
#     behind each layer's ~0.4 s of compute by prefetch 2. GPU memory: 34.6 GiB (the config's own estimate).
# So a step is ~13-25 s and the first one slower (allocations, pinned buffers): ~30-60 s for both, ~45 s more than
# the 1 x 1024 steps this try took before (~1-2 s each). The build is not yet timed at 8B on the GPU machine:
# 531M params built in 13.8 s on the 2-core VM (bench/README.md, Build time), ~210 s at 8B if 16 cores did no
# better. At 62 % zerogpt had ~230 s for its build and process start; 75 % of ~400 s = 300 s keeps that room with
# the two steps added. DeepSpeed gets the rest, at least 100 s plus what zerogpt leaves unused: enough for its
# build, or for a floor on it, which is all its try is for.
WEIGHTS = dict(zerogpt=75, deepspeed=25)


def params_at(layers: int, args) -> int:
    """Parameters of the slice's Llama at `layers` deep (a meta build: no storage)."""
    heads, hidden = TINY if args.tiny else FULL
    spec = Spec("zerogpt", (layers, heads, hidden), model="llama3_8b", vocab=args.llama_vocab, seq=args.seq)
    with torch.device("meta"):
        return sum(p.numel() for p in gpu_measure.build_model(spec, torch.device("meta")).parameters())


def choose_depth(args) -> dict:
    """The deepest model whose params x the expected bytes/param fit the host RAM free now, less the reserve."""
    fixed, per_layer = params_at(1, args), params_at(2, args) - params_at(1, args)
    fixed -= per_layer
    host = psutil.virtual_memory().available - args.host_reserve_gib * 2**30
    fits = int((host / args.largest_bytes_per_param - fixed) // per_layer)
    layers = max(1, min(fits, args.largest_max_layers))
    return dict(layers=layers, layers_that_fit=fits, params=fixed + layers * per_layer, per_layer_params=per_layer,
                host_free_less_reserve_gib=host / 2**30, bytes_per_param_expected=args.largest_bytes_per_param)


def shipped_step(args) -> dict:
    """The shipped 8B config's step as its file gives it: micro-batch, accumulation, sequence, checkpointing, the
    chunked loss and its chunk, bucket and prefetch (tiny: TINY_BATCH x --seq tokens, the loss in TINY_LOSS_CHUNK
    chunks, as the widths shrink)."""
    import zerogpt

    cfg = zerogpt.Config.from_file(os.path.join(REPO, SHIPPED_CONFIG))
    zero, model = dict(cfg.zero), dict(cfg.model)
    step = dict(batch=cfg.BATCH_SIZE, accum=cfg.GRADIENT_ACCUMULATION, seq=cfg.SEQ_LEN,
                checkpoint=bool(model.get("checkpoint")), chunked_loss=bool(model.get("chunked_loss")),
                loss_chunk_size=model.get("loss_chunk_size"),
                bucket_mb=getattr(zero.get("shard_strategy"), "bucket_mb", None), prefetch=zero.get("prefetch"))
    if args.tiny:
        step.update(batch=TINY_BATCH, seq=args.seq, loss_chunk_size=TINY_LOSS_CHUNK if step["chunked_loss"] else None)
    return step


def step_shape(step: dict) -> str:
    """The step in words, as the goals table shows it: "8 x 8192 tokens, chunked loss, checkpointing, ..."."""
    accum = f" x {step['accum']} accumulation" if step["accum"] > 1 else ""
    return ", ".join([f"{step['batch']} x {step['seq']}{accum} tokens"]
                     + (["chunked loss"] if step["chunked_loss"] else [])
                     + (["checkpointing"] if step["checkpoint"] else [])
                     + ([f"bucket {step['bucket_mb']:g} MB"] if step["bucket_mb"] is not None else [])
                     + ([f"prefetch {step['prefetch']}"] if step["prefetch"] is not None else []))


def spec_for(system: str, args, depth: dict, step: dict) -> Spec:
    """zerogpt at the shipped config's `step`, bf16 moments (tiny: fp32, the bf16 ones need the host-Adam op
    built); DeepSpeed at 1 x --seq with the plain loss and checkpointing."""
    layers, (heads, hidden) = depth["layers"], TINY if args.tiny else FULL
    common = dict(model="llama3_8b", stage=3, offload="cpu+param", steps=1, warmup=1, meta_init=True,
                  vocab=args.llama_vocab)
    what = f"llama3 {layers}L ({depth['params'] / 1e9:.2f}B) everything offloaded"
    if system != "zerogpt":
        return Spec(system, (layers, heads, hidden), batch=1, seq=args.seq, checkpoint=True,
                    label=f"{system} {what}, 1 x {args.seq}", **common)
    state_dtype = None if args.tiny else "bf16"
    return Spec(system, (layers, heads, hidden), batch=step["batch"], accum=step["accum"], seq=step["seq"],
                checkpoint=step["checkpoint"], chunked_loss=step["chunked_loss"],
                loss_chunk_size=step["loss_chunk_size"], bucket_mb=step["bucket_mb"], prefetch=step["prefetch"],
                state_dtype=state_dtype, label=f"zerogpt {what}" + (", bf16 moments" if state_dtype else "")
                + f", shipped step {step['batch']} x {step['seq']} x {step['accum']}", **common)


def _bytes_per_param(row: dict) -> float:
    return max(row["peak_host_gib"], row["build_peak_host_gib"]) * 2**30 / row["params"]


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    depth = result["depth"] = choose_depth(args)
    step = result["shipped_step"] = shipped_step(args)
    layers = depth["layers"]
    log(f"  Llama-3 at {layers} layers = {depth['params'] / 1e9:.2f}B params ({depth['layers_that_fit']} would fit "
        f"{depth['host_free_less_reserve_gib']:.0f} GiB at {args.largest_bytes_per_param} B/param); zerogpt's "
        f"step: {step_shape(step)} ({SHIPPED_CONFIG})")
    systems = [s for s in ("zerogpt", "deepspeed") if s in args.systems]
    for s in ("zerogpt", "deepspeed"):
        if s not in systems:
            result["skipped"].append(f"{s}: not in --systems {','.join(args.systems)}")
    rows: dict[str, dict] = {}
    for k, system in enumerate(systems):
        later = sum(WEIGHTS[s] for s in systems[k + 1:])
        got = measure_group(budget, [spec_for(system, args, depth, step)], WEIGHTS[system], later, reserve,
                            result["skipped"])
        if got:
            rows[system] = got[0]
            if "error" not in got[0]:
                got[0]["host_bytes_per_param"] = _bytes_per_param(got[0])
        result["rows"] = list(rows.values())
        save()
    figures, notes = result["figures"], {}
    z, d = rows.get("zerogpt"), rows.get("deepspeed")
    what = f"{depth['params'] / 1e9:.2f}B ({layers} layers)"
    if z is not None and "error" not in z:
        figures.update(largest_params=z["params"], largest_host_bytes_per_param=z["host_bytes_per_param"],
                       largest_state_dtype=z["spec"]["state_dtype"], largest_build_s=z["build_s"],
                       largest_tokens_per_s=z["tokens_per_s"], largest_step_shape=step_shape(step))
        figures["largest_tried"] = (f"{what}: trained, {z['step_s']:.1f} s/step of {z['tokens_per_step']:,} "
                                    f"tokens")
    elif z is not None:
        where = f" while {z['stopped_in']} at {z['part_s']:.0f} s" if z.get("stopped_in") else ""
        figures["largest_tried"] = f"{what}: {z['error']}{where}"
        if z.get("built"):  # the build finished and the step failed: the build's figures still stand
            built = z["built"]
            figures.update(largest_params=built["params"], largest_build_s=built["build_s"],
                           largest_state_dtype=z["spec"]["state_dtype"],
                           largest_host_bytes_per_param=built["build_peak_host_gib"] * 2**30 / built["params"])
            notes["largest_host_bytes_per_param"] = (f"the build's host peak only: the shipped step "
                                                     f"({step_shape(step)}) failed, {z['error']}{where}")
    if d is not None and "error" not in d:
        figures["deepspeed_build_s"] = d["build_s"]
    elif d is not None and d.get("built"):
        figures["deepspeed_build_s"] = d["built"]["build_s"]
        notes["deepspeed_build_s"] = f"DeepSpeed at {what} built; its step failed: {d['error']}"
    elif d is not None:
        if d.get("stopped_in") == "build":
            figures["deepspeed_unbuilt_after_s"] = d["part_s"]
        notes["deepspeed_build_s"] = f"DeepSpeed at {what}: {d['error']}" + (
            f" while {d['stopped_in']} at {d['part_s']:.0f} s" if d.get("stopped_in") else "")
    if notes:
        figures["notes"] = notes
    note_failures(result, list(rows.values()))
