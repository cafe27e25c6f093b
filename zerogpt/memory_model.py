"""The memory model of a zerogpt run: bytes per rank on device, host and disk, as pure functions of ints.

Model states (`model_state_bytes`, the ZeRO-paper accounting as the engine holds it), activations (Korthikanti et
al. 2022) and chunk buffers in flight. The engine's `memory_stats()` measures the same categories and tests compare
the two. Preflight refuses a run that cannot fit with it (zerogpt/preflight_memory.py); the `zerogpt_tools.estimate`
CLI prints it for a model before you launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zerogpt.zero.strategy import BucketTensorShardStrategy, TensorShardStrategy

__all__ = ["HOMES", "CATEGORIES", "PRECISIONS", "ModelShape", "model_state_bytes", "zero_paper_bytes",
           "activation_bytes", "chunk_of_params", "gather_peak", "buffer_bytes", "estimate",
           "grad_crosses_once"]

HOMES = ("device", "host", "disk")
CATEGORIES = ("params", "grads", "master", "optimizer")
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of params/activations in compute dtype


@dataclass(frozen=True)
class ModelShape:
    """A GPT-2-style decoder (tied wte/lm_head, learned positions, 4h MLP, biases, pre-LN)."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    positions: int = 1024
    pad_vocab_multiple: int = 64  # model_zoo pads the embedding rows to a multiple of 64

    @property
    def padded_vocab(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab + m - 1) // m * m

    @property
    def num_params(self) -> int:
        """wte (tied with lm_head) + wpe + L x (12h^2 + 13h) + final LayerNorm (2h)."""
        h = self.hidden
        return self.padded_vocab * h + self.positions * h + self.layers * (12 * h * h + 13 * h) + 2 * h

    @property
    def largest_param(self) -> int:
        return max(self.padded_vocab * self.hidden, 4 * self.hidden * self.hidden)

    def param_numels(self) -> list[tuple[str, int]]:
        """(owning module, numel) of each parameter in model_zoo's (and HF GPT-2's) registration order, the
        order chunks are packed in and the order the modules run: wte, wpe, the 12 of each block `h.i` (owned by
        `h.i.ln_1`, `h.i.attn.c_attn`, `h.i.attn.c_proj`, `h.i.ln_2`, `h.i.mlp.c_fc`, `h.i.mlp.c_proj`, a
        weight and a bias each), ln_f's 2 (the head is wte's weight)."""
        h, inner = self.hidden, 4 * self.hidden
        block = [("ln_1", h), ("ln_1", h), ("attn.c_attn", 3 * h * h), ("attn.c_attn", 3 * h),
                 ("attn.c_proj", h * h), ("attn.c_proj", h), ("ln_2", h), ("ln_2", h),
                 ("mlp.c_fc", inner * h), ("mlp.c_fc", inner), ("mlp.c_proj", inner * h), ("mlp.c_proj", h)]
        out = [("wte", self.padded_vocab * h), ("wpe", self.positions * h)]
        for i in range(self.layers):
            out += [(f"h.{i}.{module}", n) for module, n in block]
        return out + [("ln_f", h), ("ln_f", h)]


def _check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def grad_crosses_once(stage: int, accumulation: int) -> bool:
    """Whether an offloaded step's gradient reaches the host in one crossing per chunk, the reduced shard as it
    is: stages 0-1 reduce once per step, stages 2-3 every micro-step (so once at accumulation 1)."""
    return stage <= 1 or accumulation == 1


def model_state_bytes(num_params: int, stage: int, world_size: int = 1, precision: str = "bf16",
                      offload_optimizer: str = "none", offload_param: str = "none",
                      optimizer_bytes_per_param: int = 8, accumulation: int = 1) -> dict[str, dict[str, int]]:
    """Peak model-state bytes on ONE rank, as our engine holds them (chunk padding ignored).

    ZeRO paper (Rajbhandari et al. 2020, Fig. 1; mixed precision + Adam, K=12): 16Psi, 4Psi+12Psi/N,
    2Psi+14Psi/N, 16Psi/N for stages 0-3. Our engine differs in one place: reduced gradients land in an
    **fp32** grad shard next to the master (4 B/param/N, not 2), so stage 2 is 2Psi+16Psi/N and stage 3
    is 18Psi/N in bf16/fp16; stages 0/1 keep full compute-dtype grads while accumulating and convert
    them chunk by chunk into fp32 shards at the boundary, so their grad peak is max(c Psi, 4 Psi/N_opt)
    per home (stage 0 mixed: 18Psi; stage 1: 4Psi+12Psi/N for N >= 2). In fp32 the master *is* the
    param shard when the params rest where the optimizer lives (16Psi ... 16Psi/N; stage 3 with param and
    optimizer offload: 16Psi/N on the host); otherwise a separate fp32 master is kept where the optimizer runs.
    With the optimizer offloaded, a step's gradient that crosses to the host once (stages 0-1, or accumulation
    1) is kept there as it crossed, in the compute dtype: stage 3 with param and optimizer offload in bf16 is
    2 + 2 + 4 + 8 = 16Psi/N on the host, the paper's figure.

    Args:
        num_params: Psi, trainable parameters (tied weights counted once).
        stage: ZeRO stage 0-3.  world_size: N, data-parallel ranks.
        precision: "fp32" | "bf16" | "fp16" (params/grads compute dtype; masters and Adam are fp32).
        offload_optimizer: "none" | "cpu" | "disk": where master + optimizer state (and grad shards: host for
            both cpu and disk) live. Offloaded, a step's gradient that crosses to the host once stays there in
            the compute dtype (bf16: 2 B/param/N, not 4) until the step.
        offload_param: "none" | "cpu": where stage-3 param shards rest between uses.
        optimizer_bytes_per_param: 8 for Adam (exp_avg + exp_avg_sq in fp32), 4 for SGD+momentum.
        accumulation: micro-steps per optimizer step. Above 1 at stages 2-3 with the optimizer offloaded and the
            params on the device, the reduced gradients accumulate in an fp32 shard on the device and cross to
            the host once per step (4 B/param/N more on the device).
    Returns:
        {"params"|"grads"|"master"|"optimizer": {"device"|"host"|"disk": bytes}} -- the same layout as
        `engine.memory_stats()`.

    Example:
        >>> b = model_state_bytes(10**9, stage=3, world_size=8, precision="bf16")
        >>> sum(b[c]["device"] for c in b) == 18 * 10**9 // 8
        True
    """
    _check_choice("stage", stage, (0, 1, 2, 3))
    _check_choice("precision", precision, tuple(PRECISIONS))
    _check_choice("offload_optimizer", offload_optimizer, ("none", "cpu", "disk"))
    _check_choice("offload_param", offload_param, ("none", "cpu"))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param needs stage 3, got stage {stage}; use --stage 3 or --offload-param none")
    c = PRECISIONS[precision]
    psi = num_params
    n_opt = 1 if stage == 0 else world_size  # master/optimizer/grad shards: 1/N from stage 1 on

    def per_rank(nbytes_per_param: int, shards: int) -> int:
        return math.ceil(psi / shards) * nbytes_per_param

    out = {cat: dict.fromkeys(HOMES, 0) for cat in CATEGORIES}
    optim_home = {"none": "device", "cpu": "host", "disk": "disk"}[offload_optimizer]
    grad_home = "device" if optim_home == "device" else "host"
    param_home = "host" if offload_param == "cpu" else "device"

    # params: full compute-dtype copy at stages 0-2; only this rank's shard at stage 3
    out["params"][param_home] += per_rank(c, world_size if stage == 3 else 1)
    # grads: fp32 shards at every stage (reduced grads land there) + full compute-dtype grads at
    # stages 0/1 (held while accumulating); the two never peak together within one home
    shard_grads = per_rank(4, n_opt)
    full_grads = per_rank(c, 1) if stage <= 1 else 0
    if grad_home == "device":
        out["grads"]["device"] = max(full_grads, shard_grads)
    else:
        # the step's one crossing is kept on the host as it crossed, in the compute dtype
        # (ChunkState.keeps_as_crossed); a sum over micro-steps: fp32
        crossed = c if grad_crosses_once(stage, accumulation) else 4
        out["grads"]["device"], out["grads"]["host"] = full_grads, per_rank(crossed, n_opt)
        if stage >= 2 and param_home == "device" and accumulation > 1:  # the device-side sum (issue 29)
            out["grads"]["device"] = shard_grads
    # master: aliased to the param shard in fp32 when the params rest where the optimizer lives (both on the
    # device, or both on the host: stage 3 with param and optimizer offload); apart otherwise
    if not (precision == "fp32" and optim_home == param_home):
        out["master"][optim_home] += per_rank(4, n_opt)
    out["optimizer"][optim_home] += per_rank(optimizer_bytes_per_param, n_opt)
    return out


def zero_paper_bytes(num_params: int, stage: int, world_size: int) -> tuple[str, int]:
    """The ZeRO paper's per-rank model states (mixed precision, Adam, K=12) for reference."""
    psi, n = num_params, world_size
    return [("16Psi", 16 * psi), ("4Psi+12Psi/N", 4 * psi + 12 * psi // n),
            ("2Psi+14Psi/N", 2 * psi + 14 * psi // n), ("16Psi/N", 16 * psi // n)][stage]


def activation_bytes(shape: ModelShape, seq_len: int, batch: int, precision: str = "bf16",
                     checkpoint: bool = False, flash: bool = True, dropout: bool = False) -> dict[str, int]:
    """Activation bytes saved for backward on one rank (no tensor/sequence parallelism).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1:
    per layer s*b*h*(34 + 5*a*s/h) bytes with 2-byte activations and 1-byte dropout masks, i.e.
    16e*sbh + (2e)*a*s^2*b + masks (2sbh + a*s^2*b) for element size e. SDPA/flash attention saves no
    s x s scores (only a tiny logsumexp), so the s^2 term drops (`flash=True`, what model_zoo uses);
    with dropout 0 (model_zoo's default) there are no masks. Full per-block checkpointing keeps only
    each block's input (e*sbh per layer) plus one block's activations while it is recomputed.
    The loss head keeps compute-dtype logits, their fp32 copy and fp32 log-probs: s*b*V*(e + 8) (e + 4 in fp32).

    Returns: dict(per_layer, layers, embeddings, logits, total) in bytes.
    """
    e = PRECISIONS[precision]
    s, b, h, a, L = seq_len, batch, shape.hidden, shape.heads, shape.layers
    sbh = s * b * h
    per_layer = 16 * e * sbh + (2 * sbh if dropout else 0)
    if not flash:
        per_layer += (2 * e + (1 if dropout else 0)) * a * s * s * b
    layers = L * e * sbh + per_layer if checkpoint else L * per_layer
    embeddings = e * sbh + (sbh if dropout else 0)
    logits = s * b * shape.vocab * (e + (4 if e == 4 else 8))
    return dict(per_layer=per_layer, layers=layers, embeddings=embeddings, logits=logits,
                total=layers + embeddings + logits)


def chunk_of_params(numels: list[int], element_size: int, bucket_mb: float) -> list[int]:
    """The chunk index of each parameter, packed in order as the engine packs one param group
    (zero/strategy.py: BucketTensorShardStrategy(bucket_mb); bucket_mb 0: TensorShardStrategy, one per chunk).

    Example:
        >>> chunk_of_params([3, 3, 3, 9], element_size=1, bucket_mb=8 / 2**20)  # 8-byte buckets
        [0, 0, 1, 2]
    """
    strategy = BucketTensorShardStrategy(bucket_mb) if bucket_mb > 0 else TensorShardStrategy()
    out = [0] * len(numels)
    for index, group in enumerate(strategy.group(numels, element_size)):
        for i in group:
            out[i] = index
    return out


def gather_peak(shape: ModelShape, precision: str, prefetch: int, bucket_mb: float, world_size: int = 1,
                per_block: bool = False) -> tuple[int, int]:
    """Stage 3: the most chunks, and the most elements, that one rank holds gathered at once.

    Packs the shape's parameters into chunks as the engine does (`chunk_of_params`: one param group, so a chunk
    may hold parameters of several modules, or the end of one block and the start of the next), then walks the
    hooked modules as zero/gather_hooks.py's Stage3GatherHooks does, forward and backward (the reverse). The
    hooked modules are those owning parameters (wte, wpe, each block's ln_1, attn c_attn, attn c_proj, ln_2,
    mlp c_fc, mlp c_proj, then ln_f and the head, which owns wte's weight), or with `per_block`
    (`compile = True`, `gather_per_block`) each block whole in place of its six. A module gathers its chunks and
    the next `prefetch` gather units of the recorded order. A unit is one chunk in eager runs (listed once per
    module that gathers it, so a prefetch may land on a chunk held already) and one module's chunks per block.
    Backward records a chunk at its first use only, and a module with no new chunk gathers nothing. A chunk stays
    gathered until the last module using it in the pass has run (forward: its remaining uses; backward: its last
    gradient), so the tied embedding/head chunk is held from the embedding to the head and through backward; the
    end of forward keeps the chunks of backward's first `prefetch` units. Chunks are counted padded to a multiple
    of `world_size`. Assumes every prefetch hits (the recorded order repeats: from the second step on).

    Returns: (chunks, elements), each the maximum over forward and backward.
    Example:
        >>> shape = ModelShape(layers=2, hidden=64, heads=2, vocab=128, positions=16)
        >>> gather_peak(shape, "fp32", 2, 0), gather_peak(shape, "fp32", 2, 0, per_block=True)
        ((5, 41280), (27, 109184))
    """
    c = PRECISIONS[precision]
    params = shape.param_numels()
    chunk_of = chunk_of_params([n for _, n in params], c, bucket_mb)
    sizes: dict[int, int] = {}
    for (_, n), chunk in zip(params, chunk_of):
        sizes[chunk] = sizes.get(chunk, 0) + n
    padded = {chunk: math.ceil(n / world_size) * world_size for chunk, n in sizes.items()}
    owners: dict[str, set[int]] = {}  # the hooked modules in forward order, each with its chunks
    for (module, _), chunk in zip(params, chunk_of):
        if per_block and module.startswith("h."):
            module = ".".join(module.split(".")[:2])  # h.3.attn.c_attn -> h.3
        owners.setdefault(module, set()).add(chunk)
    forward = [sorted(chunks) for chunks in owners.values()] + [sorted(owners["wte"])]  # the head: wte's weight
    backward = forward[::-1]
    # what each module gathers and records: forward, all of its chunks; backward, those not gathered yet in it
    seen: set[int] = set()
    backward_new = []
    for chunks in backward:
        backward_new.append([ch for ch in chunks if ch not in seen])
        seen.update(chunks)

    def units(gathered: list[int]) -> list[tuple[int, ...]]:  # what a gather adds to the recorded order
        if not gathered:
            return []
        return [tuple(gathered)] if per_block else [(ch,) for ch in gathered]

    kept = {ch for unit in [u for new in backward_new for u in units(new)][:prefetch] for ch in unit}
    most_chunks = most_elements = 0
    for modules, gathers, keep in ((forward, forward, kept), (backward, backward_new, set())):
        order = [u for gathered in gathers for u in units(gathered)]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, chunks in enumerate(modules):
            for ch in chunks:
                first.setdefault(ch, i)
                last[ch] = i
        pos = 0  # units recorded so far
        for i, (chunks, gathered) in enumerate(zip(modules, gathers)):
            if not gathered:  # no gather: what is held only shrinks
                continue
            pos += len(units(gathered))
            held = set(chunks).union(*order[pos : pos + prefetch])
            held |= {ch for ch in first if first[ch] < i and (last[ch] > i or ch in keep)}
            most_chunks = max(most_chunks, len(held))
            most_elements = max(most_elements, sum(padded[ch] for ch in held))
    return most_chunks, most_elements


def buffer_bytes(shape: ModelShape, stage: int, world_size: int, precision: str, offload_optimizer: str,
                 prefetch: int = 2, bucket_mb: float = 25.0, gather_per_block: bool = False) -> dict[str, int]:
    """Chunk buffers in flight on one rank, by home.

    A chunk holds up to `bucket_mb` MiB of params, or one parameter if larger (the embedding). Stage 3 holds the
    chunks `gather_peak` counts, at their real sizes in compute dtype: a module's, the next `prefetch` chunks
    of the recorded order (with `gather_per_block`, `compile = True`: a whole block's and the next `prefetch`
    modules'), and those used before and after (the tied embedding's). Stages 2/3 keep about two full-size grad
    chunks in flight (one filling, one reducing). Disk offload streams master + Adam state of the current and the
    read-ahead chunk shard (12 B/param) through host RAM.
    """
    if prefetch < 0:  # as zero.prefetch is checked
        raise ValueError(f"prefetch must be an int >= 0 (0 = no prefetch), got {prefetch!r}")
    c = PRECISIONS[precision]
    chunk_numel = max(int(bucket_mb * 2**20) // c if bucket_mb > 0 else 0, shape.largest_param)
    out = dict.fromkeys(HOMES, 0)
    if stage == 3:
        out["device"] += gather_peak(shape, precision, prefetch, bucket_mb, world_size, gather_per_block)[1] * c
    if stage >= 2:
        out["device"] += 2 * chunk_numel * c
    if offload_optimizer == "disk":
        out["host"] += 2 * math.ceil(chunk_numel / (1 if stage == 0 else world_size)) * 12
    return out


def estimate(shape: ModelShape, stage: int, world_size: int = 1, precision: str = "bf16",
             offload_optimizer: str = "none", offload_param: str = "none", seq_len: int = 1024,
             batch: int = 1, checkpoint: bool = False, flash: bool = True, dropout: bool = False,
             prefetch: int = 2, bucket_mb: float = 25.0, gpu_overhead: int = 2**30, accumulation: int = 1,
             optimizer_bytes_per_param: int = 8, gather_per_block: bool = False) -> dict:
    """Everything on one rank: model states, activations, buffers, totals per home (bytes).

    `optimizer_bytes_per_param`: 8 for Adam's moments in fp32, 4 in bf16 (zero.offload_optimizer.state_dtype).
    `gather_per_block`: stage 3 gathers each block whole (`compile = True`; see `buffer_bytes`).
    """
    states = model_state_bytes(shape.num_params, stage, world_size, precision, offload_optimizer, offload_param,
                               optimizer_bytes_per_param, accumulation)
    acts = activation_bytes(shape, seq_len, batch, precision, checkpoint, flash, dropout)
    buffers = buffer_bytes(shape, stage, world_size, precision, offload_optimizer, prefetch, bucket_mb,
                           gather_per_block)
    totals = {h: sum(states[cat][h] for cat in CATEGORIES) + buffers[h] for h in HOMES}
    totals["device"] += acts["total"] + gpu_overhead
    return dict(num_params=shape.num_params, model_states=states, activations=acts, buffers=buffers,
                gpu_overhead=gpu_overhead, totals=totals)
