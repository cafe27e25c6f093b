"""plan="auto" from config to config: the workload the config asks for, the machine, the search, the trial steps
of the few fastest predicted plans, the choice, its table (printed and written to the run directory) and the
config with the chosen plan written in (what `initialize` then executes, as it would a hand-set file).

A resumed run reuses its run directory's plan (plan.json) unless the machine changed, and says which. A plan
chosen before for this workload on this machine and zerogpt version comes from the cache without new trials.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from zerogpt.config import Config
from zerogpt.memory_model import ModelShape
from zerogpt.planner.config_plan import apply_plan, fixed_keys_line, workload_from_config
from zerogpt.planner.explain import explain
from zerogpt.atomic_write import write_json_atomic, write_text_atomic
from zerogpt.planner.machine import PlanCache, fingerprint, saved_plan
from zerogpt.planner.plan import Machine, Plan, PlanError, Workload
from zerogpt.planner.search import Candidate, Choice, enumerate_plans, evaluate, search
from zerogpt.planner.speed import SpeedConstants, calibrate

__all__ = ["AutoPlan", "choose_plan", "trial_candidates", "PLAN_JSON", "PLAN_TABLE"]

PLAN_JSON, PLAN_TABLE = "plan.json", "plan.txt"

Trial = Callable[[Config, Plan], dict]
"""Runs a plan's config for a few steps: {"seconds", "device_peak", "host_peak"} or {"error"}."""


@dataclass
class AutoPlan:
    """The outcome: the config to build, the chosen candidate, the table, the trials' measurements."""

    config: Config
    chosen: Candidate
    table: str
    measured: dict = field(default_factory=dict)
    factors: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def trial_candidates(choice: Choice, count: int) -> list[Candidate]:
    """The `count` fastest predicted plans that differ in what moves speed most (stage, offloads, micro-batch,
    checkpointing): plans alike but for bucket size, prefetch or the chunked loss are one trial.

    The speed model has no term for the loss's kernel, whose speed is the machine's (on one H200 the chunked loss
    ran at 0.78x the plain loss's; on a CPU they are even), and predicts offload a little faster where the memory it
    frees buys a larger micro-batch. So when every trial would take the same loss, or every one would offload, and a
    plan with the other fits, the fastest of those takes one of the last trials: both are chosen by measurement too.
    """
    out, seen = [], set()
    for c in choice.ranked:
        p = c.plan
        key = (p.stage, p.offload_optimizer, p.offload_param, p.micro_batch, p.checkpoint)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == count:
            break
    traits = (lambda p: p.chunked_loss, offloads)
    for i, trait in enumerate(traits):
        other = next((c for c in choice.ranked if trait(c.plan) != trait(out[0].plan)), None) if out else None
        if len(out) < 2 or other is None or len({trait(c.plan) for c in out}) > 1:
            continue
        for j in range(len(out) - 1, 0, -1):  # the slowest trial whose place keeps the traits already varied
            rest = out[:j] + out[j + 1:] + [other]
            if all(len({t(c.plan) for c in rest}) >= len({t(c.plan) for c in out}) for t in traits[:i]):
                out = rest
                break
    return out


def offloads(plan: Plan) -> bool:
    return plan.offload_optimizer != "none" or plan.offload_param != "none"


MEASUREMENT_NOISE = 0.03
"""Trial steps of one plan differ by about this much between runs: a measured plan that offloads nothing, within it of
the fastest, is taken over one that offloads (which holds host RAM and adds the host step for no gain measured)."""


def _resumed_plan(run_dir: Path, work: Workload, machine_print: str, version: str, notes: list) -> Plan | None:
    try:
        saved = json.loads((run_dir / PLAN_JSON).read_text())
    except (OSError, ValueError):
        return None
    found = saved_plan(saved) if isinstance(saved, dict) else None
    if found is None:
        notes.append(f"resumed: {run_dir / PLAN_JSON} is not a plan: planning again")
        return None
    same_work = saved.get("workload", PlanCache.key(work)) == PlanCache.key(work)  # older plan.json: no key
    if saved.get("machine") == machine_print and saved.get("version") == version and same_work:
        notes.append(f"resumed: reusing this run's plan ({run_dir / PLAN_JSON})")
        return found[0]
    what = ("machine" if saved.get("machine") != machine_print else "zerogpt version"
            if saved.get("version") != version else "config (model, tokens per step or fixed keys)")
    notes.append(f"resumed on another {what} than this run's plan was chosen on ({run_dir / PLAN_JSON}): "
                 f"planning again")
    return None


def _run_trials(cfg: Config, work: Workload, choice: Choice, trial: Trial, count: int,
                log: Callable[[str], None]) -> dict:
    measured: dict[Plan, dict] = {}
    for c in trial_candidates(choice, count):
        log(f"plan='auto': trial steps of {c.plan.describe()}")
        result = trial(apply_plan(cfg, c.plan), c.plan)
        if "seconds" in result:
            result = dict(result, tokens_per_s=work.tokens_per_step / max(result["seconds"], 1e-9))
        measured[c.plan] = result
    return measured


def _still_fits(known: Plan | None, work: Workload, machine: Machine, k: SpeedConstants,
                notes: list) -> Candidate | None:
    """A plan found before (the run's, the cache's) as a candidate, or None when there is none, it is not one of
    this workload's plans (another tokens per step, a key the config now fixes) or it does not fit now (the free
    memory moved since); said in `notes`."""
    if known is None:
        return None
    as_searched = known if "device_budget" in work.fixed else replace(known, device_budget=0)  # sized to the room
    if as_searched not in set(enumerate_plans(work)):
        notes.append(f"the plan found ({known.describe()}) does not reach this config's tokens per step with its "
                     f"fixed keys: planning again")
        return None
    found = evaluate(known, work, machine, k)
    if not found.fits:
        notes.append(f"the plan found ({known.describe()}) does not fit now ({found.why_not}): planning again")
        return None
    return found


def _fastest_measured(choice: Choice, measured: dict, machine: Machine) -> Candidate:
    ran = [c for c in choice.ranked if "tokens_per_s" in measured.get(c.plan, {})]
    if not ran:
        errors = "; ".join(f"{p.describe()}: {m.get('error')}" for p, m in measured.items())
        raise PlanError(f"plan='auto': every trial failed ({errors}); {machine.describe()}")
    def rate(c: Candidate) -> float:
        return measured[c.plan]["tokens_per_s"]

    fastest = max(ran, key=rate)
    if not offloads(fastest.plan):
        return fastest
    close = [c for c in ran if not offloads(c.plan) and rate(c) >= (1 - MEASUREMENT_NOISE) * rate(fastest)]
    return max(close, key=rate) if close else fastest


def choose_plan(cfg: Config, shape: ModelShape, dp: int, machine: Machine, constants: SpeedConstants,
                model_config: Any = None, trial: Trial | None = None, trials: int = 3, run_dir: str | None = None,
                resume: bool = False, cache: PlanCache | None = None, version: str = "",
                log: Callable[[str], None] = print, machine_print: str | None = None, write: bool = True,
                agree: Callable[[Any], Any] = lambda known: known) -> AutoPlan:
    """Choose the plan of a plan="auto" config (see the module docstring). Raises PlanError (one line).

    `trial(config, plan)` runs trial steps (None: the fastest predicted is chosen untried). `write`: this process
    writes the run directory's files and the cache (rank 0). `agree`: makes every rank take rank 0's reused plan
    (a broadcast), so all ranks run the same trials or none."""
    work = workload_from_config(cfg, shape, dp, model_config)
    work.check()
    machine_print = machine_print or fingerprint(machine)
    notes: list[str] = []
    out_dir = Path(run_dir) if run_dir else None
    known = _resumed_plan(out_dir, work, machine_print, version, notes) if resume and out_dir else None
    factors: dict = {}
    if known is None and cache is not None:
        found, note = cache.lookup(work, machine_print, version)
        notes += [note] if note else []
        if found:
            known, factors = found
    known, factors, notes = agree((known, factors, notes))
    k = constants.scaled(factors) if factors else constants
    choice = search(work, machine, k)
    measured: dict = {}
    chosen = _still_fits(known, work, machine, k, notes)
    reused = chosen is not None
    if chosen is None and trial is not None and trials > 0:
        measured = _run_trials(cfg, work, choice, trial, trials, log)
        chosen = _fastest_measured(choice, measured, machine)
        ran = [c for c in choice.ranked if "seconds" in measured.get(c.plan, {})]
        k, factors = calibrate(constants, [(c.terms, measured[c.plan]["seconds"]) for c in ran])
    elif chosen is None:
        chosen = choice.best
    if work.fixed:
        notes.append(f"fixed by the config: {fixed_keys_line(work)}")
    if factors:
        notes.append("speed model calibrated on the trials: " + ", ".join(f"{t} x{f:.2f}" for t, f in factors.items()))
    table = explain(choice, chosen, work, machine, measured, note="\n".join(notes))
    if out_dir is not None and write:
        write_text_atomic(out_dir / PLAN_TABLE, table + "\n")
        write_json_atomic(out_dir / PLAN_JSON, dict(version=version, machine=machine_print,
                                                    workload=PlanCache.key(work), plan=chosen.plan.to_dict(),
                                                    factors=factors))
    if cache is not None and not reused and write:
        cache.store(work, machine_print, version, chosen.plan, factors)
    return AutoPlan(apply_plan(cfg, chosen.plan), chosen, table, measured, factors, notes)
