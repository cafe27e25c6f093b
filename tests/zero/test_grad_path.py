"""zero/grad_path.py: a step's first reduced gradient shard is upcast into the fp32 grad shard in one pass, not added
to a zero-filled one (issue 46.2: 8 bytes/param of a bf16 step's traffic), on the way to the step and in the
device-side sum over micro-steps; the sums stay plain PyTorch's."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.zero.gpu_plan import planned
from tests.zero.recipes import GPT_RECIPE, zero_config
from tests.zero.reference import assert_run_matches, engine_run, reference_run, run_under, single_thread


class Fp32Writes(TorchDispatchMode):
    """Ops whose fp32 result is at least `numel` long: the passes that make or fill a chunk's grad shard."""

    def __init__(self):
        super().__init__()
        self.numel, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= self.numel \
                and func not in (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor):
            self.ops[func.overloadpacket.__name__] += 1
        return out


def counted_run(zero: dict, **kwargs) -> dict:
    """`engine_run` of GPT_RECIPE with each step's backward under Fp32Writes over the largest chunk's shard."""
    writes = Fp32Writes()

    def setup(engine) -> None:
        writes.numel = max(s.master.numel() for s in engine.sharded_optim.states.values())
        run_under(engine, "backward", writes)

    def inspect(engine, step: int) -> dict:
        seen = dict(writes.ops)
        writes.ops.clear()
        return seen

    return engine_run(0, 1, GPT_RECIPE, zero, setup=setup, inspect=inspect, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_the_first_bf16_shard_is_upcast_once(stage):
    with single_thread():
        run = counted_run(zero_config(stage), precision="bf16")
    for seen in run["inspect"]:
        assert "zeros" not in seen and "add_" not in seen, f"stage {stage}: zeros then an add: {seen}"
        assert seen.get("_to_copy", 0) >= 1, f"stage {stage}: no upcast of the largest shard: {seen}"
    assert_run_matches(run, reference_run(GPT_RECIPE, 1, 1), precision="bf16", what=f"stage {stage}")


@pytest.mark.timeout(120)
def test_the_device_sum_over_micro_steps_starts_from_a_copy():
    accum = 3
    zero = dict(zero_config(2), offload_optimizer=dict(device="cpu"))
    with single_thread(), planned(accumulate_on_device=True):
        run = counted_run(zero, accum=accum)
    assert run["inspect"], "no step"
    for seen in run["inspect"]:  # over a step's micro-steps, largest chunk: one copy, then an add per micro-step
        assert "zeros" not in seen and seen.get("add_", 0) >= accum - 1, seen
    assert_run_matches(run, reference_run(GPT_RECIPE, 1, accum), precision="fp32", what="summed on the device")
