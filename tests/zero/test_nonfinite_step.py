"""A bf16/fp32 step whose gradient is not finite is skipped on the device (issue 31.4).

One NaN gradient is injected on one rank mid-run (it reaches every rank through the reduction). The weights and
the optimizer state after that step equal those before it, bit for bit, at every stage, with and without offload,
for each way a chunk's step can skip: CPUAdam/HybridAdam's kernel (DeepSpeed or torch) and torch's fused optimizers
take the flag on the device (`found_inf`); any other optimizer has it read on the host once per step. The run then
goes on training, and the engine counts the skipped step on the device.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero.gpu_plan import device_master
from tests.zero.recipes import lm_loss, tiny_gpt, token_batches, zero_config
from tests.zero.reference import cpu_ctx

BAD = 2          # the 0-based step whose gradient is NaN
STEPS = 4


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    from zerogpt.optim import HybridAdam

    return HybridAdam(params, lr=1e-2, weight_decay=0.1, backend=kind.split("_")[1])


def _local_state(engine) -> list[torch.Tensor]:
    """This rank's masters and every optimizer state tensor (step counts included), copied."""
    out = []
    for index, state in sorted(engine.sharded_optim.states.items()):
        out.append(state.master.detach().clone())
        out += [v.detach().clone().reshape(-1) for _, v in sorted(state.state.items()) if isinstance(v, torch.Tensor)]
    return out


def _train_with_one_nan(rank: int, world: int, cases: list[dict], disk: str) -> list[dict]:
    torch.set_num_threads(1)
    data = token_batches(STEPS, world, 1)
    results = []
    for case in cases:
        with device_master() if case.get("device_master") else contextlib.nullcontext():
            results.append(_one_case(case, rank, world, data, disk))
    return results


def _one_case(case: dict, rank: int, world: int, data: torch.Tensor, disk: str) -> dict:
    import zerogpt

    model = tiny_gpt()
    zero = dict(zero_config(case["stage"]), **case.get("offload", {}))
    if zero.get("offload_optimizer", {}).get("device") == "disk":
        zero["offload_optimizer"] = dict(device="disk", path=disk)
    cfg = zerogpt.Config(dict(zero=zero, precision=case["precision"], clip_grad_norm=case.get("clip")))
    engine = zerogpt.initialize(model, _optimizer(case["optimizer"], model), config=cfg, ctx=cpu_ctx(rank, world))
    states, weights, counted = [], [], torch.zeros(())
    for step in range(STEPS):
        loss = lm_loss(engine, data[step, 0, rank], step)
        if step == case["bad"] and rank == 0:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        counted += engine.last_step_found_inf
        states.append(_local_state(engine))
        weights.append(engine.state_dict_full())   # consolidated on rank 0 ({} on rank 1)
    engine.close()
    bad = case["bad"]
    same = [torch.equal(a, b) for a, b in zip(states[bad - 1], states[bad])]
    return dict(
        case=case, same_state=same,
        same_weights=all(torch.equal(weights[bad - 1][k], weights[bad][k]) for k in weights[bad]),
        finite_after=all(torch.isfinite(w).all().item() for w in weights[-1].values() if w.is_floating_point()),
        moved_after=rank != 0 or any(not torch.equal(weights[bad][k], weights[-1][k]) for k in weights[-1]),
        skipped=counted.item())


CASES = [dict(stage=s, precision=p, optimizer=o, bad=BAD, offload=off)
         for s, p, o, off in [
             (0, "fp32", "adamw", {}),
             (1, "bf16", "adamw_fused", {}),
             (2, "fp32", "adamw", dict(offload_optimizer=dict(device="cpu"))),
             (2, "bf16", "hybrid_deepspeed", dict(offload_optimizer=dict(device="cpu"))),
             (3, "fp32", "hybrid_torch", dict(offload_optimizer=dict(device="cpu"),
                                              offload_param=dict(device="cpu"))),
             (3, "bf16", "adamw", {}),
             (1, "fp32", "sgd", {}),
             (2, "fp32", "hybrid_deepspeed", dict(offload_optimizer=dict(device="disk"))),
         ]]
# HybridAdam over a master on the device (no optimizer offload), as a GPU run steps it: its flag is the step's
# argument (it was once handed over as torch's fused-kernel attribute, which HybridAdam never reads: not skipped)
CASES.append(dict(stage=1, precision="bf16", optimizer="hybrid_torch", bad=BAD, offload={}, device_master=True))
CASES[0]["clip"] = 1.0   # clipping by a non-finite norm: still skipped


@pytest.mark.timeout(180)
def test_a_nan_gradient_skips_the_step_bit_for_bit_and_training_goes_on(tmp_path):
    results = run_distributed(_train_with_one_nan, 2, CASES, str(tmp_path), timeout=170)
    for rank_results in results:
        for r in rank_results:
            what = r["case"]
            assert all(r["same_state"]), (what, r["same_state"])   # masters, moments, step counts
            assert r["same_weights"], what
            assert r["finite_after"] and r["moved_after"], what     # the run goes on training
            assert r["skipped"] == 1, what


def _first_step_nan(rank: int, world: int) -> dict:
    """A NaN on the very first step, before the optimizer has any state: it is left as never stepped."""
    import zerogpt

    torch.set_num_threads(1)
    data = token_batches(2, world, 1)
    out = {}
    for kind in ("adamw", "sgd"):
        model = tiny_gpt()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        engine = zerogpt.initialize(model, _optimizer(kind, model), config=zerogpt.Config(dict(zero=dict(stage=2))),
                                    ctx=cpu_ctx(rank, world))
        engine.backward(lm_loss(engine, data[0, 0, rank], 0) * (float("nan") if rank == 1 else 1.0))
        engine.step()
        engine.zero_grad()
        full = engine.state_dict_full()
        untouched = all(torch.equal(full[k], start[k]) for k in full)
        fresh = all(not v.any() for s in engine.sharded_optim.states.values() for v in s.state.values()
                    if isinstance(v, torch.Tensor))
        engine.backward(lm_loss(engine, data[1, 0, rank], 1))
        engine.step()
        full = engine.state_dict_full()
        engine.close()
        out[kind] = dict(untouched=untouched, fresh=fresh,
                         finite=all(torch.isfinite(v).all().item() for v in full.values()))
    return out


@pytest.mark.timeout(120)
def test_a_nan_on_the_first_step_leaves_the_optimizer_as_never_stepped():
    for result in run_distributed(_first_step_nan, 2, timeout=110):
        for kind, r in result.items():
            assert r["untouched"] and r["fresh"] and r["finite"], (kind, r)


def test_a_gpu_run_steps_torch_optimizers_fused_unless_the_user_chose():
    """What makes the skip free of host syncs on a GPU: torch's Adam/AdamW/SGD with the implementation left to
    torch get the fused kernel (it takes found_inf); an explicit choice, the CPU, or offloaded state keep theirs.
    The plan decides (planner/engine_plan.py), the build applies it to the groups that left the choice."""
    from types import SimpleNamespace

    from tests.planner.engine_plans import plan_for
    from zerogpt.build_engine import _step_fused

    def fused(kind, device="cuda", home="none", **kwargs):
        opt = kind([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, **kwargs)
        plan = plan_for(dict(stage=2, offload_optimizer=dict(device=home)), optimizer_type=kind,
                        ctx=SimpleNamespace(device=torch.device(device), dp_size=1, dp_group=None))
        if plan.fused_device_step:
            _step_fused(opt)
        return opt.param_groups[0]["fused"]

    assert fused(torch.optim.AdamW) is True and fused(torch.optim.Adam) is True and fused(torch.optim.SGD) is True
    assert fused(torch.optim.AdamW, device="cpu") is None and fused(torch.optim.AdamW, home="cpu") is None
    assert fused(torch.optim.AdamW, foreach=True) is None and fused(torch.optim.AdamW, fused=False) is False
