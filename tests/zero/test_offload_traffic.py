"""Host<->device traffic (zero/offload.py Traffic, engine.last_step_traffic): what each optimizer step copies, and
the two ways offload makes it cross the bus less (issue 29, points 1-2).

On this CPU-only machine host and "device" are one memory, but the engine counts the copies where it makes them,
from the homes it records, so the counts are the ones a GPU run makes. Checked here: the counts equal the bytes the
chunk plans say cross; with optimizer offload at stages 2-3 the gradients of 16 micro-steps cross once (d2h at
accumulation 16 within 10% of accumulation 1) and train exactly as the per-micro-step hand-over they replace (which
still runs where the device has no room, said at build); with param offload, `zero.offload_param.device_budget`
keeps chunks on the device and h2d falls as it grows; evaluation is not counted; metrics.jsonl and the log line
carry the counts.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.gpu_plan import planned
from zerogpt.context import DistContext

MICRO_BATCH = 2
SEQ = 16
VOCAB = 128
LR = 3e-3


def build(stage: int, *, offload: str = "cpu", param: bool = False, budget=0, accum: int = 1,
          precision: str = "fp32", eager: bool = False, ctx: DistContext | None = None, clip: float | None = None,
          hybrid_adam: bool = False):
    import zerogpt
    from zerogpt.optim import HybridAdam
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)
    zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(device=offload))
    if param:
        zero["offload_param"] = dict(device="cpu", device_budget=budget)
    cfg = zerogpt.Config(dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=accum, clip_grad_norm=clip))
    optimizer = (HybridAdam if hybrid_adam else torch.optim.AdamW)(model.parameters(), lr=LR, weight_decay=0.1)
    with planned(hand_over_at_launch=eager):  # CUDA's hand-over (each chunk right after its launch), taken on CPU
        return zerogpt.initialize(model, optimizer, GPTLMLoss(shift=False), config=cfg,
                                  ctx=ctx or DistContext.current())


def run_steps(engine, steps: int, rank: int = 0, world: int = 1) -> dict:
    """Train `steps` optimizer steps on fixed tokens; the losses, each step's traffic and the final params."""
    g = torch.Generator().manual_seed(1234)
    accum = engine.gradient_accumulation
    tokens = torch.randint(0, VOCAB, (steps, accum, world, MICRO_BATCH, SEQ + 1), generator=g)
    losses, traffic = [], []
    for step in tokens:
        for micro in step:
            x = micro[rank]
            loss = GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        traffic.append((engine.last_step_traffic.h2d_bytes, engine.last_step_traffic.d2h_bytes))
    params = engine.state_dict_full()
    engine.close()
    return dict(losses=losses, traffic=traffic, params=params)


def shard_bytes(engine, element_size: int, trainable_only: bool = True) -> int:
    return sum(c.plan.shard_numel * element_size for c in engine.chunks if c.plan.trainable or not trainable_only)


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def no_room(monkeypatch) -> None:
    """A device with 1 KiB free at build: the accumulated gradient shards cannot stay there."""
    import zerogpt.build_engine as build_engine

    monkeypatch.setattr(build_engine, "_device_free_bytes", lambda device: 1024)


# -- point 1: the counts are the bytes that cross ------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_counts_equal_the_planned_copies(precision):
    """Stage 2, optimizer offload: each step hands every reduced gradient shard to the host (compute dtype at
    accumulation 1) and writes every master back into its device param shard (compute dtype)."""
    engine = build(2, precision=precision)
    size = torch.empty(0, dtype=engine.chunks[0].dtype).element_size()
    expected = shard_bytes(engine, size)
    run = run_steps(engine, 2)
    assert run["traffic"] == [(expected, expected)] * 2


def test_nothing_crosses_without_offload():
    for stage in (0, 2, 3):
        assert set(run_steps(build(stage, offload="none", accum=2), 2)["traffic"]) == {(0, 0)}, stage


def test_param_offload_counts_every_gather():
    """Stage 3, params and optimizer on the host: each gather copies a shard up, nothing else crosses (the master
    is written back into the host shard). A chunk is gathered in forward and again in backward, at most."""
    engine = build(3, param=True, accum=1)
    gathers = []
    for chunk in engine.chunks:
        def gather(async_op=False, chunk=chunk, original=chunk.gather):
            if chunk.full_buffer is None:
                gathers.append(chunk.plan.shard_numel * 4)
            original(async_op)
        chunk.gather = gather
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        gathers.clear()
        engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
        engine.zero_grad()
        grads = shard_bytes(engine, 4)  # fp32 reduced shards to the host optimizer
        assert (engine.last_step_traffic.h2d_bytes, engine.last_step_traffic.d2h_bytes) == (sum(gathers), grads)
        assert shard_bytes(engine, 4) < sum(gathers) <= 2 * shard_bytes(engine, 4)
    engine.close()


def test_evaluation_and_checkpoint_loads_are_not_a_steps_traffic():
    engine = build(3, param=True)
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    engine.eval()
    with torch.no_grad():
        engine(x[:, :-1])
    engine.train()
    engine.load_state_dict(engine.state_dict())
    assert (engine.traffic.h2d_bytes, engine.traffic.d2h_bytes) == (0, 0)
    engine.close()


# -- point 2: accumulation that crosses the bus once ---------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulated_gradients_cross_once_per_step(stage, monkeypatch, caplog):
    """Optimizer offload, accumulation 16: the reduced shards of the 16 micro-steps are summed on the device and
    cross once, so d2h per step is within 10% of accumulation 1 (fp32: equal); the per-micro-step hand-over it
    replaces moved 16x as much, and trains to the same losses and parameters (the same fp32 sums, in order)."""
    one = run_steps(build(stage, accum=1), 1)
    with caplog.at_level(logging.INFO, logger="zerogpt"):
        engine = build(stage, accum=16)
    assert engine.accumulate_on_device and "cross to the host once per step" in caplog.text
    once = run_steps(engine, 2)
    no_room(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zerogpt"):
        engine = build(stage, accum=16)
    assert not engine.accumulate_on_device
    assert "gradients cross to the host at every micro-step" in caplog.text  # said at build
    every = run_steps(engine, 2)
    d2h_one, d2h_once, d2h_every = one["traffic"][0][1], once["traffic"][0][1], every["traffic"][0][1]
    assert abs(d2h_once - d2h_one) <= 0.1 * d2h_one, (d2h_once, d2h_one)
    assert d2h_every == 16 * d2h_one
    assert once["traffic"][0][0] == every["traffic"][0][0] == one["traffic"][0][0]  # the write-back, once a step
    assert max(abs(a - b) for a, b in zip(once["losses"], every["losses"])) <= 1e-6
    assert max_param_diff(once["params"], every["params"]) <= 1e-6


def test_bf16_accumulation_crosses_in_fp32_once(monkeypatch):
    """bf16: the once-per-step copy is the fp32 sum (4 B/element), twice accumulation 1's bf16 shard but an eighth of
    16 bf16 hand-overs; same training as the per-micro-step path, and CUDA's hand-over order gives the same."""
    one = run_steps(build(2, precision="bf16", accum=1), 1)
    once = run_steps(build(2, precision="bf16", accum=16), 1)
    eager = run_steps(build(2, precision="bf16", accum=16, eager=True), 1)
    no_room(monkeypatch)
    every = run_steps(build(2, precision="bf16", accum=16), 1)
    d2h_one = one["traffic"][0][1]
    assert (once["traffic"][0][1], every["traffic"][0][1]) == (2 * d2h_one, 16 * d2h_one)
    for run in (every, eager):
        assert once["losses"] == run["losses"] and max_param_diff(once["params"], run["params"]) <= 1e-6


def test_stage1_already_reduces_once_and_param_offload_keeps_the_hand_over():
    """Stage 1 reduces once per step (no accumulator needed); param offload keeps the device memory for params."""
    assert not build(1, accum=4).accumulate_on_device
    assert not build(3, param=True, accum=4).accumulate_on_device
    assert not build(2, offload="none", accum=4).accumulate_on_device


KEYS = ((True, False), (True, True), (False, False))  # (accumulate on the device, CUDA's at-launch hand-over)


def _two_ranks(rank: int, world: int) -> dict:
    import zerogpt.build_engine as build_engine

    runs, free_bytes = {}, build_engine._device_free_bytes
    for accumulate, eager in KEYS:
        build_engine._device_free_bytes = free_bytes if accumulate else (lambda device: 1024)
        engine = build(3, accum=8, eager=eager, precision="bf16")
        assert engine.accumulate_on_device == accumulate
        runs[accumulate, eager] = run_steps(engine, 2, rank, world)
    build_engine._device_free_bytes = free_bytes
    return runs


@pytest.mark.timeout(120)
def test_two_ranks_accumulate_as_the_per_micro_step_path():
    """Stage 3 over 2 gloo ranks, bf16, accumulation 8: the device-side sum of each rank's reduce-scatters trains as
    the host-side one, with the at-end and the at-launch (CUDA) hand-over; d2h falls 4x (8 bf16 -> 1 fp32)."""
    runs = run_distributed(_two_ranks, 2, timeout=100)
    for rank in range(2):
        base = runs[rank][False, False]
        for key in KEYS[:2]:
            assert runs[rank][key]["losses"] == base["losses"], key
            assert runs[rank][key]["traffic"][0][1] * 4 == base["traffic"][0][1], key
            if rank == 0:  # state_dict_full consolidates on rank 0
                assert max_param_diff(runs[rank][key]["params"], base["params"]) <= 1e-6


def test_device_budget_keeps_chunks_on_the_device():
    """Stage 3, params and optimizer on the host, accumulation 4: a budget of 0 streams every chunk at every gather,
    half keeps the first chunks on the device, all of them leaves only the once-per-step write-back of the masters
    into the device shards. h2d per step falls as the budget grows; the training is the same. With every chunk on
    the device the gradients also accumulate there (d2h once per step, as without param offload)."""
    probe = build(3, param=True)
    total = shard_bytes(probe, 4, trainable_only=False)
    probe.close()
    runs = {}
    for name, budget in (("0", 0), ("half", total // 2), ("all", total)):
        engine = build(3, param=True, budget=budget, accum=4)
        on_device = sum(c.plan.shard_numel * 4 for c in engine.chunks if c.shard_home == "device")
        assert on_device <= budget and engine.memory_stats()["params"]["device"] == on_device
        runs[name] = run_steps(engine, 2)
        runs[name]["on_device"] = on_device
    h2d = {name: run["traffic"][-1][0] for name, run in runs.items()}
    assert h2d["0"] > h2d["half"] > h2d["all"], h2d
    assert runs["0"]["on_device"] == 0 and runs["all"]["on_device"] == total
    # all resident: each step writes the trainable masters into their device shards, and gathers nothing up
    assert h2d["all"] == sum(c.plan.shard_numel * 4 for c in probe.chunks if c.plan.trainable)
    d2h = {name: run["traffic"][-1][1] for name, run in runs.items()}
    assert d2h["0"] == d2h["half"] == 4 * d2h["all"] == 4 * h2d["all"], d2h
    for name in ("half", "all"):
        assert runs[name]["losses"] == runs["0"]["losses"], name
        assert max_param_diff(runs[name]["params"], runs["0"]["params"]) <= 1e-6, name


def test_device_budget_auto_on_cpu_keeps_every_chunk():
    engine = build(3, param=True, budget="auto")
    assert {c.shard_home for c in engine.chunks} == {"device"}
    engine.close()


# -- metrics.jsonl and the log line --------------------------------------------------------------------------------


def test_metrics_and_log_line_carry_the_traffic(tmp_path, capfd):
    from zerogpt.trainer import LogMetricByStepHook, Trainer

    engine = build(2, accum=2)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(8)]
    trainer = Trainer(engine, hooks=[LogMetricByStepHook(str(tmp_path), log_interval=1)])
    trainer.fit(data, max_steps=2)
    expected = shard_bytes(engine, 4)  # fp32: one write-back up, one gradient sum down per step
    engine.close()
    with open(tmp_path / "metrics.jsonl") as f:
        train = [json.loads(line) for line in f if '"train"' in line]
    assert [(r["h2d_bytes"], r["d2h_bytes"]) for r in train] == [(expected, expected)] * 2
    mib = f"{expected / 2**20:.1f}M"
    assert capfd.readouterr().out.count(f"| h2d {mib} d2h {mib}") == 2


def test_log_line_leaves_out_zero_traffic():
    from zerogpt.trainer.hooks.logging import format_train_line

    rec = dict(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, h2d_bytes=0, d2h_bytes=0)
    assert "h2d" not in format_train_line(rec, 2, 1.0)
    rec.update(h2d_bytes=3 * 2**30, d2h_bytes=5 * 2**20)
    assert "h2d 3.00G d2h 5.0M" in format_train_line(rec, 2, 1.0)
