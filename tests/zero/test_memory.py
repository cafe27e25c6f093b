"""engine.memory_stats(): model-state bytes per rank, by {params, grads, master, optimizer} x
{device, host, disk}, measured from the live tensors, against the ZeRO paper (Rajbhandari et al.
2020, §3 and Figure 1) for mixed-precision Adam with Ψ parameters on N ranks:

    stage 0: 16Ψ   stage 1: 4Ψ + 12Ψ/N   stage 2: 2Ψ + 14Ψ/N   stage 3: 16Ψ/N
    = 2 bytes/param of fp16 params + 2 of fp16 grads + 12 of fp32 master, Adam m and v (K = 12),
      each term whole or 1/N depending on the stage.

This engine keeps gradients only from backward() to step(), and reduces them into fp32 shards (4
bytes per owned element, for accumulation precision) rather than keeping fp16 grads: so the grads
term is measured at the moments it exists, and it is what the test asserts at each moment:
  * right after step() + zero_grad():       no gradient buffer at all (every stage);
  * after a backward() mid-accumulation:    stages 0/1 the unreduced full grads, compute dtype (they reduce
                                            once per optimizer step); stages 2/3 the fp32 shard only;
  * after the boundary backward(), pre-step: the fp32 reduced grads, full at stage 0, 1/N at stages 1-3.
Padding is counted (every shard is ceil(numel/N)); at stage 3 the chunks in flight are counted too:
inside a layer's forward exactly that layer's chunks and the next PREFETCH chunks hold full buffers.
fp32: the master is the parameter shard itself (aliased), so master bytes are 0.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from tests.zero.reference import cpu_ctx

PREFETCH = 2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PRECISIONS = ["bf16", "fp16", "fp32"]
# uneven widths: nothing divisible by 2 or 3, so every N > 1 pads; layer 1 is frozen
WIDTHS = [7, 13, 5, 11, 3]
FROZEN_LAYER = 1


def uneven_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])])
    layers[FROZEN_LAYER].requires_grad_(False)
    return layers


def even_mlp() -> nn.Sequential:
    """Ψ = 72 + 6 = 78, both divisible by 1, 2 and 3: no padding, so the paper's formula holds literally."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 6))


def _param_sizes(model: nn.Module) -> list[tuple[int, bool]]:
    return [(p.numel(), p.requires_grad) for p in model.parameters()]


def expected_bytes(sizes: list[tuple[int, bool]], stage: int, world: int, precision: str, moment: str) -> dict:
    """Per-category bytes on one rank, one parameter per chunk (TensorShardStrategy), at `moment`."""
    b = DTYPE_BYTES[precision]
    shards = 1 if stage == 0 else world
    shard = [math.ceil(n / shards) for n, _ in sizes]  # this rank's shard, padding included
    full = [s * shards for s in shard]  # the padded chunk
    trainable_shard = sum(s for s, (_, t) in zip(shard, sizes) if t)
    trainable_full = sum(f for f, (_, t) in zip(full, sizes) if t)
    params = b * (sum(shard) if stage == 3 else sum(full))
    grads = {
        "after_step": 0,
        "mid_accumulation": b * trainable_full if stage <= 1 else 4 * trainable_shard,
        "boundary": 4 * trainable_shard,
    }[moment]
    master = 0 if precision == "fp32" else 4 * trainable_shard
    return {"params": params, "grads": grads, "master": master, "optimizer": 8 * trainable_shard}


def paper_bytes(stage: int, world: int, psi: int) -> float:
    """ZeRO paper, mixed-precision Adam (K = 12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / world, 2: 2 * psi + 14 * psi / world, 3: 16 * psi / world}[stage]


def paper_grad_bytes(stage: int, world: int, psi: int) -> float:
    """The paper's gradient term: 2 bytes/param of fp16 grads, whole at stages 0-1, 1/N at 2-3."""
    return 2 * psi if stage <= 1 else 2 * psi / world


# ----------------------------------------------------------------------------------------------
# one rank's measurements


def _totals(stats: dict) -> dict:
    for category, homes in stats.items():
        assert homes["host"] == 0 and homes["disk"] == 0, f"{category}: nothing is offloaded here: {homes}"
    return {category: homes["device"] for category, homes in stats.items()}


def _measure(rank: int, world: int, build, stage: int, precision: str) -> dict:
    """Two optimizer steps of 2 micro-batches; snapshots of memory_stats() at each moment of step 2."""
    import zerogpt
    from zerogpt.zero import TensorShardStrategy

    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cfg = zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=TensorShardStrategy(), prefetch=PREFETCH),
                              precision=precision, GRADIENT_ACCUMULATION=2))
    engine = zerogpt.initialize(model, opt, config=cfg, ctx=cpu_ctx(rank, world))
    dtype = next(c.dtype for c in engine.chunks)
    snaps: dict = {"in_forward": []}
    in_layer = len(model) - 2  # inside this layer's forward: its chunks + the next layer's (prefetched)
    if len(model) > 2:
        model[in_layer].register_forward_pre_hook(lambda m, a: snaps["in_forward"].append(engine.memory_stats()))
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        for micro in range(2):
            x = torch.randn(4, model[0].in_features, generator=g).to(dtype)
            engine.backward(engine(x).float().pow(2).mean())
            if step == 1:
                snaps["boundary" if micro == 1 else "mid_accumulation"] = engine.memory_stats()
            engine.step()
            engine.zero_grad()
        if step == 1:
            snaps["after_step"] = engine.memory_stats()
    engine.close()
    return snaps


def _all(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for stage in range(4):
        for precision in PRECISIONS:
            out[("uneven", stage, precision)] = _measure(rank, world, uneven_mlp, stage, precision)
        out[("even", stage, "bf16")] = _measure(rank, world, even_mlp, stage, "bf16")
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"N={n}")
def measured(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_all, request.param, timeout=200)


# ----------------------------------------------------------------------------------------------
# tests


def test_expected_values_decompose_the_paper_formula():
    """With no padding, params + grads + master + optimizer (paper's 2-byte grads) is the formula."""
    psi = 78
    for world in (1, 2, 3):
        for stage in range(4):
            e = expected_bytes([(72, True), (6, True)], stage, world, "bf16", "after_step")
            total = sum(e.values()) + paper_grad_bytes(stage, world, psi)
            assert total == paper_bytes(stage, world, psi), (stage, world, e)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_memory_stats_per_category_at_each_moment(measured, stage, precision):
    world, results = measured
    sizes = _param_sizes(uneven_mlp())
    for rank, snaps in enumerate(results):
        for moment in ("mid_accumulation", "boundary", "after_step"):
            got = _totals(snaps[("uneven", stage, precision)][moment])
            want = expected_bytes(sizes, stage, world, precision, moment)
            assert got == want, f"N={world} rank {rank} stage {stage} {precision} {moment}: {got} != {want}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_after_a_step_matches_the_paper_without_its_gradient_term(measured, stage):
    """Unpadded model, bf16: the total right after step() is 16Ψ / 4Ψ+12Ψ/N / 2Ψ+14Ψ/N / 16Ψ/N minus
    the paper's 2-byte gradients, which this engine does not hold between steps."""
    world, results = measured
    psi = sum(n for n, _ in _param_sizes(even_mlp()))
    for rank, snaps in enumerate(results):
        total = sum(_totals(snaps[("even", stage, "bf16")]["after_step"]).values())
        assert total == paper_bytes(stage, world, psi) - paper_grad_bytes(stage, world, psi), (rank, total)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stage3_counts_exactly_the_chunks_in_flight(measured, precision):
    """Inside layer k's forward (a step after the order was recorded): layer k's weight and bias chunks
    are gathered and the next PREFETCH=2 chunks (layer k+1's weight and bias) are in flight."""
    world, results = measured
    model = uneven_mlp()
    b = DTYPE_BYTES[precision]
    k = len(model) - 2
    gathered = [p.numel() for p in list(model[k].parameters()) + list(model[k + 1].parameters())]
    # N=1 on the CPU: a gathered chunk is its shard itself (Chunk.gather copies nothing), so no bytes are added
    padded = [0 if world == 1 else math.ceil(n / world) * world for n in gathered]
    in_flight = b * sum(padded)
    at_rest = expected_bytes(_param_sizes(model), 3, world, precision, "after_step")["params"]
    for rank, snaps in enumerate(results):
        seen = [_totals(s)["params"] for s in snaps[("uneven", 3, precision)]["in_forward"]]
        assert seen[0] == at_rest + b * sum(padded[:2]), \
            "first pass (nothing recorded, no prefetch): only the layer's own chunks"
        assert seen[-1] == at_rest + in_flight, f"rank {rank}: {seen[-1]} != {at_rest} + {in_flight}"
