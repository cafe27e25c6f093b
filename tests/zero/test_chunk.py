"""zero/chunk.py and zero/strategy.py: the chunk plan (pure arithmetic, no process group) and the
Chunk runtime (gather / release / reduce), on one process and on 3 gloo ranks.

Plan invariants: parameters are packed in registration order into flat buffers padded to a multiple
of the number of shards; every rank owns one equal, contiguous shard; a chunk never mixes optimizer
param groups (frozen parameters, group -1, get chunks of their own); a parameter is never split.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from zerogpt.zero.chunk import Chunk, ChunkPlan, ParamSlot, plan_chunks

MB = 1024 * 1024

# deliberately awkward sizes: primes, a scalar-like bias, a matrix, nothing divisible by 2 or 3
UNEVEN = [("a", (7, 5), 0), ("b", (11,), 0), ("c", (1,), 0), ("d", (13, 3), 0), ("e", (29,), 0)]


def _strategies():
    from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy

    return TensorShardStrategy, BucketTensorShardStrategy


def test_strategies_are_importable_from_zerogpt_zero():
    TensorShardStrategy, BucketTensorShardStrategy = _strategies()
    assert BucketTensorShardStrategy(bucket_mb=4).bucket_mb == 4
    assert TensorShardStrategy() == TensorShardStrategy()
    assert BucketTensorShardStrategy(bucket_mb=4) != BucketTensorShardStrategy(bucket_mb=8)
    assert repr(BucketTensorShardStrategy(bucket_mb=4)) == "BucketTensorShardStrategy(bucket_mb=4)"


def test_registration_order_and_contiguous_slots():
    _, Bucket = _strategies()
    [plan] = plan_chunks(UNEVEN, Bucket(bucket_mb=1), num_shards=1, element_size=4)
    assert [s.name for s in plan.slots] == ["a", "b", "c", "d", "e"]
    assert [s.offset for s in plan.slots] == [0, 35, 46, 47, 86]
    assert plan.numel == 35 + 11 + 1 + 39 + 29
    assert plan.padded_numel == plan.numel  # one shard: no padding


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_padding_and_equal_shards(num_shards):
    Tensor, Bucket = _strategies()
    for strategy in (Tensor(), Bucket(bucket_mb=1), Bucket(bucket_mb=200 / MB)):
        for plan in plan_chunks(UNEVEN, strategy, num_shards, element_size=4):
            assert plan.padded_numel % num_shards == 0
            assert 0 <= plan.padded_numel - plan.numel < num_shards  # the least padding that works
            assert plan.shard_numel * num_shards == plan.padded_numel
            ranges = [plan.shard_range(r) for r in range(num_shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == plan.padded_numel
            assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))  # contiguous, no gaps


@pytest.mark.parametrize("num_shards", [2, 3])
def test_each_slot_is_split_exactly_across_shards(num_shards):
    """slot_overlap partitions every parameter over the shards: no element lost or owned twice."""
    _, Bucket = _strategies()
    for plan in plan_chunks(UNEVEN, Bucket(bucket_mb=1), num_shards, element_size=2):
        for slot in plan.slots:
            owned = torch.zeros(plan.padded_numel, dtype=torch.int64)
            for r in range(num_shards):
                part = plan.slot_overlap(slot, r)
                if part is not None:
                    lo, hi = plan.shard_range(r)
                    assert lo <= part[0] < part[1] <= hi
                    owned[part[0] : part[1]] += 1
            assert owned[slot.offset : slot.end].eq(1).all()
            assert owned.sum() == slot.numel


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_shard_pieces_rebuild_every_shard_from_parameter_ranges(num_shards):
    """Filling each shard from (name, start, end, at) pieces of the flattened parameters rebuilds the chunk."""
    _, Bucket = _strategies()
    for plan in plan_chunks(UNEVEN, Bucket(bucket_mb=1e-4), num_shards, element_size=4):
        values = {s.name: torch.arange(s.numel, dtype=torch.float32) + 1000 * i for i, s in enumerate(plan.slots)}
        flat = torch.zeros(plan.padded_numel)
        flat[: plan.numel] = torch.cat([values[s.name] for s in plan.slots])
        for r in range(num_shards):
            shard = torch.zeros(plan.shard_numel)
            for name, start, end, at in plan.shard_pieces(r):
                assert 0 <= start < end and at + end - start <= plan.shard_numel
                shard[at : at + end - start] = values[name][start:end]
            lo, hi = plan.shard_range(r)
            assert torch.equal(shard, flat[lo:hi]), (plan.index, r)


def test_three_ranks_padding_values():
    """World sizes that divide nothing: 3 ranks over sizes 35, 11, 1, 39, 29 (one param per chunk)."""
    Tensor, _ = _strategies()
    plans = plan_chunks(UNEVEN, Tensor(), num_shards=3, element_size=4)
    assert [p.padded_numel for p in plans] == [36, 12, 3, 39, 30]
    assert [p.shard_numel for p in plans] == [12, 4, 1, 13, 10]
    # a 1-element parameter still gives every rank a shard (two of them pure padding)
    assert plans[2].slot_overlap(plans[2].slots[0], 0) == (0, 1)
    assert plans[2].slot_overlap(plans[2].slots[0], 1) is None


def test_tensor_strategy_one_param_per_chunk():
    Tensor, _ = _strategies()
    plans = plan_chunks(UNEVEN, Tensor(), num_shards=2, element_size=4)
    assert [[s.name for s in p.slots] for p in plans] == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert [p.index for p in plans] == list(range(5))


def test_bucket_strategy_packs_up_to_bucket_bytes():
    _, Bucket = _strategies()
    sizes = [("p0", (10,), 0), ("p1", (10,), 0), ("p2", (10,), 0), ("big", (100,), 0), ("p4", (5,), 0)]
    bucket = Bucket(bucket_mb=80 / MB)  # 80 bytes
    fp32 = plan_chunks(sizes, bucket, 2, element_size=4)  # 40 B per small param
    assert [[s.name for s in p.slots] for p in fp32] == [["p0", "p1"], ["p2"], ["big"], ["p4"]]
    bf16 = plan_chunks(sizes, bucket, 2, element_size=2)  # 20 B per small param: three fit
    assert [[s.name for s in p.slots] for p in bf16] == [["p0", "p1", "p2"], ["big"], ["p4"]]


def test_parameter_larger_than_bucket_gets_its_own_unsplit_chunk():
    _, Bucket = _strategies()
    sizes = [("small", (3,), 0), ("huge", (1000, 10), 0), ("tail", (3,), 0)]
    plans = plan_chunks(sizes, Bucket(bucket_mb=100 / MB), 3, element_size=4)
    huge = [p for p in plans if any(s.name == "huge" for s in p.slots)]
    assert len(huge) == 1 and [s.name for s in huge[0].slots] == ["huge"]
    assert huge[0].numel == 10000 and huge[0].padded_numel == 10002


def test_chunks_never_mix_param_groups():
    _, Bucket = _strategies()
    sizes = [("a", (4,), 0), ("b", (4,), 1), ("c", (4,), 1), ("d", (4,), 0), ("e", (4,), 0)]
    plans = plan_chunks(sizes, Bucket(bucket_mb=1), 2, element_size=4)
    assert [([s.name for s in p.slots], p.group_index) for p in plans] == [
        (["a"], 0), (["b", "c"], 1), (["d", "e"], 0)]


def test_frozen_parameters_get_untrainable_chunks():
    _, Bucket = _strategies()
    sizes = [("a", (4,), 0), ("frozen1", (4,), -1), ("frozen2", (3,), -1), ("b", (4,), 0)]
    plans = plan_chunks(sizes, Bucket(bucket_mb=1), 3, element_size=4)
    assert [p.trainable for p in plans] == [True, False, True]
    assert [s.name for s in plans[1].slots] == ["frozen1", "frozen2"]
    assert plans[1].padded_numel == 9  # frozen chunks are sharded and padded like any other


def test_invalid_plans_fail_with_the_value():
    _, Bucket = _strategies()
    with pytest.raises(ValueError, match="bucket_mb=...\\) must be > 0, got 0"):
        Bucket(bucket_mb=0)
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        plan_chunks(UNEVEN, Bucket(), num_shards=0, element_size=4)


# ----------------------------------------------------------------------------------------------
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
