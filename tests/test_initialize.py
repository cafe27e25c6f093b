"""initialize(): the optimizer API (DESIGN §3) and the engine's step protocol.

A torch optimizer keeps its class, hyperparameters and param groups (two groups with different
weight_decay train exactly like plain PyTorch at stages 1-3 on 2 ranks) while its state holds only
this rank's shard; dict(type=AdamW | "AdamW", **kwargs) builds the same optimizer; engine.step()
acts only at the accumulation boundary and returns dict(grad_norm, skipped, loss_scale, lr).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zero.reference import (EPS, LR, Recipe, assert_params_close, assert_run_matches, cpu_ctx, engine_run,
                                  reference_run, step_stats)
from tests.zero.recipes import lm_loss, tiny_gpt, token_batches, zero_config

WORLD = 2
BETAS = (0.8, 0.95)
TIES = {"lm_head.weight": "transformer.wte.weight"}  # what a last pipeline stage declares


def two_group_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """GPT-2 practice: decay matrices, not biases/LayerNorm; betas differ from the defaults too."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


TWO_GROUPS = Recipe(build=tiny_gpt, data=token_batches, loss=lm_loss, optimizer=two_group_adamw, steps=6)


def inspect_optimizer(engine, step: int) -> dict:
    """The optimizer as the engine left it: class, groups, and the size of every state tensor."""
    opt = engine.optimizer
    groups = []
    for g, group in enumerate(opt.param_groups):
        states = [s for s in engine.sharded_optim.states.values() if s.group_index == g]
        chunks = [s.chunk for s in states]
        groups.append({
            "hyper": {k: v for k, v in group.items() if k != "params"},
            "chunk_groups": sorted({c.plan.group_index for c in chunks}),
            "param_names": sorted(s.name for c in chunks for s in c.plan.slots),
            "state_numels": [sorted({t.numel() for t in s.state_tensors().values()}) for s in states],
            "shard_numels": [c.plan.shard_numel for c in chunks],
        })
    return {"type": type(opt).__name__, "groups": groups, "chunks": len(engine.chunks),
            "total_numel": sum(c.plan.numel for c in engine.chunks)}


def _two_groups(rank: int, world: int) -> dict:
    return {stage: engine_run(rank, world, TWO_GROUPS, zero_config(stage), inspect=inspect_optimizer)
            for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def two_group_runs() -> list[dict]:
    return run_distributed(_two_groups, WORLD, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_param_groups_train_like_pytorch(two_group_runs, stage):
    assert_run_matches(two_group_runs[0][stage], reference_run(TWO_GROUPS, WORLD, 1), precision="fp32",
                       what=f"two param groups, stage {stage}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_keeps_class_groups_and_holds_only_this_ranks_shard(two_group_runs, stage):
    model = tiny_gpt()
    reference = two_group_adamw(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for rank, runs in enumerate(two_group_runs):
        seen = runs[stage]["inspect"][-1]
        assert seen["type"] == "AdamW"
        assert len(seen["groups"]) == 2
        owned = 0
        for g, (group, ref_group) in enumerate(zip(seen["groups"], reference.param_groups)):
            ref_hyper = {k: v for k, v in ref_group.items() if k != "params"}
            assert group["hyper"] == ref_hyper, f"rank {rank} group {g}: hyperparameters changed"
            assert group["chunk_groups"] == [g], "a chunk mixes optimizer param groups"
            assert group["param_names"] == sorted(names[id(p)] for p in ref_group["params"])
            # Adam m and v exist for exactly this rank's shard of each chunk, nothing more
            assert group["state_numels"] == [[n] for n in group["shard_numels"]], f"rank {rank} group {g}"
            owned += sum(group["shard_numels"])
        assert owned < seen["total_numel"] / WORLD + 64, "state is not sharded 1/N (plus padding)"


# ----------------------------------------------------------------------------------------------
# optimizer as a dict


def _dict_forms(rank: int, world: int) -> dict:
    out = {}
    forms = {"object": adamw_object, "class": adamw_dict_class, "name": adamw_dict_name,
             "hybrid_class": hybrid_adam_dict_class, "hybrid_name": hybrid_adam_dict_name,
             "default_groups": adamw_dict_default_groups, "two_group_object": adamw_two_group_object}
    for form, make in forms.items():
        recipe = Recipe(build=tiny_gpt, data=token_batches, loss=lm_loss, optimizer=make, steps=4)
        out[form] = engine_run(rank, world, recipe, zero_config(2), inspect=inspect_optimizer)
    return out


def adamw_object(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS)


def adamw_dict_class(model):  # no_decay_1d=False: every parameter decays, as the object form
    return dict(type=torch.optim.AdamW, lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS, no_decay_1d=False)


def adamw_dict_name(model):
    return dict(type="AdamW", lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS, no_decay_1d=False)


def hybrid_adam_dict_class(model):  # the seed tutorial's form: optimizer = dict(type=HybridAdam, ...)
    from zerogpt.optim import HybridAdam

    return dict(type=HybridAdam, lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS, no_decay_1d=False)


def hybrid_adam_dict_name(model):
    return dict(type="HybridAdam", lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS, no_decay_1d=False)


def adamw_dict_default_groups(model):  # the default: biases and LayerNorm take no decay
    return dict(type="AdamW", lr=LR, weight_decay=0.1, eps=EPS, betas=BETAS)


def adamw_two_group_object(model):  # the same split as two param groups, the way nanoGPT writes it
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, eps=EPS, betas=BETAS)


@pytest.fixture(scope="module")
def dict_form_runs() -> dict:
    return run_distributed(_dict_forms, WORLD, timeout=280)[0]


@pytest.mark.timeout(300)
def test_optimizer_dict_forms_build_the_same_optimizer(dict_form_runs):
    runs = dict_form_runs
    for form in ("class", "name"):
        assert runs[form]["inspect"][-1]["type"] == "AdamW"
        assert runs[form]["inspect"][-1]["groups"][0]["hyper"] == runs["object"]["inspect"][-1]["groups"][0]["hyper"]
        assert runs[form]["losses"] == runs["object"]["losses"], form  # bit for bit: the same computation
        for k, v in runs["object"]["params"].items():
            assert torch.equal(runs[form]["params"][k], v), (form, k)
    for form in ("hybrid_class", "hybrid_name"):  # the fused CPU AdamW: the same update, other rounding
        assert runs[form]["inspect"][-1]["type"] == "HybridAdam"
        torch.testing.assert_close(torch.tensor(runs[form]["losses"]), torch.tensor(runs["object"]["losses"]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{form}: {m}")
        assert_params_close(runs[form]["params"], runs["object"]["params"], 1e-5, 1e-4, form)


@pytest.mark.timeout(300)
def test_default_decay_groups_skip_1d_params_in_large_chunks(dict_form_runs):
    """dict(type=..., weight_decay=w) decays only the >= 2-D weights, exactly as two param groups would, but
    keeps the chunks of one group: weights, biases and norms alternate, and two groups would cut a chunk at
    each switch."""
    runs = dict_form_runs
    default, two_groups, every = runs["default_groups"], runs["two_group_object"], runs["object"]
    assert default["losses"] == two_groups["losses"]  # bit for bit: elementwise the same update
    for k, v in two_groups["params"].items():
        assert torch.equal(default["params"][k], v), k
    assert any(not torch.equal(default["params"][k], v) for k, v in every["params"].items() if v.dim() < 2), \
        "decaying the 1-D parameters too must change them"
    assert default["inspect"][-1]["chunks"] == every["inspect"][-1]["chunks"], "decay groups split chunks"
    assert two_groups["inspect"][-1]["chunks"] > default["inspect"][-1]["chunks"], \
        (two_groups["inspect"][-1]["chunks"], default["inspect"][-1]["chunks"])


# ----------------------------------------------------------------------------------------------
# step protocol


def _protocol(rank: int, world: int) -> dict:
    import zerogpt

    torch.set_num_threads(1)
    accum = 3
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = [1, 2, 3]
    # the Colossal-AI tutorial's call: the dataloaders and the scheduler come back unchanged
    engine, train_dl, eval_dl, sched = zerogpt.colossalai_initialize(
        model, opt, None, loader, lr_scheduler=scheduler,
        config=dict(zero=dict(stage=3), GRADIENT_ACCUMULATION=accum), ctx=cpu_ctx(rank, world))
    passed_through = engine.optimizer is opt and sched is scheduler and train_dl is loader and eval_dl is None
    data = token_batches(2, world, accum)
    returned, shard_changed = [], []
    for step in range(2):
        for j in range(accum):
            before = [c.shard.clone() for c in engine.chunks]
            engine.backward(lm_loss(engine, data[step, j, rank], step))
            out = step_stats(engine, engine.step())
            engine.zero_grad()
            returned.append(out)
            shard_changed.append(any(not torch.equal(a, c.shard) for a, c in zip(before, engine.chunks)))
            if out:
                scheduler.step()
    engine.close()
    return {"passed_through": passed_through, "returned": returned, "changed": shard_changed}


@pytest.mark.timeout(200)
def test_step_acts_only_at_the_accumulation_boundary():
    for rank, run in enumerate(run_distributed(_protocol, WORLD, timeout=180)):
        assert run["passed_through"], "initialize must return the same optimizer, dataloader and scheduler"
        assert [bool(r) for r in run["returned"]] == [False, False, True] * 2
        assert run["changed"] == [False, False, True] * 2, f"rank {rank}: params moved off the boundary"
        stats = [r for r in run["returned"] if r]
        assert all(set(s) == {"grad_norm", "skipped", "loss_scale", "lr"} for s in stats)
        assert [s["lr"] for s in stats] == [LR, LR / 2]  # the scheduler bound to the user's optimizer acts
        assert all(s["skipped"] is False and s["loss_scale"] == 1.0 and s["grad_norm"] > 0 for s in stats)


# ----------------------------------------------------------------------------------------------
# one build: the config is resolved into one plan, and the engine is complete when initialize returns


def _decision_names() -> frozenset[str]:
    """The names a build decision travels under: the engine plan's fields and the engine config sections' fields.
    Not `device` (the context's device, passed everywhere) nor `chunks` (the built chunks, passed everywhere)."""
    import dataclasses

    from zerogpt.config import EngineConfig, HostConfig, ZeroConfig
    from zerogpt.config.schema import LossScaleConfig, OptimizerOffloadConfig, ParamOffloadConfig
    from zerogpt.planner.engine_plan import EnginePlan

    sections = (EnginePlan, EngineConfig, ZeroConfig, OptimizerOffloadConfig, ParamOffloadConfig, HostConfig,
                LossScaleConfig)
    return frozenset({f.name for c in sections for f in dataclasses.fields(c)} | {"config", "plan"}) - {"device",
                                                                                                       "chunks"}


def _follow_the_config(run) -> tuple[list[str], list[str]]:
    """Two paths through the zerogpt files while `run()` (an initialize) runs, each in call order with consecutive
    repeats merged.

    - the driver's: the files build_engine.py's own code calls into;
    - the config's: the files whose functions are handed the config (the run Config, a typed section of it, a
      ShardStrategy), the engine plan, or one of its decisions by name (`_decision_names`): every file that reads a
      decision derived from the config, however deep. A config class's own methods (its `self`) are the schema
      reading itself and do not count; build_engine.py is the driver the path starts from (reading its steps in
      order is reading on, not returning).
    A return is a stop at a file the path had already left: a decision read in one file, then another, then the
    first again.
    """
    import os
    import sys

    import zerogpt
    from zerogpt.config.strategy import ShardStrategy
    from zerogpt.planner.engine_plan import EnginePlan

    root, names = os.path.dirname(zerogpt.__file__), _decision_names()
    config_modules = ("zerogpt.config.",)
    driver, followed = [], []

    def is_config(value) -> bool:
        return isinstance(value, (EnginePlan, ShardStrategy)) or type(value).__module__.startswith(config_modules)

    def stop(path: list[str], filename: str) -> None:
        rel = os.path.relpath(filename, root)
        if not path or path[-1] != rel:
            path.append(rel)

    def profile(frame, event, arg):
        callee = frame.f_code.co_filename
        if event != "call" or not callee.startswith(root):
            return
        caller = frame.f_back and frame.f_back.f_code.co_filename
        if (caller or "").endswith("build_engine.py") and callee != caller:
            stop(driver, callee)
        code = frame.f_code
        args = [a for a in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] if a not in ("self", "cls")]
        if not callee.endswith("build_engine.py") and (names.intersection(args)
                                                       or any(is_config(frame.f_locals.get(a)) for a in args)):
            stop(followed, callee)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return driver, followed


def _returns(path: list[str]) -> list[str]:
    return [f for i, f in enumerate(path) if f in path[:i]]


@pytest.mark.parametrize("zero, precision, accumulation", [
    (dict(stage=3, offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu")), "bf16", 1),
    (dict(stage=2, offload_optimizer=dict(device="cpu")), "bf16", 2),
    (dict(stage=0), "fp32", 1),
], ids=["stage3-full-offload", "stage2-optimizer-offload", "stage0"])
def test_following_the_config_through_the_build_returns_to_a_file_fewer_than_5_times(zero, precision,
                                                                                      accumulation):
    """Issue 47.7: the planner (planner/engine_plan.py) makes the decisions, initialize executes them. Before the
    plan moved there (0039d31), the config's path returned 5 times in each case (config/load.py, config/schema.py
    twice, zero/chunk.py, amp.py); the driver's path 3 times (zero/chunk.py, amp.py, host_memory.py). Now 3
    (config/load.py and config/schema.py: the schema building its sections; amp.py: the dtype planned, the fp16
    loss scaler built) and 1 (host_memory.py: the malloc setting applied, then the build's garbage released)."""
    import zerogpt
    from zerogpt.parallel import ParallelModel

    cfg = zerogpt.Config(dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=accumulation))
    engines = []
    model = tiny_gpt()
    driver, followed = _follow_the_config(lambda: engines.append(zerogpt.initialize(
        ParallelModel(model), torch.optim.AdamW(model.parameters()), config=cfg, ctx=cpu_ctx())))
    engines[0].close()
    assert "planner/engine_plan.py" in followed and "zero/sharded_optim.py" in followed  # the path is followed
    assert len(_returns(followed)) < 5, followed
    assert len(_returns(driver)) < 5, driver


def test_the_engine_is_complete_when_built(tmp_path):
    """Every field the checkpoints and the Trainer read is declared by initialize."""
    import zerogpt
    from zerogpt.parallel import ParallelModel

    cfg = zerogpt.Config(dict(zero=dict(stage=3, offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu")),
                              precision="bf16"))
    model = tiny_gpt()
    engine = zerogpt.initialize(ParallelModel(model, tied_copies=TIES), torch.optim.AdamW(model.parameters()),
                                config=cfg, ctx=cpu_ctx())
    assert engine.tied_copies == TIES and engine.param_layouts == {} and engine.criterion is None
    assert engine.transport is None and engine.run_config is cfg
    with engine.loss_context():
        pass
    engine.close()
