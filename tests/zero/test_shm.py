"""zero/shm.py beyond the results test_comm checks: every rank or none on shared memory, nothing left in
the shared-memory directory, half-precision sums that would overflow, and mismatched collectives
reported instead of mixing two collectives' bytes.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed


def _fallback(rank: int, world: int, dirs: list[str]) -> dict:
    from zerogpt.zero import comm, shm

    shm.SHM_DIR = dirs[rank]  # one rank cannot see the others' directory: as on another host
    opened = shm.open_transport(None)
    mine = torch.empty(4)
    comm.reduce_scatter_flat(mine, torch.arange(4.0 * world) + rank, transport=opened)
    return dict(transport=opened is not None, mine=mine,
                files=sorted(f for d in set(dirs) if os.path.isdir(d) for f in os.listdir(d)))


@pytest.mark.timeout(60)
def test_ranks_that_cannot_share_a_mapping_all_stay_on_gloo(tmp_path):
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir(), other.mkdir()
    results = run_distributed(_fallback, 3, [str(shared), str(shared), str(other)], timeout=50)
    total = sum(torch.arange(12.0) + r for r in range(3))
    for rank, r in enumerate(results):
        assert r["transport"] is False
        torch.testing.assert_close(r["mine"], total[rank * 4 : (rank + 1) * 4], rtol=0, atol=0)
        assert r["files"] == []


def _missing_dir(rank: int, world: int, missing: str) -> bool:
    from zerogpt.zero import shm

    shm.SHM_DIR = missing
    return shm.open_transport(None) is not None


@pytest.mark.timeout(60)
def test_no_shared_memory_directory_means_gloo(tmp_path):
    assert run_distributed(_missing_dir, 2, str(tmp_path / "absent"), timeout=50) == [False, False]


def _half_sums(rank: int, world: int, shm_dir: str) -> dict:
    from zerogpt.zero import shm

    shm.SHM_DIR = shm_dir
    transport = shm.open_transport(None)
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        big = torch.full((8,), 60000.0 if dtype == torch.float16 else 3.0, dtype=dtype)
        mine = torch.empty(8 // world, dtype=dtype)
        transport.reduce_scatter(mine, big, scale=1 / world).wait()
        transport.all_reduce(big, scale=1 / world).wait()
        out[str(dtype)] = (mine, big)
    return out


@pytest.mark.timeout(60)
def test_half_precision_means_do_not_overflow_in_the_sum(tmp_path):
    """fp16 60000 + 60000 overflows fp16; the mean does not. (bf16 has fp32's range: checked for values only.)"""
    for r in run_distributed(_half_sums, 2, str(tmp_path), timeout=50):
        for dtype, value in (("torch.float16", 60000.0), ("torch.bfloat16", 3.0)):
            mine, every = r[dtype]
            assert torch.isfinite(mine).all() and torch.isfinite(every).all(), dtype
            torch.testing.assert_close(mine.float(), torch.full((4,), value, dtype=mine.dtype).float())
            torch.testing.assert_close(every.float(), torch.full((8,), value, dtype=mine.dtype).float())


def _mismatch(rank: int, world: int, shm_dir: str) -> str:
    from zerogpt.zero import shm

    shm.SHM_DIR = shm_dir
    transport = shm.open_transport(None)
    if rank == 0:
        job = transport.reduce_scatter(torch.empty(4), torch.ones(8))
    else:
        job = transport.all_gather(torch.empty(8), torch.ones(4))
    with pytest.raises(shm.CollectiveMismatch) as info:
        job.wait()
    return str(info.value)


@pytest.mark.timeout(60)
def test_mismatched_collectives_fail_on_every_rank(tmp_path):
    messages = run_distributed(_mismatch, 2, str(tmp_path), timeout=50)
    assert "rank 0 of 2 is in reduce_scatter of 8 elements" in messages[0]
    assert "rank 1 of 2 is in all_gather of 8 elements" in messages[1]
    assert all("same order" in m for m in messages)


def test_sizes_that_do_not_split_over_the_ranks_are_refused():
    from zerogpt.zero import shm

    with pytest.raises(ValueError, match="exactly 2 x the small one"):
        shm.check_flat(torch.empty(3), torch.empty(7), 2, "reduce_scatter")


def _close(rank: int, world: int, shm_dir: str) -> dict:
    import threading

    from zerogpt.zero import comm, shm

    shm.SHM_DIR = shm_dir
    first, second = shm.open_transport(None), shm.open_transport(None)  # two engines of one process: two transports
    first.close()
    mine = torch.empty(2)
    comm.reduce_scatter_flat(mine, torch.arange(2.0 * world) + rank, transport=second)  # unaffected by the close
    first.close()  # a second close does nothing
    try:
        comm.reduce_scatter_flat(torch.empty(2), torch.arange(2.0 * world), transport=first)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    second.close()
    on_gloo = torch.empty(2)
    comm.reduce_scatter_flat(on_gloo, torch.arange(2.0 * world) + rank)  # no transport: gloo
    return dict(distinct=first is not second, refused=refused, mine=mine, on_gloo=on_gloo,
                thread_gone=not first._worker.is_alive() and not second._worker.is_alive(),
                unmapped=first.buffers is None and second.buffers is None,
                threads=[t.name for t in threading.enumerate() if t.name == "zerogpt-shm-comm"])


@pytest.mark.timeout(60)
def test_each_open_is_a_transport_of_its_own_and_close_stops_it_once(tmp_path):
    for rank, r in enumerate(run_distributed(_close, 2, str(tmp_path), timeout=50)):
        assert r["distinct"] and r["thread_gone"] and r["unmapped"] and r["threads"] == [], r
        assert "transport of rank" in r["refused"] and "is closed" in r["refused"], r["refused"]
        expected = (torch.arange(4.0) * 2 + 1)[rank * 2 : rank * 2 + 2]
        torch.testing.assert_close(r["mine"], expected)
        torch.testing.assert_close(r["on_gloo"], expected)


def _barrier_tensors(rank: int, world: int, shm_dir: str) -> dict:
    from zerogpt.zero import shm

    shm.SHM_DIR = shm_dir
    transport = shm.open_transport(None)
    handed, all_reduce = [], shm.dist.all_reduce

    def recording(tensor, *args, **kwargs):
        if kwargs.get("group") is transport.sync:
            handed.append(tensor)
        return all_reduce(tensor, *args, **kwargs)

    shm.dist.all_reduce = recording
    try:
        transport.reduce_scatter(torch.empty(4), torch.ones(8)).wait()
        transport.all_gather(torch.empty(8), torch.ones(4)).wait()
        transport.close()
    finally:
        shm.dist.all_reduce = all_reduce
    return dict(handed=len(handed), one_tensor=all(t is transport._signal for t in handed),
                held_by_gloo_after_close=transport._signal._use_count() - 1)


@pytest.mark.timeout(60)
def test_the_barriers_share_one_tensor_that_gloo_has_let_go_of_when_close_returns(tmp_path):
    """At exit, a finished collective's tensor freed on gloo's worker (its Python object already dropped) needs the
    GIL there, which the finalizing interpreter never gives back: the process aborted once in about 60 runs of
    tests/zero/exit_without_close.py. The barrier tensor is the transport's own, released by gloo before close()."""
    for r in run_distributed(_barrier_tensors, 2, str(tmp_path), timeout=50):
        assert r == dict(handed=2, one_tensor=True, held_by_gloo_after_close=0), r
