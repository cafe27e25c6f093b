"""zero/chunk.py: the Chunk runtime (gather / release / reduce), on one process and on 3 gloo ranks (the layout it
holds: tests/zero/test_chunk_plan.py)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from zerogpt.zero.chunk_plan import ChunkPlan, ParamSlot
from zerogpt.zero.chunk import Chunk

# runtime, one process (no process group)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_chunk_gather_release_one_process():
    shapes = [(2, 3), (5,)]
    params = _params(shapes)
    values = torch.cat([p.detach().reshape(-1) for p in params])
    plan = ChunkPlan(0, (ParamSlot("w", (2, 3), 0), ParamSlot("b", (5,), 6)), 0, 1)
    chunk = Chunk(plan, params, dtype=torch.float32, device=torch.device("cpu"), rank=0, group=None,
                  persistent_full=False, shard_device=torch.device("cpu"), pin_memory=False)
    chunk.load_full(values)
    chunk.bind_params()
    assert chunk.full is None and all(p.numel() == 0 for p in params)  # released: params are empty
    chunk.gather()
    assert chunk.is_gathered
    torch.testing.assert_close(params[0].data, values[:6].view(2, 3), rtol=0, atol=0)
    params[1].data.add_(1.0)  # params are views of the gathered buffer
    torch.testing.assert_close(chunk.full[6:], values[6:] + 1.0, rtol=0, atol=0)
    # one shard on the compute's device: the gathered buffer is the shard itself, no copy (and no second buffer)
    assert chunk.full is chunk.shard
    chunk.release()
    assert chunk.full is None and params[0].numel() == 0
    torch.testing.assert_close(chunk.shard[:6], values[:6], rtol=0, atol=0)  # the shard keeps the values


def test_chunk_grad_accumulation_one_process():
    params = _params([(3,), (4,)])
    plan = ChunkPlan(0, (ParamSlot("x", (3,), 0), ParamSlot("y", (4,), 3)), 0, 1)
    chunk = Chunk(plan, params, dtype=torch.float32, device=torch.device("cpu"), rank=0, group=None,
                  persistent_full=True, shard_device=torch.device("cpu"), pin_memory=False)
    chunk.add_param_grad(1, torch.ones(4))
    assert not chunk.grads_complete
    chunk.add_param_grad(0, torch.full((3,), 2.0))
    chunk.add_param_grad(0, torch.full((3,), 2.0))  # a second micro-step accumulates
    chunk.launch_reduce()
    out = chunk.finish_reduce()
    torch.testing.assert_close(out, torch.tensor([4.0, 4, 4, 1, 1, 1, 1]))
    assert chunk.grad_full is None and chunk.slots_ready == set()  # freed after the reduction


def test_slots_without_a_gradient_and_padding_reduce_as_zeros(monkeypatch):
    """grad_full starts uninitialised (each slot's first gradient is copied in): the slots no gradient
    reached and the padding must still reduce as zeros. Fresh buffers are filled with NaN here so
    leftover memory cannot pass for zeros."""
    import zerogpt.zero.chunk as chunk_module

    real_empty = torch.empty
    monkeypatch.setattr(chunk_module.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    params = _params([(3,), (2,), (4,)])
    plan = ChunkPlan(0, (ParamSlot("x", (3,), 0), ParamSlot("y", (2,), 3), ParamSlot("z", (4,), 5)), 0, 2)
    chunk = Chunk(plan, params, dtype=torch.float32, device=torch.device("cpu"), rank=0, group=None,
                  persistent_full=True, shard_device=torch.device("cpu"), pin_memory=False)
    chunk.add_param_grad(0, torch.ones(3))
    chunk.add_param_grad(2, torch.full((4,), 3.0))  # y gets no gradient; 9 elements pad to 10
    chunk.launch_reduce()  # one process: the "reduction" hands back the whole buffer
    torch.testing.assert_close(chunk.finish_reduce(), torch.tensor([1.0, 1, 1, 0, 0, 3, 3, 3, 3, 0]), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# runtime, 3 gloo ranks


def _three_rank_chunk(rank: int, world: int) -> dict:
    """One 13-element chunk (two params) over 3 ranks: shards, all-gather, reduce-scatter of means."""
    import torch.distributed as dist

    plan = ChunkPlan(0, (ParamSlot("w", (2, 5), 0), ParamSlot("b", (3,), 10)), 0, world)
    params = _params([(2, 5), (3,)])  # same seed: the same full values on every rank
    values = torch.cat([p.detach().reshape(-1) for p in params])
    chunk = Chunk(plan, params, dtype=torch.float32, device=torch.device("cpu"), rank=rank,
                  group=dist.group.WORLD, persistent_full=False, shard_device=torch.device("cpu"), pin_memory=False)
    chunk.load_full(values)
    chunk.bind_params()
    shard = chunk.shard.clone()
    chunk.gather(async_op=True)
    chunk.wait_gather()
    gathered = [p.detach().clone() for p in params]
    chunk.release()
    # rank r contributes gradient (r + 1) everywhere: the mean is 2 for 3 ranks
    for slot_index, p in enumerate(params):
        chunk.add_param_grad(slot_index, torch.full(plan.slots[slot_index].shape, float(rank + 1)))
    chunk.launch_reduce()
    return {"shard": shard, "gathered": gathered, "values": values, "reduced": chunk.finish_reduce().clone()}


@pytest.mark.timeout(120)
def test_chunk_shards_gather_and_reduce_scatter_on_three_ranks():
    results = run_distributed(_three_rank_chunk, 3, timeout=100)
    values = results[0]["values"]
    padded = torch.cat([values, torch.zeros(2)])  # 13 elements -> 15, shards of 5
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["shard"], padded[5 * rank : 5 * rank + 5], rtol=0, atol=0)
        torch.testing.assert_close(r["gathered"][0], values[:10].view(2, 5), rtol=0, atol=0)
        torch.testing.assert_close(r["gathered"][1], values[10:], rtol=0, atol=0)
        expected = torch.full((5,), 2.0)
        if rank == 2:
            expected[3:] = 0.0  # padding receives no gradient
        torch.testing.assert_close(r["reduced"], expected)
