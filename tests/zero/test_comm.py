"""zero/comm.py: the flat all-gather, reduce-scatter and all-reduce, on each algorithm: shared memory
(zero/shm.py, ranks on one host; with slots so small that every collective takes several pieces), the
gloo algorithms (per-rank broadcasts, all-reduce + slice) and torch's flat collectives (the path NCCL
takes), on 2 and 3 gloo ranks: sync and async, scaled, an input that is this rank's slice of the output
(the in-place all-gather stages 0-2 use), and a subgroup whose ranks are not the world's.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed


def _values(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 10 + rank  # distinct per rank and position


def _collectives(rank: int, world: int, algorithm: str, shm_dir: str) -> dict:
    import torch.distributed as dist

    from zerogpt.zero import comm, shm

    shm.SHM_DIR = shm_dir
    shm.STAGING_BYTES = 2 * world * 64  # 64-byte slots: 16 fp32 per piece, so 3 pieces below
    transport = None  # without one, collectives run on gloo
    if algorithm == "flat-collectives":
        comm._uses_gloo = lambda tensor, group: False  # this process only: take torch's flat collectives
    elif algorithm == "shared-memory":
        transport = shm.open_transport(None)  # as the engine opens it at initialize()
    shard = 40
    out = {}
    full = torch.full((shard * world,), float("nan"))
    comm.all_gather_flat(full, _values(rank, shard), transport=transport)
    out["gather"] = full.clone()

    full = torch.full((shard * world,), float("nan"))
    full[rank * shard : (rank + 1) * shard] = _values(rank, shard)
    comm.all_gather_flat(full, full[rank * shard : (rank + 1) * shard], async_op=True, transport=transport).wait()
    out["gather_in_place_async"] = full.clone()

    grads = _values(rank, shard * world)
    mine = torch.empty(shard)
    work = comm.reduce_scatter_flat(mine, grads, async_op=True, transport=transport)
    work.wait()
    out["reduce_scatter_async"] = mine.clone()
    mine = torch.empty(shard)
    comm.reduce_scatter_flat(mine, _values(rank, shard * world), transport=transport)
    out["reduce_scatter"] = mine.clone()
    mine = torch.empty(shard)
    comm.reduce_scatter_flat(mine, _values(rank, shard * world), scale=0.5, transport=transport)
    out["reduce_scatter_scaled"] = mine.clone()
    every = _values(rank, 37)  # any size: stage 0 chunks are not padded to the world size
    comm.all_reduce_flat(every, async_op=True, scale=0.25, transport=transport).wait()
    out["all_reduce_scaled"] = every
    out["used_shared_memory"] = comm._shared_memory(every, None, transport) is not None
    out["files_left"] = os.listdir(shm_dir) if os.path.isdir(shm_dir) else []
    # sizes that do not split over the ranks: refused locally, before any rank waits on the others
    bad = {"all_gather": lambda: comm.all_gather_flat(torch.empty(shard * world + 1), _values(rank, shard),
                                                      transport=transport),
           "reduce_scatter": lambda: comm.reduce_scatter_flat(torch.empty(shard), torch.empty(shard * 2 + 1),
                                                              transport=transport)}
    for kind, call in bad.items():
        try:
            call()
        except ValueError as e:
            out[f"bad_{kind}"] = str(e)

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
    if transport is not None:
        transport.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm", ["shared-memory", "gloo-algorithms", "flat-collectives"])
def test_flat_collectives(world, algorithm, tmp_path):
    results = run_distributed(_collectives, world, algorithm, str(tmp_path), timeout=100)
    shard = 40
    gathered = torch.cat([_values(r, shard) for r in range(world)])
    total = sum(_values(r, shard * world) for r in range(world))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["gather"], gathered, rtol=0, atol=0)
        torch.testing.assert_close(r["gather_in_place_async"], gathered, rtol=0, atol=0)
        for key in ("reduce_scatter", "reduce_scatter_async"):
            torch.testing.assert_close(r[key], total[rank * shard : (rank + 1) * shard], rtol=0, atol=0)
        torch.testing.assert_close(r["reduce_scatter_scaled"], total[rank * shard : (rank + 1) * shard] * 0.5)
        torch.testing.assert_close(r["all_reduce_scaled"], sum(_values(q, 37) for q in range(world)) * 0.25)
        assert r["used_shared_memory"] == (algorithm == "shared-memory")
        assert r["files_left"] == []  # the mapping's file is unlinked once every rank has it
        for kind in ("all_gather", "reduce_scatter"):
            expected = f"{kind}: expected contiguous tensors with the large one exactly {world} x the small one"
            assert r.get(f"bad_{kind}", "").startswith(f"{expected} ({world} ranks)"), r.get(f"bad_{kind}")
    sub_total = _values(0, shard * 2) + _values(1, shard * 2)
    for g_rank, rank in enumerate([world - 2, world - 1]):
        r = results[rank]
        torch.testing.assert_close(r["sub_gather"], torch.cat([_values(0, shard), _values(1, shard)]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(r["sub_reduce_scatter"], sub_total[g_rank * shard : (g_rank + 1) * shard],
                                   rtol=0, atol=0)
    if world == 3:
        assert "sub_gather" not in results[0]
