"""build_lr_scheduler: warmup, cosine / linear decay to min_lr, constant, per-group floors, resume."""
import math

import pytest
import torch

from zerogpt.config import LRSchedulerConfig
from zerogpt.optim import build_lr_scheduler


def make_opt(*lrs: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs], lr=lrs[0])


def lrs_over(sched, opt, steps: int, group: int = 0) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[group]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_min_lr():
    opt = make_opt(1.0)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(type="cosine", warmup_steps=4, min_lr=0.1), total_steps=14)
    lrs = lrs_over(sched, opt, 20)
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # (s + 1) / (warmup + 1): starts near 0, never 0
    assert lrs[4] == pytest.approx(1.0)  # peak right after warmup
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone decay
    assert lrs[14:] == pytest.approx([0.1] * 6)  # floor at total_steps and after


def test_linear_decay_and_config_total_steps_wins():
    opt = make_opt(2.0)
    cfg = LRSchedulerConfig(type="linear", warmup_steps=0, min_lr=0.0, total_steps=4)
    sched = build_lr_scheduler(opt, cfg, total_steps=1000)
    assert lrs_over(sched, opt, 6) == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0, 0.0])


def test_constant_with_warmup_and_without():
    opt = make_opt(0.5)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(type="constant", warmup_steps=1, min_lr=0.1), None)
    assert lrs_over(sched, opt, 4) == pytest.approx([0.25, 0.5, 0.5, 0.5])
    opt = make_opt(0.5)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(), None)
    assert lrs_over(sched, opt, 3) == pytest.approx([0.5] * 3)


def test_min_lr_scales_per_group():
    """min_lr is an absolute floor for group 0; other groups keep their ratio to their own base lr."""
    opt = make_opt(1e-3, 1e-4)
    sched = build_lr_scheduler(opt, LRSchedulerConfig(type="cosine", min_lr=1e-4), total_steps=5)
    lrs_over(sched, opt, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-5)


def test_state_dict_round_trip():
    cfg = LRSchedulerConfig(type="cosine", warmup_steps=3, min_lr=0.01)
    opt_a = make_opt(1.0)
    a = build_lr_scheduler(opt_a, cfg, total_steps=20)
    lrs_over(a, opt_a, 7)
    opt_b = make_opt(1.0)
    b = build_lr_scheduler(opt_b, LRSchedulerConfig(type="linear"), total_steps=5)  # overwritten by the load
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    assert lrs_over(b, opt_b, 15) == pytest.approx(lrs_over(a, opt_a, 15))


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="max_steps"):
        build_lr_scheduler(make_opt(1.0), LRSchedulerConfig(type="cosine"), total_steps=None)
    with pytest.raises(ValueError, match="min_lr"):
        build_lr_scheduler(make_opt(1e-4), LRSchedulerConfig(type="cosine", min_lr=1e-3), total_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        build_lr_scheduler(make_opt(1.0), LRSchedulerConfig(type="linear", warmup_steps=10), total_steps=5)
    with pytest.raises(ValueError, match="did you mean 'cosine'"):  # the section checks its own values
        LRSchedulerConfig(type="cos")
