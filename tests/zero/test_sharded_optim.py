"""zero/sharded_optim.py: one ChunkState per trainable chunk, each stepped by an optimizer over its master
alone; the step's norm stays a device tensor; Engine/ShardedOptimizer state round-trips through state_dict."""
from __future__ import annotations

import pytest
import torch

from tests.zero.reference import LR, cpu_ctx, single_thread
from tests.zero.recipes import lm_loss, tiny_gpt, token_batches, zero_config


def build(stage: int = 2, accum: int = 1, clip: float | None = None, optimizer=None):
    import zerogpt

    model = tiny_gpt()
    optimizer = optimizer or dict(type="AdamW", lr=LR, weight_decay=0.1)
    cfg = zerogpt.Config(dict(zero=zero_config(stage), GRADIENT_ACCUMULATION=accum, clip_grad_norm=clip))
    engine = zerogpt.initialize(model, optimizer, config=cfg, ctx=cpu_ctx())
    return engine


def train(engine, steps: int, accum: int = 1) -> list:
    data = token_batches(steps, 1, accum)
    norms = []
    for step in range(steps):
        for j in range(accum):
            engine.backward(lm_loss(engine, data[step, j, 0], step))
            norms.append(engine.step())
            engine.zero_grad()
    return norms


@pytest.mark.timeout(120)
def test_each_chunk_steps_alone_and_the_users_optimizer_keeps_only_hyperparameters():
    with single_thread():
        engine = build()
        train(engine, 1)
        states = engine.sharded_optim.states
        assert len(states) == sum(c.plan.trainable for c in engine.chunks) > 3
        for index, s in states.items():
            assert [p for g in s.optimizer.param_groups for p in g["params"]] == [s.master], index
            assert set(s.state_tensors()) == {"exp_avg", "exp_avg_sq"} and s.grad is None, index
            assert all(t.numel() == engine.chunks[index].plan.shard_numel for t in s.state_tensors().values())
        assert all(g["params"] == [] for g in engine.optimizer.param_groups) and not engine.optimizer.state
        engine.close()


@pytest.mark.timeout(120)
def test_step_returns_the_norm_as_a_device_tensor_only_at_the_boundary():
    with single_thread():
        engine = build(accum=3, clip=1e-3)
        norms = train(engine, 2, accum=3)
        assert [n is None for n in norms] == [True, True, False] * 2
        for n in norms[2::3]:
            assert isinstance(n, torch.Tensor) and n.dim() == 0 and n.device == engine.ctx.device
            assert n.item() > 1e-3  # clipped: the norm returned is the one before clipping
        assert engine.last_step_skipped is False and engine.lr == LR
        engine.close()


@pytest.mark.timeout(120)
def test_engine_state_dict_round_trips_and_loads_in_place():
    with single_thread():
        engine = build(stage=3)
        train(engine, 2)
        saved = {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                 for k, v in engine.state_dict()["optimizer"]["chunks"].items()}
        live = engine.state_dict()
        homes = {i: s.state["exp_avg"] for i, s in engine.sharded_optim.states.items()}
        train(engine, 1)  # moves every tensor on
        state = engine.state_dict()
        state["global_step"] = 2
        for index, entry in state["optimizer"]["chunks"].items():
            for name, tensor in entry.items():
                if tensor.dim() > 0:
                    tensor.copy_(saved[index][name])
                else:
                    entry[name] = saved[index][name]
        engine.load_state_dict(state)
        assert engine.global_step == 2 and set(live) == {"global_step", "optimizer", "frozen", "buffers",
                                                           "shards", "layouts", "tied"}
        for index, s in engine.sharded_optim.states.items():
            assert s.state["exp_avg"] is homes[index]  # loaded in place
            assert torch.equal(s.master, saved[index]["master"]) and float(s.state["step"]) == 2.0
            torch.testing.assert_close(engine.chunks[index].shard.float(), s.master)
        engine.close()


@pytest.mark.timeout(120)
def test_norm_duplicates_leave_a_parameters_gradient_out_of_the_norm_only():
    """A replica's gradient (TP-replicated, the tied head of the last stage) is counted once, on another rank."""
    import zerogpt
    from zerogpt.parallel import ParallelModel

    def norm_with(skip):
        torch.manual_seed(0)
        model = tiny_gpt()
        cfg = zerogpt.Config(dict(zero=zero_config(2), clip_grad_norm=1.0))
        engine = zerogpt.initialize(ParallelModel(model, norm_duplicates=frozenset(skip)), dict(type="AdamW", lr=LR),
                                    config=cfg, ctx=cpu_ctx())
        engine.backward(lm_loss(engine, token_batches(1, 1, 1)[0, 0, 0], 0))
        norm = engine.step()
        engine.close()
        return norm

    with single_thread():
        full = norm_with(())
        skipped = norm_with({"transformer.wpe.weight"})
        assert 0 < skipped.item() < full.item()
        # the difference is exactly wpe's gradient, which the plain torch reference gives
        torch.manual_seed(0)
        model = tiny_gpt()
        lm_loss(model, token_batches(1, 1, 1)[0, 0, 0], 0).backward()
        wpe = model.transformer.wpe.weight.grad.norm()
        torch.testing.assert_close(full ** 2 - skipped ** 2, wpe ** 2, rtol=1e-4, atol=1e-8)


def test_host_staging_hands_out_its_two_buffers_in_turn():
    from zerogpt.zero.host_step import HostStaging
    from zerogpt.zero.offload import Placement

    staging = HostStaging(100, torch.bfloat16, Placement(torch.device("cpu")))
    first, second, third = staging.take(10), staging.take(100), staging.take(50)
    assert first.numel() == 10 and second.numel() == 100 and third.numel() == 50
    assert first.data_ptr() == third.data_ptr() != second.data_ptr()
    staging.sent()  # no GPU here: nothing to wait for, the turn goes on
    assert staging.take(1).data_ptr() == second.data_ptr()
