"""The largest slice: Llama-3.1-8B's shape at stage 3 with everything offloaded (parameters and optimizer on the
host) and bf16 Adam moments, zerogpt, then DeepSpeed ZeRO-Offload at the same size.

The depth is the deepest Llama-3 (widths of the 8B: 4096 hidden, 32 q / 8 kv heads, SwiGLU 14336, vocab 128256)
whose parameters times --largest-bytes-per-param fit the host RAM free less the reserve, capped at
--largest-max-layers (32: the 8B itself, the goal's size). One try each (a 9-minute slice holds one 8B build
per system): zerogpt builds on the meta device and fills each shard from the model's init_param_range, as
train_gpt.py does; DeepSpeed builds model_zoo's same module under deepspeed.zero.Init (fp32 moments: it has no
bf16 ones). Recorded: params, host bytes/param (the larger of the build's and the steps' peak RSS over the
params), build seconds, step seconds, and what stopped a try; a DeepSpeed killed while building gives how long
it had built, a floor on its build time.
"""
from __future__ import annotations

import psutil
import torch

import gpu_measure
from gpu_slices.runner import Spec, log, measure_group, note_failures

FULL, TINY = (32, 4096), (4, 64)  # (num_attention_heads, hidden_size)
WEIGHTS = dict(zerogpt=62, deepspeed=38)


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


def _bytes_per_param(row: dict) -> float:
    return max(row["peak_host_gib"], row["build_peak_host_gib"]) * 2**30 / row["params"]


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    depth = result["depth"] = choose_depth(args)
    layers, (heads, hidden) = depth["layers"], TINY if args.tiny else FULL
    state_dtype = None if args.tiny else "bf16"  # tiny: fp32 moments (the bf16 ones need the host-Adam op built)
    log(f"  Llama-3 at {layers} layers = {depth['params'] / 1e9:.2f}B params ({depth['layers_that_fit']} would fit "
        f"{depth['host_free_less_reserve_gib']:.0f} GiB at {args.largest_bytes_per_param} B/param)")
    systems = [s for s in ("zerogpt", "deepspeed") if s in args.systems]
    for s in ("zerogpt", "deepspeed"):
        if s not in systems:
            result["skipped"].append(f"{s}: not in --systems {','.join(args.systems)}")
    rows: dict[str, dict] = {}
    for k, system in enumerate(systems):
        spec = Spec(system, (layers, heads, hidden), model="llama3_8b", stage=3, offload="cpu+param", batch=1,
                    seq=args.seq, steps=1, warmup=1, checkpoint=True, meta_init=True, vocab=args.llama_vocab,
                    state_dtype=state_dtype if system == "zerogpt" else None,
                    label=f"{system} llama3 {layers}L ({depth['params'] / 1e9:.2f}B) everything offloaded"
                          + (", bf16 moments" if system == "zerogpt" and state_dtype else ""))
        later = sum(WEIGHTS[s] for s in systems[k + 1:])
        got = measure_group(budget, [spec], WEIGHTS[system], later, reserve, result["skipped"])
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
                       largest_state_dtype=state_dtype, largest_build_s=z["build_s"])
        figures["largest_tried"] = f"{what}: trained, {z['step_s']:.1f} s/step"
    elif z is not None:
        where = f" while {z['stopped_in']} at {z['part_s']:.0f} s" if z.get("stopped_in") else ""
        figures["largest_tried"] = f"{what}: {z['error']}{where}"
    if d is not None and "error" not in d:
        figures["deepspeed_build_s"] = d["build_s"]
    elif d is not None:
        if d.get("stopped_in") == "build":
            figures["deepspeed_unbuilt_after_s"] = d["part_s"]
        notes["deepspeed_build_s"] = f"DeepSpeed at {what}: {d['error']}" + (
            f" while {d['stopped_in']} at {d['part_s']:.0f} s" if d.get("stopped_in") else "")
    if notes:
        figures["notes"] = notes
    note_failures(result, list(rows.values()))
