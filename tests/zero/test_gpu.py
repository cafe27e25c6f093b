"""ZeRO on a GPU: one CUDA rank over NCCL (world 1) trains every stage x precision x offload mode, with
accumulation and clipping, against the single-process PyTorch reference of reference.py at the CPU parity
tolerances; offloaded gradients are handed over on the copy stream, eagerly (while backward still runs);
a checkpoint save -> resume continues bit for bit.

Each test is parametrized by device. The CUDA variants are marked `gpu` (tests/conftest.py skips them
without a GPU; `bench/gpu_check.py` runs them with `pytest -m gpu`). The CPU variants run the same
functions over gloo on a few settings, so the logic stays exercised in the normal suite.
"""
from __future__ import annotations

import os

import pytest
import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.reference import assert_run_matches, engine_run, reference_run
from tests.zero.recipes import CLIP, GPT_RECIPE, token_batches, zero_config

ACCUM = 2
OFFLOADS = ("none", "cpu", "cpu+param", "disk")  # optimizer offload; cpu+param adds stage-3 param offload
# Every stage x precision x offload (param offload exists at stage 3 only), accumulation and clipping on.
CUDA_SETTINGS = [(stage, precision, offload) for stage in range(4) for precision in ("fp32", "bf16", "fp16")
                 for offload in OFFLOADS if offload != "cpu+param" or stage == 3]
# On the CPU the matrix is test_parity's and test_offload's; these few keep this file's code paths honest.
CPU_SETTINGS = [(3, "bf16", "cpu+param"), (2, "fp16", "disk"), (1, "fp32", "cpu"), (0, "bf16", "none")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def zero_for(stage: int, precision: str, offload: str, disk_path: str) -> dict:
    zero = zero_config(stage)
    zero["offload_optimizer"] = dict(device="cpu" if offload == "cpu+param" else offload, path=disk_path)
    if offload == "cpu+param":
        zero["offload_param"] = dict(device="cpu")
    if precision == "fp16":  # low enough that the tiny model never overflows: no step is skipped
        zero["loss_scale"] = dict(initial_scale=2.0**10)
    return zero


# -- probes: where and when reduced gradient shards are handed over -----------------------------------


def attach_handover_probe(engine) -> None:
    """Log every hand-over of a reduced gradient shard: on the copy stream? before backward ended?"""
    hooks = engine.grad_hooks
    engine._probe = {"ended": False, "calls": []}

    def log(reduced: torch.Tensor, shard: torch.Tensor) -> None:
        copy_stream = engine.grad_path.copy_stream
        on_copy = (reduced.is_cuda and copy_stream is not None
                   and torch.cuda.current_stream(reduced.device) == copy_stream)
        engine._probe["calls"].append((on_copy, not engine._probe["ended"], shard.device.type,
                                       shard.device.type != "cpu" or shard.is_pinned()))

    def deliver(state, reduced, original=engine.grad_path.deliver):
        landed = original(state, reduced)  # the fp32 grad shard (freed after the step), or the crossing kept
        log(reduced, landed)
        return landed

    engine.grad_path.deliver = deliver

    def begin_backward(*args, original=hooks.begin_backward, **kwargs):
        engine._probe["ended"] = False
        return original(*args, **kwargs)

    def end_backward(original=hooks.end_backward):
        engine._probe["ended"] = True  # hand-overs from here on waited for the end of backward
        return original()

    hooks.begin_backward, hooks.end_backward = begin_backward, end_backward


def inspect_handover(engine, step: int) -> dict:
    calls, engine._probe["calls"] = engine._probe["calls"], []
    return dict(calls=len(calls), on_copy_stream=sum(c[0] for c in calls), during_backward=sum(c[1] for c in calls),
                eager=engine.grad_path.hand_over_at_launch, has_copy_stream=engine.grad_path.copy_stream is not None,
                grad_devices=sorted({c[2] for c in calls}), grads_pinned=all(c[3] for c in calls))


def assert_handover(seen: list[dict], device: str, offload: str, what: str) -> None:
    """CUDA + offload: every shard goes device->host on the copy stream, most while backward runs.
    Otherwise (no offload, or the CPU): no copy stream, and hand-overs wait for the end of backward."""
    offloaded = offload != "none"
    for step, s in enumerate(seen):
        where = f"{what} step {step}: {s}"
        assert s["calls"] > 0, f"{where}: no gradient shard was handed over"
        expected = "cpu" if offloaded else device
        assert s["grad_devices"] == [expected], f"{where}: grad shards not on the {expected}"
        if device == "cuda" and offloaded:
            assert s["eager"] and s["has_copy_stream"], where
            assert s["on_copy_stream"] == s["calls"], f"{where}: hand-overs off the copy stream"
            assert s["during_backward"] > 0, f"{where}: nothing handed over before backward ended (not eager)"
            assert s["grads_pinned"], f"{where}: host grad shards are not pinned (no async copy)"
        else:
            assert not s["has_copy_stream"] and s["on_copy_stream"] == 0, where
            if not s["eager"]:
                assert s["during_backward"] == 0, where


def _matrix(rank: int, world: int, device: str, settings: list, disk_path: str) -> dict:
    return {s: engine_run(rank, world, GPT_RECIPE, zero_for(*s, disk_path), precision=s[1], accum=ACCUM,
                          clip=CLIP, setup=attach_handover_probe, inspect=inspect_handover, device=device)
            for s in settings}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("device", DEVICES)
def test_every_stage_precision_offload_matches_pytorch(device, tmp_path):
    settings = CUDA_SETTINGS if device == "cuda" else CPU_SETTINGS
    backend = "nccl" if device == "cuda" else "gloo"
    results = run_distributed(_matrix, 1, device, settings, str(tmp_path), timeout=880, backend=backend)[0]
    ref = reference_run(GPT_RECIPE, 1, ACCUM, CLIP)
    for (stage, precision, offload), run in results.items():
        what = f"{device} stage={stage} {precision} offload={offload} accum={ACCUM} clip={CLIP}"
        assert not any(s["skipped"] for s in run["stats"]), f"{what}: fp16 skipped a step: {run['stats']}"
        assert len(run["stats"]) == GPT_RECIPE.steps, what
        assert_run_matches(run, ref, precision=precision, what=what)
        assert_handover(run["inspect"], device, offload, what)
    assert os.listdir(tmp_path) == [], "disk offload left files behind"


# -- checkpoint: save -> resume is bit-exact ---------------------------------------------------------

RESUME_STEPS, SAVE_AT = 6, 3
CUDA_RESUME = [(3, "bf16", "cpu+param"), (2, "fp16", "cpu"), (1, "fp32", "none"), (3, "bf16", "disk")]
CPU_RESUME = [(3, "bf16", "cpu+param")]


def dropout_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=128, dropout=0.1, max_position_embeddings=16)  # RNG state must resume too


def _train(rank: int, world: int, setting: tuple, device: str, disk_path: str, steps: range,
           load: str | None = None, save: str | None = None) -> tuple[list[float], dict]:
    import zerogpt
    from tests.zero.reference import adamw, cpu_ctx

    stage, precision, offload = setting
    ctx = cpu_ctx(rank, world)
    if device == "cuda":
        ctx.device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(100 + rank)
    model = dropout_gpt()
    cfg = zerogpt.Config(dict(zero=zero_for(stage, precision, offload, disk_path), precision=precision,
                              GRADIENT_ACCUMULATION=ACCUM, clip_grad_norm=CLIP))
    engine = zerogpt.initialize(model, adamw(model), config=cfg, ctx=ctx)
    if load:
        engine.load_checkpoint(load)
    data = token_batches(RESUME_STEPS, world, ACCUM)
    losses = []
    for step in steps:
        for j in range(ACCUM):
            batch = data[step, j, rank].to(ctx.device)
            loss = GPTLMLoss(shift=False)(engine(batch[:, :-1]), batch[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
    if save:
        engine.save_checkpoint(save)
    params = engine.state_dict_full()
    engine.close()
    return losses, params


def _save_resume(rank: int, world: int, device: str, settings: list, root: str) -> dict:
    if device == "cuda":  # bit-exact on a GPU needs deterministic kernels (no atomics in backward)
        torch.use_deterministic_algorithms(True, warn_only=True)  # a nondeterministic op warns; the check decides
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    with sdpa_kernel(SDPBackend.MATH):  # plain matmuls: deterministic on every device
        for setting in settings:
            path = os.path.join(root, "_".join(map(str, setting)))
            straight, straight_params = _train(rank, world, setting, device, root, range(RESUME_STEPS))
            first, _ = _train(rank, world, setting, device, root, range(SAVE_AT), save=path)
            second, params = _train(rank, world, setting, device, root, range(SAVE_AT, RESUME_STEPS), load=path)
            out[setting] = dict(straight=straight, resumed=first + second, straight_params=straight_params,
                                params=params)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_save_resume_is_bit_exact(device, tmp_path):
    settings = CUDA_RESUME if device == "cuda" else CPU_RESUME
    backend = "nccl" if device == "cuda" else "gloo"
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS's condition for deterministic results
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned rank
    try:
        results = run_distributed(_save_resume, 1, device, settings, str(tmp_path), timeout=580, backend=backend)[0]
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    for setting, r in results.items():
        what = f"{device} {setting}"
        assert r["resumed"] == r["straight"], f"{what}: resumed losses differ: {r['resumed']} vs {r['straight']}"
        for name, value in r["straight_params"].items():
            assert torch.equal(r["params"][name], value), f"{what}: {name} differs after resume"
        assert len(set(r["straight"])) > 1, f"{what}: the loss never changed"
