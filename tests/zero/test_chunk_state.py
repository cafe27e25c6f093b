"""zero/chunk_state.py: a chunk's step on the device. torch's fused kernel (a torch fused optimizer's, or HybridAdam's
over a device master) takes the clip factor as its grad_scale, so the gradient gets no pass of its own (issue 46.2),
except where L2 decay of some ranges was added to the gradient first; both give plain PyTorch's clipped step."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.zero.gpu_plan import device_master
from tests.zero.recipes import CLIP, lm_loss, tiny_gpt, token_batches, zero_config
from tests.zero.reference import LR, Recipe, assert_run_matches, engine_run, reference_run, run_under, single_thread


def two_groups(kind: type, model: torch.nn.Module) -> torch.optim.Optimizer:
    """What the engine's optimizer dict does to decay (no_decay_1d): the matrices decay, biases and norms not."""
    params = list(model.parameters())
    return kind([dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.1),
                 dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)], lr=LR, fused=True)


def adamw_dict(model: torch.nn.Module) -> dict:
    return dict(type="AdamW", lr=LR, weight_decay=0.1, fused=True)


def adam_l2_dict(model: torch.nn.Module) -> dict:
    return dict(type="Adam", lr=LR, weight_decay=0.1, fused=True)


def hybrid_adam_dict(model: torch.nn.Module) -> dict:
    from zerogpt.optim import HybridAdam

    return dict(type=HybridAdam, lr=LR, weight_decay=0.1)


def adamw_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    return two_groups(torch.optim.AdamW, model)


def adam_l2_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    return two_groups(torch.optim.Adam, model)


def recipe(optimizer) -> Recipe:
    return Recipe(build=tiny_gpt, data=token_batches, loss=lm_loss, optimizer=optimizer, steps=4)


class GradientPasses(TorchDispatchMode):
    """Counts in-place multiplies of whole tensors: the clip's own pass over a chunk's gradient."""

    def __init__(self):
        super().__init__()
        self.muls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mul_.Tensor and args[0].numel() > 1:
            self.muls[args[0].numel()] += 1
        return func(*args, **(kwargs or {}))


def clipped_run(optimizer, stage: int) -> dict:
    """`engine_run` of a clipped recipe with this optimizer, each step's whole-tensor multiplies counted."""
    passes = GradientPasses()
    return engine_run(0, 1, recipe(optimizer), zero_config(stage), clip=CLIP,
                      setup=lambda engine: run_under(engine, "step", passes),
                      inspect=lambda engine, step: dict(passes.muls))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_torchs_fused_kernel_takes_the_clip_factor_and_the_step_is_torchs(stage):
    with single_thread():
        run = clipped_run(adamw_dict, stage)
    assert all(seen == {} for seen in run["inspect"]), f"the gradient had a pass of its own: {run['inspect']}"
    assert_run_matches(run, reference_run(recipe(adamw_groups), 1, 1, CLIP), precision="fp32", what=f"stage {stage}")


@pytest.mark.timeout(120)
def test_l2_decay_of_some_ranges_keeps_the_clip_pass():
    with single_thread():
        run = clipped_run(adam_l2_dict, 2)
    assert all(seen for seen in run["inspect"]), "the clip factor went to a kernel that divides the L2 term too"
    assert_run_matches(run, reference_run(recipe(adam_l2_groups), 1, 1, CLIP), precision="fp32",
                       what="Adam, L2 on matrices")


@pytest.mark.timeout(120)
def test_hybrid_adam_over_a_device_master_takes_the_clip_factor_too():
    """The route a GPU run's HybridAdam takes without optimizer offload (not its host step), on this CPU: the factor
    is its step's `unscale` (tests/optim/test_cpu_adam.py: torch's kernel divides by it), no pass of its own."""
    with single_thread(), device_master():
        run = clipped_run(hybrid_adam_dict, 1)
    assert all(seen == {} for seen in run["inspect"]), f"the gradient had a pass of its own: {run['inspect']}"
    assert_run_matches(run, reference_run(recipe(adamw_groups), 1, 1, CLIP), precision="fp32", what="HybridAdam")
