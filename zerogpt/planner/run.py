"""plan="auto" inside a launched run: rank 0 measures the machine and every rank gets the same numbers, every
rank runs the same trial steps (a collective build), the trials' measurements are gathered (the slowest rank's
seconds, the largest peaks, any rank's error), so every rank chooses the same plan; rank 0 writes the table, the
run directory's plan.json and the cache."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

import zerogpt
from zerogpt.config import Config, parallel_config
from zerogpt.memory_model import ModelShape
from zerogpt.planner.auto import choose_plan
from zerogpt.planner.machine import PlanCache, cpu_flops_per_s, detect_machine, fingerprint
from zerogpt.planner.plan import Plan, PlanError
from zerogpt.planner.speed import default_constants
from zerogpt.planner.trial import restore_rng_states, rng_states, run_trial

__all__ = ["plan_for_run", "TRIALS", "TRIAL_STEPS"]

TRIALS, TRIAL_STEPS = 3, 2


def _from_rank0(value: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gathered(result: dict) -> dict:
    """One trial's result as every rank sees it: the slowest seconds, the largest peaks, any rank's error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return result
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return dict(error=errors[0])
    return {key: max(r[key] or 0 for r in results) for key in ("seconds", "device_peak", "host_peak")}


def plan_for_run(cfg: Config, ctx: Any, build_model: Callable[[Config], torch.nn.Module],
                 criterion: Callable[[], Any], resume: bool, log: Callable[[str], None]) -> Config:
    """The config with its plan chosen (see zerogpt/planner/auto.py); `build_model(cfg)` builds the model as the
    run will (meta device), `criterion()` the loss. The model state of trials is discarded, and every RNG is put
    back as it was (building a model draws its init seed), so the run starts as a hand-set run of the plan."""
    states = rng_states()
    try:
        return _plan_for_run(cfg, ctx, build_model, criterion, resume, log)
    finally:
        restore_rng_states(states)


def _plan_for_run(cfg: Config, ctx: Any, build_model: Callable[[Config], torch.nn.Module],
                  criterion: Callable[[], Any], resume: bool, log: Callable[[str], None]) -> Config:
    parallel = parallel_config(cfg)
    if parallel.tensor.size > 1 or parallel.pipeline > 1:
        raise PlanError("plan='auto' plans data parallelism only; with parallel.tensor or parallel.pipeline set the "
                        "memory keys by hand (plan='manual')")
    with torch.device("meta"):
        probe = build_model(cfg)
    shape = ModelShape.from_config(getattr(probe, "config", None))
    if shape is None:
        raise PlanError("plan='auto' needs a model_zoo GPT-2 or Llama-family model (its shape is what it plans "
                        "for); set the memory keys by hand for this model")
    zero = dict(cfg.get("zero", {}))
    disk_path = dict(zero.get("offload_optimizer", {})).get("path")
    machine = _from_rank0(detect_machine(local_ranks=ctx.local_world_size, disk_path=disk_path)
                          if ctx.global_rank == 0 else None)
    constants = _from_rank0(default_constants(machine, None if machine.on_gpu else cpu_flops_per_s())
                            if ctx.global_rank == 0 else None)
    machine_print = _from_rank0(fingerprint(machine) if ctx.global_rank == 0 else None)
    vocab = shape.vocab

    def trial(plan_cfg: Config, plan: Plan) -> dict:
        def build() -> Any:
            with torch.device("meta"):
                model = build_model(plan_cfg)
            return zerogpt.initialize(model, dict(plan_cfg.optimizer), criterion(), config=plan_cfg, ctx=ctx)
        result = run_trial(build, plan.micro_batch, plan.accumulation, plan_cfg.SEQ_LEN, vocab, TRIAL_STEPS,
                           device_capacity=None if machine.on_gpu else machine.device_bytes)
        return _gathered(result)

    main = ctx.global_rank == 0
    train = dict(cfg.get("train", {}))
    result = choose_plan(cfg, shape, ctx.dp_size, machine, constants, model_config=probe.config, trial=trial,
                         trials=TRIALS, run_dir=train.get("output_dir", "runs/default"), resume=resume,
                         cache=PlanCache(), version=zerogpt.__version__, log=log, machine_print=machine_print,
                         write=main, agree=_from_rank0)
    log(result.table)
    return result.config
