"""Tests for zerogpt/launch.py and zerogpt/logging.py: single process, 2-rank gloo, seeding, rank-aware logging."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from zerogpt import Config
from zerogpt.launch import launch_from_torch
from zerogpt.logging import get_logger

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def plain_process(monkeypatch):
    """A `python script.py` environment: no torchrun variables, no process group."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_single_process_makes_a_one_rank_group(plain_process):
    with launch_from_torch(Config(train=dict(seed=7)), device="cpu") as ctx:
        assert (ctx.global_rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
        assert ctx.device == torch.device("cpu") and ctx.backend == "gloo" and ctx.is_main
        t = torch.ones(3)
        dist.all_reduce(t, group=ctx.dp_group)  # collectives work the same as on N ranks
        assert t.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()  # the context created the group, so it tore it down


@pytest.mark.timeout(60)
def test_seeds_python_numpy_torch_from_config_or_argument(plain_process):
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    ctx = launch_from_torch(Config(train=dict(seed=123)), device="cpu")
    first = draw()
    ctx.destroy()
    ctx = launch_from_torch(dict(train=dict(seed=123)), device="cpu")
    assert draw() == first
    ctx.destroy()
    ctx = launch_from_torch(Config(train=dict(seed=123)), seed=5, device="cpu")  # explicit seed wins
    assert draw() != first
    ctx.destroy()


def test_bad_arguments_and_environment(plain_process, monkeypatch):
    with pytest.raises(ValueError, match="device must be"):
        launch_from_torch(device="tpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK is not"):
        launch_from_torch(device="cpu")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set; launch with torchrun"):
        launch_from_torch(device="cpu")
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' must be an integer"):
        launch_from_torch(device="cpu")
    assert not dist.is_initialized()


def _two_rank_launches(rank: int, world_size: int, init_file: str) -> dict:
    # 1) A group already exists (run_distributed made it): launch_from_torch wraps it and leaves it up.
    ctx = launch_from_torch(seed=0)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=ctx.dp_group)
    ctx.destroy()
    wrapped = dict(rank=ctx.global_rank, world=ctx.world_size, owns=ctx.owns_group, device=str(ctx.device), sum=t.item(),
                   still_up=dist.is_initialized())
    # 2) No group: launch_from_torch builds one from the torchrun variables (RANK/WORLD_SIZE/LOCAL_RANK are set).
    dist.destroy_process_group()
    ctx = launch_from_torch(Config(train=dict(seed=11)), device="cpu", init_method=f"file://{init_file}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=ctx.dp_group)
    launched = dict(rank=ctx.global_rank, world=ctx.world_size, local=ctx.local_rank, owns=ctx.owns_group, sum=t.item(),
                    draw=torch.rand(1).item())
    ctx.destroy()
    return dict(wrapped=wrapped, launched=launched)


@pytest.mark.timeout(120)
def test_two_ranks_wrap_existing_group_then_launch_from_torchrun_env(tmp_path):
    results = run_distributed(_two_rank_launches, 2, str(tmp_path / "rdzv"), timeout=90)
    wrapped = [r["wrapped"] for r in results]
    assert wrapped == [dict(rank=r, world=2, owns=False, device="cpu", sum=2.0, still_up=True) for r in range(2)]
    launched = [r["launched"] for r in results]
    assert [(r["rank"], r["world"], r["local"], r["owns"]) for r in launched] == [(0, 2, 0, True), (1, 2, 1, True)]
    assert launched[0]["sum"] == launched[1]["sum"] == 3.0
    assert launched[0]["draw"] == launched[1]["draw"]  # same seed on every rank: replicated init agrees


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_single_process_uses_nccl(plain_process):
    with launch_from_torch(seed=0) as ctx:
        assert ctx.backend == "nccl" and ctx.device == torch.device("cuda", 0)
        t = torch.ones(2, device=ctx.device)
        dist.all_reduce(t, group=ctx.dp_group)
        assert t.tolist() == [1.0, 1.0]


# --- logging -----------------------------------------------------------------------------------------------

def test_logger_rank0_prints_info_other_ranks_only_warn(capsys):
    get_logger(0).info("step 1 | loss 3.0")
    get_logger(0).warning("careful")
    get_logger(1).info("hidden on rank 1")
    get_logger(1).warning("rank one warns")
    get_logger(2).error("rank two fails")
    out, err = capsys.readouterr()
    assert out == "step 1 | loss 3.0\n"
    assert err.splitlines() == ["[rank 0] WARNING careful", "[rank 1] WARNING rank one warns",
                                "[rank 2] ERROR rank two fails"]


def test_logger_all_ranks_and_no_duplicate_handlers(capsys):
    log = get_logger(3, all_ranks=True)
    log = get_logger(3, all_ranks=True)  # calling twice must not print twice
    log.info("from three")
    out, _ = capsys.readouterr()
    assert out == "[rank 3] INFO from three\n"


@pytest.mark.timeout(60)
def test_cpu_threads_are_set_per_rank_and_printed_once(plain_process, monkeypatch, capsys):
    """Issue 18.10: train.cpu_threads wins; otherwise the cores available / ranks on the host (OMP_NUM_THREADS unset)."""
    before = torch.get_num_threads()
    try:
        with launch_from_torch(Config(train=dict(cpu_threads=1)), device="cpu"):
            assert torch.get_num_threads() == 1
        assert capsys.readouterr().out.count("cpu threads: 1 per rank (train.cpu_threads;") == 1
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        with launch_from_torch(Config(), device="cpu"):
            assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        assert "cores available / 1 rank on this host" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)
