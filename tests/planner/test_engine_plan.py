"""The engine plan without an engine (zerogpt/planner/engine_plan.py): each decision of initialize's build, read off
the plan made for a small meta-device layout on a CPU context (the GPU's decisions through a context whose device is
cuda: nothing is allocated)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.planner.engine_plans import plan_for
from zerogpt.planner.engine_plan import EnginePlan
from zerogpt.zero import BucketTensorShardStrategy

SMALL_CHUNKS = BucketTensorShardStrategy(bucket_mb=0.02)  # 5,242 bf16 elements: LAYOUT packs into several chunks
FULL_OFFLOAD = dict(stage=3, offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu"))


def gpu_ctx(world: int = 1) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cuda", 0), dp_size=world, dp_group=None)


def test_stage_3_full_offload_rests_everything_on_the_host():
    plan = plan_for(FULL_OFFLOAD, world=2)
    assert (plan.stage, plan.param_home, plan.optim_home, plan.grad_home) == (3, "host", "host", "host")
    assert set(plan.chunk_homes) == {"host"} and len(plan.chunk_homes) == len(plan.chunks)
    assert not plan.keeps_full_params and not plan.forward_waits_for_step
    assert all(p.num_shards == 2 for p in plan.chunks)


@pytest.mark.parametrize("precision, zero, expected", [
    ("fp32", FULL_OFFLOAD, True),                          # param shards and masters both on the host
    ("bf16", FULL_OFFLOAD, False),                         # the param shard is bf16: an fp32 master beside it
    ("fp32", dict(stage=2), True),                         # both on the device
    ("fp32", dict(stage=2, offload_optimizer=dict(device="cpu")), False),  # params on the device, master on host
    ("fp32", dict(stage=3, offload_optimizer=dict(device="disk", path="/tmp")), False),  # a disk master is a file
])
def test_the_master_is_the_param_shard_only_where_both_rest_in_fp32(precision, zero, expected):
    assert plan_for(zero, precision=precision).master_is_param_shard is expected


def test_disk_state_is_counted_and_its_gradients_cross_to_the_host():
    plan = plan_for(dict(stage=2, offload_optimizer=dict(device="disk", path="/tmp")), world=2)
    shard = sum(p.shard_numel for p in plan.chunks if p.trainable)
    assert (plan.optim_home, plan.grad_home, plan.disk_bytes) == ("disk", "host", shard * 12)


def test_host_masters_at_stages_1_2_wait_for_their_step_before_forward():
    assert plan_for(dict(stage=2, offload_optimizer=dict(device="cpu"))).forward_waits_for_step
    assert not plan_for(dict(stage=2)).forward_waits_for_step  # the step runs in place on the device
    assert not plan_for(FULL_OFFLOAD).forward_waits_for_step  # stage 3: each chunk's gather waits instead


def test_stage_0_keeps_one_whole_copy_and_decides_nothing_for_offload():
    plan = plan_for(dict(stage=0), world=2)
    assert all(p.num_shards == 1 for p in plan.chunks) and plan.keeps_full_params
    assert (plan.optim_home, plan.grad_home, plan.disk_bytes, plan.forward_waits_for_step) == ("device", "device", 0,
                                                                                               False)


def test_state_dtype_loss_scaling_and_compute_dtype_follow_the_config():
    plan = plan_for(dict(stage=2, offload_optimizer=dict(device="cpu", state_dtype="bf16")), precision="fp16")
    assert (plan.state_dtype, plan.compute_dtype, plan.scales_loss) == (torch.bfloat16, torch.float16, True)
    assert not plan_for(dict(stage=2), precision="bf16").scales_loss


def test_device_budget_keeps_the_first_chunks_that_fit_on_the_device():
    zero = dict(FULL_OFFLOAD, shard_strategy=SMALL_CHUNKS)
    everything = plan_for(zero)
    first = everything.chunks[0].shard_numel * 4  # fp32 bytes of the first chunk's shard
    kept = plan_for(dict(zero, offload_param=dict(device="cpu", device_budget=first)))
    assert len(everything.chunks) > 1 and kept.resident_chunks == frozenset({0})
    assert kept.chunk_homes[0] == "device" and set(kept.chunk_homes[1:]) == {"host"}
    # "auto": half the device's free memory at build; a CPU run (no free-memory reading) keeps every chunk
    auto = dict(zero, offload_param=dict(device="cpu", device_budget="auto"))
    assert plan_for(auto, device_free_bytes=2 * first).resident_chunks == frozenset({0})
    assert plan_for(auto).resident_chunks == frozenset(range(len(everything.chunks)))


def test_offloaded_gradients_accumulate_on_the_device_only_with_room():
    zero = dict(stage=2, offload_optimizer=dict(device="cpu"))
    need = sum(p.shard_numel for p in plan_for(zero).chunks if p.trainable) * 4
    assert plan_for(zero, accumulation=4).accumulate_on_device  # a CPU run: one memory
    short = plan_for(zero, accumulation=4, device_free_bytes=need - 1)
    assert not short.accumulate_on_device and short.grad_accum_bytes == need  # said at build, not granted
    assert not plan_for(zero, accumulation=1).accumulate_on_device  # nothing to accumulate
    assert not plan_for(FULL_OFFLOAD, accumulation=4).accumulate_on_device  # param offload: the device is short


def test_a_gpu_computing_pins_overlaps_and_fuses_where_a_cpu_run_does_not():
    offload = dict(stage=2, offload_optimizer=dict(device="cpu"))
    cpu, gpu = plan_for(offload), plan_for(offload, ctx=gpu_ctx(), device_free_bytes=2**34)
    gpu_flags = ("hand_over_at_launch", "host_step_overlaps", "stages_compute_copies", "pins_host_state")
    assert all(getattr(gpu, f) for f in gpu_flags) and not any(getattr(cpu, f) for f in gpu_flags)
    assert cpu.keep_freed_memory and not gpu.keep_freed_memory  # the host's malloc setting: host compute only
    unpinned = plan_for(dict(stage=2, offload_optimizer=dict(device="cpu", pin_memory=False)), ctx=gpu_ctx())
    assert not unpinned.pins_host_state
    assert plan_for(FULL_OFFLOAD, ctx=gpu_ctx()).pins_param_shards and not plan_for(FULL_OFFLOAD).pins_param_shards
    # the fused device step: torch's Adam family on the device of a GPU run, nothing else
    assert plan_for(dict(stage=2), ctx=gpu_ctx(), optimizer_type=torch.optim.AdamW).fused_device_step
    assert not plan_for(dict(stage=2), optimizer_type=torch.optim.AdamW).fused_device_step
    assert not plan_for(offload, ctx=gpu_ctx(), optimizer_type=torch.optim.AdamW).fused_device_step


def test_describe_prints_every_decision_once():
    plan = plan_for(dict(FULL_OFFLOAD, shard_strategy=SMALL_CHUNKS), precision="bf16", accumulation=2)
    lines = plan.describe().splitlines()
    names = [line.split(":")[0] for line in lines]
    decisions = {f for f in EnginePlan.__dataclass_fields__ if f != "config"}
    assert decisions <= set(names) and len(names) == len(set(names)), names
    assert "stage: 3" in lines and "optim_home: host" in lines and "gradient_accumulation: 2" in lines
    assert f"chunk_homes: {', '.join(f'{i}:host' for i in range(len(plan.chunks)))}" in lines
