"""The search: plans that reach the tokens per step, memory from memory_model.estimate, fixed keys kept, and the
one-line refusals (bad tokens per step, a fixed key that leaves nothing, nothing fits). No engine, no torch."""
import pytest

from tests.planner.shapes import XL, gpu, xl_work
from zerogpt.memory_model import estimate
from zerogpt.planner.plan import PlanError
from zerogpt.planner.search import enumerate_plans, evaluate, search
from zerogpt.planner.speed import default_constants


def test_every_plan_reaches_the_tokens_per_step_and_is_one_the_engine_accepts():
    work = xl_work(world=2, tokens_per_step=2 * 8 * 1024)
    plans = enumerate_plans(work)
    assert plans
    for p in plans:
        assert p.micro_batch * p.accumulation * work.world * work.seq_len == work.tokens_per_step
        assert p.offload_param == "none" or p.stage == 3
        assert p.state_dtype == "fp32" or p.offload_optimizer != "none"
    assert {p.stage for p in plans} == {0, 1, 2, 3}
    assert "disk" not in {p.offload_optimizer for p in plans}  # no path given: not offered


def test_memory_is_memory_model_estimate():
    machine = gpu(80)
    work = xl_work()
    for plan in enumerate_plans(work)[::97]:
        c = evaluate(plan, work, machine, default_constants(machine))
        est = estimate(XL, c.plan.stage, 1, "bf16", c.plan.offload_optimizer, c.plan.offload_param, 1024,
                       c.plan.micro_batch, c.plan.checkpoint, prefetch=c.plan.prefetch, bucket_mb=c.plan.bucket_mb,
                       accumulation=c.plan.accumulation,
                       optimizer_bytes_per_param=4 if c.plan.state_dtype == "bf16" else 8,
                       loss_chunk=256 if c.plan.chunked_loss else 0, device_budget=c.plan.device_budget)
        assert c.need["device"] == est["totals"]["device"]
        assert c.need["host"] == est["totals"]["host"]


@pytest.mark.parametrize("device_gib", [80, 24, 12])
def test_the_chosen_plan_fits_with_the_margin_and_is_the_fastest_that_does(device_gib):
    machine = gpu(device_gib, host_gib=64)
    choice = search(xl_work(), machine, default_constants(machine))
    best = choice.best
    assert best.fits and best.need["device"] <= 0.9 * machine.device_bytes
    assert best.need["host"] <= 0.9 * machine.host_bytes
    assert best.tokens_per_s == max(c.tokens_per_s for c in choice.ranked)
    assert all(not c.fits for c in choice.unfit)


def test_a_smaller_device_moves_state_off_it():
    big, small = gpu(80, 128), gpu(12, 128)
    on_big = search(xl_work(), big, default_constants(big)).best.plan
    on_small = search(xl_work(), small, default_constants(small)).best.plan
    assert on_big.offload_optimizer == "none"
    assert on_small.offload_optimizer != "none" or on_small.checkpoint


def test_param_offload_keeps_what_the_device_has_room_for():
    machine = gpu(16, 128)
    work = xl_work(fixed=dict(offload_param="cpu", offload_optimizer="cpu", micro_batch=8))
    best = search(work, machine, default_constants(machine)).best
    assert best.plan.offload_param == "cpu"
    assert 0 < best.plan.device_budget <= XL.num_params * 2
    assert best.need["device"] <= 0.9 * machine.device_bytes


def test_a_fixed_key_stays_fixed():
    machine = gpu(80)
    work = xl_work(fixed=dict(stage=3, micro_batch=8))
    choice = search(work, machine, default_constants(machine))
    assert {(c.plan.stage, c.plan.micro_batch, c.plan.accumulation) for c in choice.ranked} == {(3, 8, 8)}


def test_tokens_per_step_not_a_multiple_of_world_times_seq_is_one_line_naming_the_numbers():
    machine = gpu(80)
    with pytest.raises(PlanError) as e:
        search(xl_work(world=2, tokens_per_step=3 * 1024), machine, default_constants(machine))
    assert str(e.value) == ("tokens per step 3,072 is not a multiple of world 2 x SEQ_LEN 1024 = 2,048; use 2,048 "
                            "or 4,096")


def test_a_fixed_key_that_leaves_nothing_is_named():
    machine = gpu(24, 64)
    with pytest.raises(PlanError) as e:
        search(xl_work(fixed=dict(offload_optimizer="none")), machine, default_constants(machine))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("zero.offload_optimizer.device='none' (fixed in the config) leaves no plan that fits")
    assert "without it plan='auto' fits" in message


def test_nothing_fits_names_needs_capacities_and_the_smallest_change():
    machine = gpu(24, 16, disk_gib=500)  # too little host RAM for the offloaded state: disk would fit
    with pytest.raises(PlanError) as e:
        search(xl_work(), machine, default_constants(machine))
    message = str(e.value)
    assert "\n" not in message and "nothing fits" in message
    assert "host RAM 16.0 GiB" in message and "device 24.0 GiB" in message
    assert message.endswith("smallest change that fits: the optimizer state on disk (--set "
                            "zero.offload_optimizer.device=disk --set zero.offload_optimizer.path=/nvme/dir)")
    no_disk = gpu(24, 16)
    with pytest.raises(PlanError) as e:
        search(xl_work(), no_disk, default_constants(no_disk))
    assert "smallest change that fits: more host RAM:" in str(e.value)


def test_a_shorter_sequence_when_one_micro_batch_is_too_much_for_the_device():
    machine = gpu(1.8, 2048)  # the CUDA context, one sequence's activations and the gathered chunks: over 1.62 GiB
    with pytest.raises(PlanError) as e:
        search(xl_work(tokens_per_step=2 * 1024), machine, default_constants(machine))
    assert str(e.value).endswith("smallest change that fits: fewer tokens per micro-batch: SEQ_LEN=512 (1,024 "
                                 "tokens per step)")


def test_a_larger_device_names_the_least_device_any_plan_needs():
    """The unfit are in order of device + host: the first one's device need (2.29 GiB for GPT-2 small over 2 ranks
    on 1 GiB) was named where the least was 1.33 GiB, the figure the same line gave as the least the model needs."""
    from zerogpt_tools.estimate import MODELS

    machine = gpu(1, 64, ranks=2)
    work = xl_work(shape=MODELS["gpt2_small"], tokens_per_step=8 * 1024, world=2)
    with pytest.raises(PlanError) as e:
        search(work, machine, default_constants(machine))
    least = min(evaluate(p, work, machine, default_constants(machine)).need["device"] for p in enumerate_plans(work))
    assert str(e.value).endswith(f"smallest change that fits: a larger device: the least any plan needs is "
                                 f"{least / 2**30:.2f} GiB")
    assert f"needs at least {least / 2**30:.2f} GiB device" in str(e.value)
