"""Tests for data_pipeline/sampler.py: world-size-independent global order, exact resume, epochs, padding."""
from __future__ import annotations

import pytest
import torch

from data_pipeline.sampler import DistributedBatchSampler

pytestmark = pytest.mark.timeout(30)


def global_batches(num_samples, batch_size, world_size, steps=None, **kwargs):
    """Per step, the samples of all ranks together, in rank order."""
    samplers = [DistributedBatchSampler(num_samples, batch_size, rank=r, world_size=world_size, **kwargs)
                for r in range(world_size)]
    out = [sum(parts, []) for parts in zip(*samplers)]
    return out if steps is None else out[:steps]


def test_each_rank_takes_its_slice_of_each_global_batch():
    ranks = [list(DistributedBatchSampler(20, 2, rank=r, world_size=3)) for r in range(3)]
    assert ranks[0] == [[0, 1], [6, 7], [12, 13]]
    assert ranks[1] == [[2, 3], [8, 9], [14, 15]]
    assert ranks[2] == [[4, 5], [10, 11], [16, 17]]
    assert len(DistributedBatchSampler(20, 2, rank=0, world_size=3)) == 3


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_order_independent_of_world_size(shuffle):
    # the same 8-sample global batch as 1x8, 2x4, 4x2 ranks x micro-batch
    orders = [sum(global_batches(100, 8 // w, w, shuffle=shuffle, seed=3), []) for w in (1, 2, 4)]
    assert orders[0] == orders[1] == orders[2]
    assert sorted(orders[0]) == sorted(set(orders[0])) and len(orders[0]) == 96
    assert (orders[0] == list(range(96))) != shuffle


@pytest.mark.parametrize("new_world, new_batch", [(2, 2), (4, 1), (1, 4)])
def test_resume_continues_exactly_at_any_world_size(new_world, new_batch):
    reference = global_batches(50, 2, 2, shuffle=True, seed=1)
    samplers = [DistributedBatchSampler(50, 2, rank=r, world_size=2, shuffle=True, seed=1) for r in range(2)]
    iters = [iter(s) for s in samplers]
    for _ in range(5):  # train 5 steps, then checkpoint
        [next(it) for it in iters]
    state = samplers[0].state_dict()
    assert state["consumed_samples"] == 20 == samplers[1].state_dict()["consumed_samples"]
    resumed = []
    for r in range(new_world):
        s = DistributedBatchSampler(50, new_batch, rank=r, world_size=new_world, shuffle=False)
        s.load_state_dict(state)
        resumed.append(list(s))
    assert [sum(parts, []) for parts in zip(*resumed)] == reference[5:]


def test_resume_with_another_global_batch_continues_the_epoch_exactly():
    """5 steps of 3 ranks x 2, then 4 ranks x 2: the epoch goes on from sample 30 of its order (no sample twice,
    none skipped; it ends where a whole batch of 8 no longer fits) and the next starts at its order's first."""
    def order(epoch):  # the epoch's whole order, one sample a batch
        s = DistributedBatchSampler(100, 1, rank=0, world_size=1, shuffle=True, seed=7)
        s.load_state_dict({"consumed_samples": 0, "epoch": epoch, "epoch_samples": 0})
        return sum(s, [])

    before = global_batches(100, 2, 3, steps=5, shuffle=True, seed=7)
    state = DistributedBatchSampler(100, 2, rank=0, world_size=3, shuffle=True, seed=7)
    it = iter(state)
    for _ in range(5):
        next(it)
    saved = state.state_dict()
    assert (saved["consumed_samples"], saved["epoch"], saved["epoch_samples"]) == (30, 0, 30)
    resumed = [DistributedBatchSampler(100, 2, rank=r, world_size=4, shuffle=True, seed=7) for r in range(4)]
    for s in resumed:
        s.load_state_dict(saved)
    rest = [sum(parts, []) for parts in zip(*resumed)]
    assert sum(before, []) + sum(rest, []) == order(0)[:94]
    assert [sum(parts, []) for parts in zip(*resumed)][0] == order(1)[:8]


def test_epochs_and_consumed_samples_counter():
    s = DistributedBatchSampler(10, 2, rank=0, world_size=2, shuffle=True, seed=0)
    first, second = list(s), list(s)
    assert s.consumed_samples == 16 and s.epoch == 2
    assert len(first) == len(second) == 2 and first != second  # a new permutation each epoch
    again = DistributedBatchSampler(10, 2, rank=0, world_size=2, shuffle=True, seed=0, consumed_samples=8)
    assert list(again) == second


def test_drop_last_false_pads_from_the_start():
    batches = global_batches(10, 2, 2, drop_last=False)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert len(DistributedBatchSampler(10, 2, rank=1, world_size=2, drop_last=False)) == 3


def test_errors():
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        DistributedBatchSampler(3, 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank < world_size"):
        DistributedBatchSampler(10, 2, rank=2, world_size=2)
    s = DistributedBatchSampler(10, 1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="dataset of 12 samples"):
        s.load_state_dict({"consumed_samples": 0, "num_samples": 12})


def test_with_dataloader():
    data = torch.arange(40).unsqueeze(1)
    dataset = torch.utils.data.TensorDataset(data)
    loaders = [torch.utils.data.DataLoader(dataset, batch_sampler=DistributedBatchSampler(dataset, 4, rank=r,
                                                                                          world_size=2))
               for r in range(2)]
    rank0, rank1 = ([b[0].flatten().tolist() for b in loader] for loader in loaders)
    assert rank0[0] == [0, 1, 2, 3] and rank1[0] == [4, 5, 6, 7]
    assert sorted(sum(rank0 + rank1, [])) == list(range(40))
