"""amp.py and the fp16 path through the engine: the dynamic loss scaler's schedule, its config keys,
and forced overflows on 2 gloo ranks.

An inf injected on ONE rank on chosen steps - into its loss (every gradient inf/nan), or into one
element of its gradient that after the reduce-scatter lands in another rank's shard only - must
skip exactly those steps on ALL ranks (one all-reduce carries the overflow flag), leave the
parameters untouched on those steps, back the scale off per hysteresis (default: start 2**16, x0.5
after 2 overflows, x2 after 1000 clean steps) and log each skipped step with the new scale. The
other steps train like plain PyTorch that skips the same steps (fp16 tolerance).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.zero.reference import cpu_ctx, single_thread, step_stats
from tests.zero.recipes import GPT_RECIPE
from zerogpt.amp import DynamicLossScaler
from zerogpt.config import LossScaleConfig

WORLD = 2
STEPS = 8
OVERFLOW_STEPS = (2, 3, 6)  # two consecutive (the second backs off), then one more (hysteresis again)
INFECTED_RANK = 1


# ----------------------------------------------------------------------------------------------
# the scaler alone


def test_scaler_defaults_and_hysteresis():
    s = DynamicLossScaler(LossScaleConfig())
    assert s.scale == 2.0**16
    s.update(True)
    assert s.scale == 2.0**16  # first overflow absorbed by hysteresis=2
    s.update(True)
    assert s.scale == 2.0**15  # second overflow backs off by 0.5
    s.update(True)
    assert s.scale == 2.0**15  # hysteresis re-armed after a back-off
    for _ in range(999):
        s.update(False)
    assert s.scale == 2.0**15
    s.update(False)
    assert s.scale == 2.0**16  # x2 after growth_interval=1000 clean steps


def test_scaler_bounds_and_disabled():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=4.0, hysteresis=1, min_scale=2.0, growth_interval=1,
                                          max_scale=8.0))
    for _ in range(3):
        s.update(True)
    assert s.scale == 2.0
    for _ in range(5):
        s.update(False)
    assert s.scale == 8.0
    off = DynamicLossScaler(LossScaleConfig(), enabled=False)
    off.update(True)
    assert off.scale == 1.0


def test_scaler_state_round_trip():
    s = DynamicLossScaler(LossScaleConfig())
    s.update(True)
    t = DynamicLossScaler(LossScaleConfig())
    t.load_state_dict(s.state_dict())
    t.update(True)
    assert t.scale == 2.0**15


@pytest.mark.parametrize("zero", [
    dict(stage=2, loss_scale=dict(initial_scale=1024.0, hysteresis=1, backoff_factor=0.25, growth_interval=7)),
    dict(optimizer_config=dict(initial_scale=1024.0, hysteresis=1, backoff_factor=0.25, growth_interval=7)),
], ids=["zero.loss_scale", "zero.optimizer_config"])
def test_loss_scale_config_keys_reach_the_engine(zero):
    import zerogpt

    model = torch.nn.Linear(4, 4)
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()),
                                config=dict(zero=zero, precision="fp16"), ctx=cpu_ctx())
    scaler = engine.sharded_optim.loss_scaler
    c = scaler.config
    assert (scaler.scale, c.hysteresis, c.backoff_factor, c.growth_interval) == (1024.0, 1, 0.25, 7)
    engine.close()


def test_loss_scale_is_one_without_fp16():
    import zerogpt

    model = torch.nn.Linear(4, 4)
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=dict(precision="bf16"),
                                ctx=cpu_ctx())
    assert engine.loss_scale == 1.0
    engine.close()


# ----------------------------------------------------------------------------------------------
# forced overflow on one rank


class _ListLogger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def info(self, msg: str) -> None:
        pass

    def warning(self, msg: str) -> None:
        self.warnings.append(msg)


def _local_state(engine) -> list[torch.Tensor]:
    """This rank's fp32 master shards and compute-dtype param shards (what a step would change)."""
    masters = [s.master for s in engine.sharded_optim.states.values()]
    return [t.clone() for t in masters + [c.shard for c in engine.chunks]]


def _poison_grad_on(steps: tuple[int, ...], state: dict):
    """A tensor hook for rank INFECTED_RANK's wte gradient: inf in element [0, 0] on `steps`' last micro-step.

    Offset 0 of chunk 0 lies in rank 0's shard, so after the reduce-scatter (stages 1-3) only rank 0's
    local gradient shard holds the inf: the other ranks learn of the overflow only through the flag
    all-reduce, which is what this injection tests.
    """
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if state["step"] in steps and state["last_micro"]:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad
    return hook


def _fp16_run(rank: int, world: int, stage: int, accum: int, overflow_steps: tuple[int, ...],
              where: str = "loss") -> dict:
    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    torch.set_num_threads(1)
    logger = _ListLogger()
    ctx = cpu_ctx(rank, world, logger)
    model = GPT_RECIPE.build()
    cfg = zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02)),
                              precision="fp16", GRADIENT_ACCUMULATION=accum))
    engine = zerogpt.initialize(model, GPT_RECIPE.optimizer(model), config=cfg, ctx=ctx)
    position = {"step": -1, "last_micro": False}
    if where == "grad" and rank == INFECTED_RANK:
        model.transformer.wte.weight.register_hook(_poison_grad_on(overflow_steps, position))
    data = GPT_RECIPE.data(STEPS, world, accum)
    stats, changed, losses = [], [], []
    for step in range(STEPS):
        before = _local_state(engine)
        step_loss = torch.zeros(())
        for j in range(accum):
            position.update(step=step, last_micro=j == accum - 1)
            loss = GPT_RECIPE.loss(engine, data[step, j, rank], step)
            step_loss += loss.detach().float() / accum
            if where == "loss" and step in overflow_steps and rank == INFECTED_RANK and j == accum - 1:
                loss = loss * float("inf")  # inf/nan gradients on this rank only
            engine.backward(loss)
            out = step_stats(engine, engine.step())
            engine.zero_grad()
        stats.append(out)
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, _local_state(engine))))
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    params = engine.state_dict_full()
    engine.close()
    return {"stats": stats, "changed": changed, "warnings": logger.warnings, "losses": losses, "params": params}


def _reference_skipping(steps_skipped: tuple[int, ...], accum: int) -> tuple[list[float], dict]:
    """Plain fp32 PyTorch on the global batch that does no optimizer step on `steps_skipped`."""
    with single_thread():
        model = GPT_RECIPE.build()
        opt = GPT_RECIPE.optimizer(model)
        data = GPT_RECIPE.data(STEPS, WORLD, accum)
        losses = []
        for step in range(STEPS):
            micro = [data[step, j, r] for j in range(accum) for r in range(WORLD)]
            total = sum(GPT_RECIPE.loss(model, m, step) for m in micro) / len(micro)
            total.backward()
            if step not in steps_skipped:
                opt.step()
            opt.zero_grad()
            losses.append(total.item())
    return losses, model.state_dict()


def _every_stage(rank: int, world: int) -> dict:
    out = {}
    for stage, accum in [(0, 1), (1, 2), (2, 1), (3, 2)]:
        out[(stage, accum, "clean")] = _fp16_run(rank, world, stage, accum, ())
        for where in INJECT:
            out[(stage, accum, where)] = _fp16_run(rank, world, stage, accum, OVERFLOW_STEPS, where)
    return out


@pytest.fixture(scope="module")
def fp16_runs() -> list[dict]:
    return run_distributed(_every_stage, WORLD, timeout=280)


SETTINGS = [(0, 1), (1, 2), (2, 1), (3, 2)]
INJECT = ("loss", "grad")  # inf * loss on one rank (every element inf/nan), or one inf gradient element


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,accum", SETTINGS)
@pytest.mark.parametrize("where", INJECT)
def test_overflow_on_one_rank_skips_that_step_on_all_ranks(fp16_runs, stage, accum, where):
    for rank, runs in enumerate(fp16_runs):
        clean, hit = runs[(stage, accum, "clean")], runs[(stage, accum, where)]
        assert [s["skipped"] for s in clean["stats"]] == [False] * STEPS, "no natural overflow in the control run"
        assert [s["skipped"] for s in hit["stats"]] == [s in OVERFLOW_STEPS for s in range(STEPS)], f"rank {rank}"
        assert hit["changed"] == [s not in OVERFLOW_STEPS for s in range(STEPS)], \
            f"rank {rank}: params must be unchanged exactly on the skipped steps"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,accum", SETTINGS)
@pytest.mark.parametrize("where", INJECT)
def test_loss_scale_backs_off_with_hysteresis_and_is_logged(fp16_runs, stage, accum, where):
    hi, lo = 2.0**16, 2.0**15
    # step 2: first overflow absorbed (hysteresis 2); step 3: second overflow -> x0.5; step 6: absorbed again
    expected = [hi, hi, hi, lo, lo, lo, lo, lo]
    for rank, runs in enumerate(fp16_runs):
        hit = runs[(stage, accum, where)]
        assert [s["loss_scale"] for s in hit["stats"]] == expected, f"rank {rank}"
        assert [s["loss_scale"] for s in runs[(stage, accum, "clean")]["stats"]] == [hi] * STEPS
        assert hit["warnings"] == [f"step {s + 1}: fp16 gradient overflow, step skipped; loss scale now "
                                   f"{expected[s]:g}" for s in OVERFLOW_STEPS]
        assert all(s["grad_norm"] != s["grad_norm"] for s in hit["stats"] if s["skipped"])  # nan when skipped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,accum", SETTINGS)
def test_fp16_trains_like_pytorch_that_skips_the_same_steps(fp16_runs, stage, accum):
    from tests.zero.reference import assert_params_close

    for kind, skipped in (("clean", ()), ("loss", OVERFLOW_STEPS), ("grad", OVERFLOW_STEPS)):
        run = fp16_runs[0][(stage, accum, kind)]
        ref_losses, ref_params = _reference_skipping(skipped, accum)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=3e-2, atol=3e-2)
        assert_params_close(run["params"], ref_params, 3e-2, 0.1, f"fp16 stage {stage} {kind}")
    # and the skipped steps really made a difference (the check above is not vacuous)
    clean, hit = fp16_runs[0][(stage, accum, "clean")], fp16_runs[0][(stage, accum, "grad")]
    diff = max((clean["params"][k].float() - hit["params"][k].float()).abs().max().item() for k in clean["params"])
    assert diff > 1e-3
