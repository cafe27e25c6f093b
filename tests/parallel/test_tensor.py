"""Tensor parallelism (zerogpt.parallel.tensor) composed with ZeRO over the data-parallel group, on gloo CPU ranks.

Every run is compared with plain PyTorch in one process on the same global batch (tests/zero/reference.py):
TP2 and TP2 x DP2 at ZeRO stages 1-3 train to the same losses and grad norms (fp32, 1e-5), clipping on, and
the final parameters rebuilt from every rank's local shards through `tensor_parallel_layout` match the
reference's. The tiny GPT's vocabulary (120) is padded to 128, so the padded classes are exercised.
"""
from __future__ import annotations

import pytest
import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.recipes import CLIP, zero_config
from tests.zero.reference import Recipe, adamw, assert_params_close, reference_run

VOCAB, PADDED, SEQ, MICRO_BATCH, STEPS = 120, 128, 16, 2, 4


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)


def token_batches(steps: int, dp: int, accum: int) -> torch.Tensor:
    """(steps, accum, dp, B, T+1) token ids: one global batch per step, the same for every run."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, dp, MICRO_BATCH, SEQ + 1), generator=g)


def lm_loss(model, batch: torch.Tensor, step: int) -> torch.Tensor:
    return GPTLMLoss(shift=False)(model(batch[:, :-1]), batch[:, 1:])


RECIPE = Recipe(build=tiny_gpt, data=token_batches, loss=lm_loss, steps=STEPS)


def _tp_engine(tp: int, world: int, zero: dict, accum: int, clip: float | None, sequence_parallel: bool = False):
    """A GPT sharded over "tp" and wrapped in a ZeRO engine over "dp" (call on every rank).

    The mesh comes back with `local_numel`: this rank's tensor-parallel share of the parameters, counted
    before the engine packs them."""
    import zerogpt
    from zerogpt.context import DistContext
    from zerogpt.parallel import ParallelDims
    from zerogpt.parallel.plan import parallelize
    from zerogpt.zero.chunk import to_local

    ctx = DistContext.current("cpu").with_mesh(ParallelDims(tp=tp, dp=world // tp).build_mesh("cpu"))
    parallel = parallelize(tiny_gpt(), ctx.mesh, sequence_parallel)
    mesh = ctx.mesh
    mesh.local_numel = sum(to_local(p).numel() for p in parallel.module.parameters())
    cfg = zerogpt.Config(dict(zero=zero, precision="fp32", GRADIENT_ACCUMULATION=accum, clip_grad_norm=clip))
    # engine.param_layouts (from the ParallelModel): what checkpoints read each piece's place from
    engine = zerogpt.initialize(parallel, adamw(parallel.module), config=cfg, ctx=ctx)
    return engine, mesh


def _train(engine, mesh, data: torch.Tensor, steps: range, accum: int,
           observe=lambda: None) -> tuple[list[float], list[float]]:
    """Train `steps` of `data` on this rank's data-parallel micro-batches; (global mean losses, grad norms).

    `observe()` runs after every backward and every step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    losses, norms = [], []
    for step in steps:
        step_loss = torch.zeros(())
        for j in range(accum):
            batch = data[step, j, dp_rank]
            with loss_parallel():  # the vocab-parallel cross-entropy, forward and backward
                logits = engine(batch[:, :-1])
                assert isinstance(logits, DTensor) and logits.to_local().shape == (
                    MICRO_BATCH, SEQ, PADDED // mesh["tp"].size()), "a rank materialised more than its vocab shard"
                loss = GPTLMLoss(shift=False)(logits, batch[:, 1:]).to_local()
                engine.backward(loss)
            observe()
            norm = engine.step()
            observe()
            engine.zero_grad()
            step_loss += loss.detach() / accum
            if norm is not None:
                norms.append(norm.item())
        dist.all_reduce(step_loss, group=dp_group)
        losses.append(step_loss.item() / mesh["dp"].size())
    return losses, norms


def _full_params(engine, mesh) -> dict[str, torch.Tensor] | None:
    """The unsharded parameters, rebuilt on rank 0 from every tensor-parallel rank's local shards via the layout."""
    import torch.distributed as dist
    local = engine.state_dict_full()  # this rank's TP-local tensors, consolidated over "dp" (on dp rank 0)
    layout = engine.param_layouts
    pieces = [None] * mesh["tp"].size()
    dist.all_gather_object(pieces, (local, layout), group=mesh["tp"].get_group())
    if dist.get_rank() != 0:
        return None
    full = {}
    for name in local:
        spec = layout.get(name)
        if spec is None:  # not split over "tp": every rank's local tensor is the whole parameter
            full[name] = local[name]
            continue
        out = torch.empty(spec.global_shape)
        for rank_local, rank_layout in pieces:
            lay, offset = rank_layout[name], 0
            for start, length in lay.blocks:
                out.narrow(lay.dim, start, length).copy_(rank_local[name].narrow(lay.dim, offset, length))
                offset += length
        full[name] = out
    return full


def _run(rank: int, world: int, tp: int, stage: int, accum: int, clip: float | None,
         offload: str = "none", sequence_parallel: bool = False) -> dict:
    torch.set_num_threads(1)
    zero = dict(zero_config(stage), offload_optimizer=dict(device=offload))
    engine, mesh = _tp_engine(tp, world, zero, accum, clip, sequence_parallel)
    residual = []  # the shapes each block hands the next: sharded on the sequence under SP
    engine.module.transformer.h[0].register_forward_hook(lambda m, i, out: residual.append(tuple(out[0].shape)))
    peak = {c: dict.fromkeys(("device", "host", "disk"), 0) for c in ("params", "grads", "master", "optimizer")}

    def snapshot() -> None:
        for category, homes in engine.memory_stats().items():
            for home, nbytes in homes.items():
                peak[category][home] = max(peak[category][home], nbytes)

    losses, norms = _train(engine, mesh, RECIPE.data(STEPS, world // tp, accum), range(STEPS), accum, snapshot)
    params = _full_params(engine, mesh)
    engine.close()
    return dict(losses=losses, norms=norms, params=params, peak=peak, local_numel=mesh.local_numel,
                num_chunks=len(engine.chunks), residual=set(residual))


def _assert_matches_reference(results: list[dict], dp: int, accum: int, clip: float | None, what: str) -> None:
    ref_losses, ref_params, ref_norms = reference_run(RECIPE, dp, accum, clip)
    for rank, run in enumerate(results):
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{what} rank {rank}: losses: {m}")
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{what} rank {rank}: global grad norm: {m}")
    assert_params_close(results[0]["params"], ref_params, 1e-5, 1e-4, what)


@pytest.mark.timeout(240)
def test_tp2_matches_one_process():
    """TP2 (world 2, ZeRO-1 over a dp group of one) = one process: losses, the clipped global grad norm, params."""
    results = run_distributed(_run, 2, 2, 1, 1, CLIP, timeout=220)
    assert results[0]["norms"][0] > CLIP  # clipping acts on every step
    assert all(run["residual"] == {(MICRO_BATCH, SEQ, 64)} for run in results)  # the whole sequence per rank
    _assert_matches_reference(results, 1, 1, CLIP, "TP2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tp2_dp2_matches_one_process(stage):
    """TP2 x DP2 (world 4), ZeRO stage 1/2/3 over dp, gradient accumulation 2, clipping = one process."""
    results = run_distributed(_run, 4, 2, stage, 2, CLIP, timeout=280)
    _assert_matches_reference(results, 2, 2, CLIP, f"TP2 x DP2 stage {stage}")
    _assert_memory_is_the_zero_formula(results, stage, dp=2, offload="none")


def _assert_memory_is_the_zero_formula(results: list[dict], stage: int, dp: int, offload: str) -> None:
    """Each rank's measured model-state bytes = zerogpt_tools.estimate's ZeRO formula over its TP-local count
    (within chunk padding), and that count is well under the whole model's."""
    from zerogpt_tools.estimate import model_state_bytes

    whole = sum(p.numel() for p in tiny_gpt().parameters())
    for rank, run in enumerate(results):
        assert run["local_numel"] < 0.6 * whole, (rank, run["local_numel"], whole)
        plan = model_state_bytes(run["local_numel"], stage, dp, "fp32", offload)
        tolerance = run["num_chunks"] * dp * 8  # padding elements x the widest element (Adam: 2 x fp32)
        for category, homes in plan.items():
            for home, expected in homes.items():
                measured = run["peak"][category][home]
                assert abs(measured - expected) <= tolerance, (
                    f"rank {rank} stage {stage}: {category}/{home} measured {measured} B, the ZeRO formula over "
                    f"{run['local_numel']} TP-local params gives {expected} B")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_sequence_parallel_tp2_dp2_matches_one_process(stage):
    """Megatron's sequence parallelism on top of TP2 x DP2: the residual stream is (B, T/2, C) per rank, the
    LayerNorms' gradients are partial sums all-reduced by the engine, and the run is still one process's."""
    results = run_distributed(_run, 4, 2, stage, 2, CLIP, "none", True, timeout=280)
    _assert_matches_reference(results, 2, 2, CLIP, f"TP2 x DP2 + SP stage {stage}")
    assert all(run["residual"] == {(MICRO_BATCH, SEQ // 2, 64)} for run in results)  # TP alone: SEQ (above)


@pytest.mark.timeout(240)
def test_tp2_with_optimizer_offload():
    """TP2 at ZeRO-2 with the optimizer offloaded to the host: same parity, and the state is on the host."""
    results = run_distributed(_run, 2, 2, 2, 1, CLIP, "cpu", timeout=220)
    _assert_matches_reference(results, 1, 1, CLIP, "TP2 offload cpu")
    _assert_memory_is_the_zero_formula(results, 2, dp=1, offload="cpu")
    assert all(run["peak"]["optimizer"]["host"] > 0 and run["peak"]["optimizer"]["device"] == 0 for run in results)


def _resume(rank: int, world: int, root: str) -> tuple[list[float], list[float]]:
    """Losses of an uninterrupted run, and of the same run saved after step 2 and resumed in fresh engines."""
    import os

    from zerogpt.checkpoint import load_engine, save_engine

    torch.set_num_threads(1)
    data = RECIPE.data(STEPS, world // 2, 1)
    engine, mesh = _tp_engine(2, world, zero_config(3), 1, CLIP)
    whole, _ = _train(engine, mesh, data, range(STEPS), 1)
    engine.close()
    engine, mesh = _tp_engine(2, world, zero_config(3), 1, CLIP)
    first, _ = _train(engine, mesh, data, range(2), 1)
    directory = os.path.join(root, "step")  # one checkpoint for every rank of the mesh
    save_engine(engine, directory)
    engine.close()
    engine, mesh = _tp_engine(2, world, zero_config(3), 1, CLIP)
    load_engine(engine, directory)
    rest, _ = _train(engine, mesh, data, range(2, STEPS), 1)
    engine.close()
    return whole, first + rest


@pytest.mark.timeout(300)
def test_resume_is_exact_at_the_same_layout(tmp_path):
    """TP2 x DP2 at ZeRO-3: save after 2 steps, reload into fresh engines, continue: bit-exact losses."""
    for whole, resumed in run_distributed(_resume, 4, str(tmp_path), timeout=280):
        assert resumed == whole



def _layout_pieces(rank: int, world: int) -> tuple[dict, dict]:
    """This rank's local tensors and layout right after the plan (no engine)."""
    from torch.distributed.device_mesh import init_device_mesh
    from zerogpt.zero.chunk import to_local
    from zerogpt.parallel.tensor import apply_tensor_parallel, tensor_parallel_layout

    model = tiny_gpt()
    replicated = apply_tensor_parallel(model, init_device_mesh("cpu", (world,)))
    local = {n: to_local(p).detach().clone() for n, p in model.named_parameters()}
    return local, tensor_parallel_layout(model), replicated


@pytest.mark.timeout(120)
def test_layout_rebuilds_the_unsharded_parameters():
    """Concatenating every rank's local tensor along `dim` by the layout's blocks gives the unsharded model's
    parameter; c_attn's local rows are [q_r; k_r; v_r]; the tie survives; replicated = not split."""
    results = run_distributed(_layout_pieces, 2, timeout=100)
    full = dict(tiny_gpt().named_parameters())
    (local0, layout0, replicated), (local1, layout1, _) = results
    assert set(layout0) == set(full) and "lm_head.weight" not in layout0  # tied: listed once, as wte
    assert replicated == {n for n, lay in layout0.items() if lay.is_whole}
    assert "transformer.h.0.ln_1.weight" in replicated and "transformer.h.0.attn.c_proj.bias" in replicated
    C = 64
    assert layout1["transformer.h.0.attn.c_attn.weight"].blocks == ((32, 32), (C + 32, 32), (2 * C + 32, 32))
    assert layout0["transformer.wte.weight"].blocks == ((0, PADDED // 2),)
    for name, expected in full.items():
        parts = []
        for local, layout in ((local0, layout0), (local1, layout1)):
            lay = layout[name]
            assert lay.global_shape == tuple(expected.shape), name
            if lay.is_whole:
                torch.testing.assert_close(local[name], expected.detach(), rtol=0, atol=0)
                continue
            offset = 0
            for start, length in lay.blocks:
                parts.append((start, local[name].narrow(lay.dim, offset, length)))
                offset += length
            assert offset == local[name].size(lay.dim), name
        if parts:
            rebuilt = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])], dim=layout0[name].dim)
            torch.testing.assert_close(rebuilt, expected.detach(), rtol=0, atol=0, msg=name)
