"""zero/comm.py: the flat all-gather and reduce-scatter, on the gloo algorithms (per-rank broadcasts,
all-reduce + slice) and on torch's flat collectives (the path NCCL takes), on 2 and 3 gloo ranks:
sync and async, an input that is this rank's slice of the output (the in-place all-gather stages
0-2 use), and a subgroup whose ranks are not the world's.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _values(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 10 + rank  # distinct per rank and position


def _collectives(rank: int, world: int, use_gloo_algorithms: bool) -> dict:
    import torch.distributed as dist

    from zerogpt.zero import comm

    if not use_gloo_algorithms:
        comm._uses_gloo = lambda tensor, group: False  # this process only: take torch's flat collectives
    shard = 5
    out = {}
    full = torch.full((shard * world,), float("nan"))
    comm.all_gather_flat(full, _values(rank, shard))
    out["gather"] = full.clone()

    full = torch.full((shard * world,), float("nan"))
    full[rank * shard : (rank + 1) * shard] = _values(rank, shard)
    comm.all_gather_flat(full, full[rank * shard : (rank + 1) * shard], async_op=True).wait()
    out["gather_in_place_async"] = full.clone()

    grads = _values(rank, shard * world)
    mine = torch.empty(shard)
    work = comm.reduce_scatter_flat(mine, grads, async_op=True)
    work.wait()
    out["reduce_scatter_async"] = mine.clone()
    mine = torch.empty(shard)
    comm.reduce_scatter_flat(mine, _values(rank, shard * world))
    out["reduce_scatter"] = mine.clone()

    # a subgroup of the last two world ranks: group ranks (0, 1) are world ranks (world-2, world-1)
    members = [world - 2, world - 1]
    group = dist.new_group(members)
    if rank in members:
        g_rank = members.index(rank)
        full = torch.empty(shard * 2)
        comm.all_gather_flat(full, _values(g_rank, shard), group=group)
        out["sub_gather"] = full.clone()
        mine = torch.empty(shard)
        comm.reduce_scatter_flat(mine, _values(g_rank, shard * 2), group=group)
        out["sub_reduce_scatter"] = mine.clone()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_gloo_algorithms", [True, False], ids=["gloo-algorithms", "flat-collectives"])
def test_flat_collectives(world, use_gloo_algorithms):
    results = run_distributed(_collectives, world, use_gloo_algorithms, timeout=100)
    shard = 5
    gathered = torch.cat([_values(r, shard) for r in range(world)])
    total = sum(_values(r, shard * world) for r in range(world))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["gather"], gathered, rtol=0, atol=0)
        torch.testing.assert_close(r["gather_in_place_async"], gathered, rtol=0, atol=0)
        for key in ("reduce_scatter", "reduce_scatter_async"):
            torch.testing.assert_close(r[key], total[rank * shard : (rank + 1) * shard], rtol=0, atol=0)
    sub_total = _values(0, shard * 2) + _values(1, shard * 2)
    for g_rank, rank in enumerate([world - 2, world - 1]):
        r = results[rank]
        torch.testing.assert_close(r["sub_gather"], torch.cat([_values(0, shard), _values(1, shard)]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(r["sub_reduce_scatter"], sub_total[g_rank * shard : (g_rank + 1) * shard],
                                   rtol=0, atol=0)
    if world == 3:
        assert "sub_gather" not in results[0]
