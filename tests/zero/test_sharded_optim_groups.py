"""zero/sharded_optim.py's chunk optimizers read their hyperparameters from the user's param group in place:
nothing is copied, an LR scheduler's change is seen at once, and a chunk that decays slot by slot steps with
weight_decay 0 without touching the user's group (CPUAdam: with the ranges that decay, for its own pass). No process group, no engine."""
from __future__ import annotations

import torch

from zerogpt.optim import CPUAdam
from zerogpt.zero.sharded_optim import chunk_optimizer


def _users_optimizer(cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, weight_decay=0.1, **kwargs)


def test_the_chunk_group_reads_the_users_group_in_place():
    user = _users_optimizer()
    group = user.param_groups[0]
    master = torch.randn(5)
    chunk = chunk_optimizer(user, group, master)
    view = chunk.param_groups[0]
    assert view["params"][0] is master and all(p is not master for p in group["params"])
    # its tensor and its bf16 moments' rounding seed; no hyperparameter of its own: every one is the user's
    assert set(view.maps[0]) == {"params", "rounding_seed"}
    group["lr"] = 0.5  # as an LR scheduler sets it
    assert view["lr"] == 0.5 and dict(view)["lr"] == 0.5


def test_a_chunk_that_decays_per_slot_steps_with_zero_decay_and_leaves_the_users_group_alone():
    user = _users_optimizer()
    group = user.param_groups[0]
    master = torch.randn(5)
    chunk = chunk_optimizer(user, group, master, decay_ranges=[(1, 3)])
    assert chunk.param_groups[0]["weight_decay"] == 0.0 and group["weight_decay"] == 0.1


def test_a_cpu_adam_chunk_that_decays_per_slot_is_given_the_ranges_and_the_users_decay():
    user = _users_optimizer(CPUAdam)
    group = user.param_groups[0]
    chunk = chunk_optimizer(user, group, torch.randn(5), decay_ranges=[(1, 3)])
    assert chunk.param_groups[0]["weight_decay"] == 0.1 and chunk.param_groups[0]["decay_ranges"] == [(1, 3)]
    assert "decay_ranges" not in group


def test_a_step_through_the_view_equals_a_step_of_the_users_class():
    torch.manual_seed(0)
    user = _users_optimizer(betas=(0.8, 0.9))
    group = user.param_groups[0]
    master = torch.randn(7)
    reference = torch.nn.Parameter(master.clone())
    chunk = chunk_optimizer(user, group, master)
    plain = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9))
    for step in range(3):
        group["lr"] = plain.param_groups[0]["lr"] = 1e-3 * (step + 1)  # changed between steps, as a schedule does
        grad = torch.randn(7)
        master.grad, reference.grad = grad.clone(), grad.clone()
        chunk.step()
        plain.step()
    assert torch.equal(master, reference.detach())


def test_a_cpu_adam_chunk_keeps_the_users_kernel_choice():
    """A kernel left to "auto" lets each chunk's step fuse the compute copy into the update (fp32 moments too);
    a named one is kept named. The chunk gets the resolved kernel, so it must not read that as a choice."""
    auto, named = _users_optimizer(CPUAdam), _users_optimizer(CPUAdam, backend="torch")
    for user in (auto, named):
        chunk = chunk_optimizer(user, user.param_groups[0], torch.randn(5))
        assert chunk.backend == user.backend and chunk.fuses_copies == user.fuses_copies
    assert auto.fuses_copies and not named.fuses_copies
