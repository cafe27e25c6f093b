"""zero/chunk_plan.py and config/strategy.py: the chunk layout (pure arithmetic, no process group).

Invariants: parameters are packed in registration order into flat buffers padded to a multiple of the number of
shards; every rank owns one equal, contiguous shard; a chunk never mixes optimizer param groups (frozen
parameters, group -1, get chunks of their own); a parameter is never split.
"""
from __future__ import annotations

import pytest
import torch

from zerogpt.zero.chunk_plan import plan_chunks

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
