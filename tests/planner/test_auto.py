"""choose_plan without an engine: trials given as a function, the choice by measurement, a trial out of memory
lost, the table in the run directory, the cache and a resumed run's plan (same machine or not, same version or
not)."""
import json

import pytest

from model_zoo.gpt import GPTConfig, gpt2_xl
from tests.planner.shapes import XL, gpu
from zerogpt.config import Config
from zerogpt.planner.auto import PLAN_JSON, PLAN_TABLE, choose_plan
from zerogpt.planner.machine import PlanCache
from zerogpt.planner.plan import PlanError
from zerogpt.planner.speed import default_constants

MACHINE = gpu(24, 64)
K = default_constants(MACHINE)
XL_CONFIG = GPTConfig(n_layer=48, n_head=25, n_embd=1600)


def xl_cfg(**keys) -> Config:
    base = dict(plan="auto", SEQ_LEN=1024, TOKENS_PER_STEP=64 * 1024, precision="bf16",
                model=dict(type=gpt2_xl), optimizer=dict(type="HybridAdam", lr=1e-4))
    return Config({**base, **keys}).validate()


class Trials:
    """Made-up measurements: the n-th trial's seconds from `seconds`, out of memory where it says None."""

    def __init__(self, seconds):
        self.seconds, self.plans = list(seconds), []

    def __call__(self, config, plan):
        self.plans.append(plan)
        s = self.seconds[len(self.plans) - 1]
        if s is None:
            return dict(error="out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)")
        return dict(seconds=s, device_peak=10 * 2**30, host_peak=20 * 2**30)


def choose(trial=None, **kw):
    kw.setdefault("version", "1.0")
    return choose_plan(xl_cfg(), XL, 1, MACHINE, K, model_config=XL_CONFIG, trial=trial, log=lambda _: None,
                       machine_print="machine-a", **kw)


def test_the_fastest_measured_is_kept_and_an_out_of_memory_trial_is_lost(tmp_path):
    trials = Trials([None, 9.0, 3.0])
    result = choose(trials, trials=3, run_dir=str(tmp_path))
    assert len(trials.plans) == 3
    assert result.chosen.plan == trials.plans[2]
    assert result.measured[trials.plans[0]]["error"].startswith("out of memory")
    table = (tmp_path / PLAN_TABLE).read_text()
    assert table == result.table + "\n"
    rows = table.splitlines()
    assert rows[0].startswith("plan='auto': 1,557.7M params, 65,536 tokens/step")
    chosen_row = next(r for r in rows if r.startswith("*"))
    assert trials.plans[2].describe()[:57] in chosen_row and "21,845" in chosen_row  # 65,536 / 3 s measured
    assert any("trial failed: out of memory" in r for r in rows)
    assert any("measured slower: 7,282 < 21,845 tokens/s" in r for r in rows)
    assert any("does not fit:" in r for r in rows)
    assert "speed model calibrated on the trials" in table
    saved = json.loads((tmp_path / PLAN_JSON).read_text())
    assert saved["plan"] == result.chosen.plan.to_dict() and saved["machine"] == "machine-a"
    assert result.config.BATCH_SIZE == result.chosen.plan.micro_batch and result.config.plan == "manual"


def test_every_trial_failing_is_one_line():
    with pytest.raises(PlanError, match=r"^plan='auto': every trial failed \(.*out of memory"):
        choose(Trials([None, None]), trials=2)


def test_the_cache_is_reused_on_the_same_machine_and_version_and_ignored_otherwise(tmp_path):
    cache = PlanCache(str(tmp_path / "plans.json"))
    first = choose(Trials([5.0, 4.0, 6.0]), trials=3, cache=cache)
    again = Trials([1.0])
    second = choose(again, trials=3, cache=cache)
    assert again.plans == [] and second.chosen.plan == first.chosen.plan
    assert any("reusing the plan chosen on this machine" in n for n in second.notes)
    newer = Trials([5.0, 4.0, 6.0])
    third = choose(newer, trials=3, cache=cache, version="2.0")
    assert len(newer.plans) == 3
    assert any("written by zerogpt 1.0, this is 2.0; ignored" in n for n in third.notes)
    elsewhere = choose_plan(xl_cfg(), XL, 1, MACHINE, K, model_config=XL_CONFIG, trial=Trials([5.0]), trials=1,
                            cache=cache, version="2.0", log=lambda _: None, machine_print="machine-b")
    assert any("written on another machine; ignored" in n for n in elsewhere.notes)


def test_a_resumed_run_reuses_its_plan_unless_the_machine_changed(tmp_path):
    first = choose(Trials([5.0, 4.0, 6.0]), trials=3, run_dir=str(tmp_path))
    none_run = Trials([])
    resumed = choose(none_run, trials=3, run_dir=str(tmp_path), resume=True)
    assert none_run.plans == [] and resumed.chosen.plan == first.chosen.plan
    assert resumed.notes[0].startswith("resumed: reusing this run's plan")
    moved = choose_plan(xl_cfg(), XL, 1, MACHINE, K, model_config=XL_CONFIG, trial=Trials([5.0]), trials=1,
                        run_dir=str(tmp_path), resume=True, version="1.0", log=lambda _: None,
                        machine_print="machine-b")
    assert moved.notes[0].startswith("resumed on another machine than this run's plan was chosen on")


def test_without_trials_the_fastest_predicted_is_chosen():
    from zerogpt.planner.search import search
    from zerogpt.planner.config_plan import workload_from_config

    result = choose(None)
    best = search(workload_from_config(xl_cfg(), XL, 1, XL_CONFIG), MACHINE, K).best
    assert result.chosen == best and result.measured == {}


def test_a_cached_plan_that_no_longer_fits_is_planned_again(tmp_path):
    cache = PlanCache(str(tmp_path / "plans.json"))
    big = gpu(80, 128)
    first = choose_plan(xl_cfg(), XL, 1, big, default_constants(big), model_config=XL_CONFIG, trial=Trials([1.0]),
                        trials=1, cache=cache, version="1.0", log=lambda _: None, machine_print="machine-a")
    assert first.chosen.plan.offload_optimizer == "none"  # the whole state on an 80 GB device
    shrunk = gpu(24, 64)  # same fingerprint given, less memory now
    again = choose_plan(xl_cfg(), XL, 1, shrunk, K, model_config=XL_CONFIG, trial=Trials([2.0]), trials=1,
                        cache=cache, version="1.0", log=lambda _: None, machine_print="machine-a")
    assert any(n.startswith(f"the plan found ({first.chosen.plan.describe()}) does not fit now") for n in again.notes)
    assert again.chosen.fits and again.chosen.plan != first.chosen.plan


def test_the_loss_is_chosen_by_measurement_when_every_fast_plan_takes_one_loss():
    """On an H200's memory GPT-2 XL's fastest predicted plans are alike in their loss, and the speed model cannot
    tell the two losses apart: the last trial goes to the fastest plan with the other loss, kept where it measures
    faster."""
    h200 = gpu(141, 128)
    tried = []

    def trial(config, plan):  # the plan with the fastest plans' other loss measures fastest
        tried.append(plan)
        return dict(seconds=2.0 if plan.chunked_loss != tried[0].chunked_loss else 3.0, device_peak=2**30,
                    host_peak=2**30)

    result = choose_plan(xl_cfg(), XL, 1, h200, default_constants(h200), model_config=XL_CONFIG, trial=trial,
                         trials=3, log=lambda _: None, machine_print="h200", version="1.0")
    losses = [p.chunked_loss for p in tried]
    assert losses.count(losses[0]) == 2, [p.describe() for p in tried]
    assert result.chosen.plan.chunked_loss != losses[0]


def test_a_resumed_run_plans_again_when_its_config_changed(tmp_path):
    """plan.json was reused whatever the config now asked: a new TOKENS_PER_STEP ran at the old one, a stage or
    BATCH_SIZE the config now fixes was ignored."""
    choose(Trials([5.0, 4.0, 6.0]), trials=3, run_dir=str(tmp_path))
    saved = (tmp_path / PLAN_JSON).read_text()
    for keys in (dict(TOKENS_PER_STEP=128 * 1024), dict(zero=dict(stage=3)), dict(BATCH_SIZE=1)):
        cfg = xl_cfg(**keys)
        resumed = choose_plan(cfg, XL, 1, MACHINE, K, model_config=XL_CONFIG, trial=Trials([5.0, 4.0, 6.0]),
                              trials=3, run_dir=str(tmp_path), resume=True, version="1.0", log=lambda _: None,
                              machine_print="machine-a")
        assert resumed.notes[0].startswith("resumed on another config"), resumed.notes
        plan = resumed.chosen.plan
        assert plan.micro_batch * plan.accumulation * 1024 == cfg.get("TOKENS_PER_STEP")
        assert plan.stage == dict(cfg.get("zero", {})).get("stage", plan.stage)
        assert plan.micro_batch == cfg.get("BATCH_SIZE", plan.micro_batch)
        (tmp_path / PLAN_JSON).write_text(saved)  # the first run's again


def test_a_cached_plan_that_does_not_reach_the_tokens_per_step_is_planned_again(tmp_path):
    cache = PlanCache(str(tmp_path / "plans.json"))
    first = choose(Trials([5.0, 4.0, 6.0]), trials=3, cache=cache)
    data = json.loads(cache.path.read_text())
    for entry in data.values():  # hand-edited: half the sequences per step
        entry["plan"]["accumulation"] = first.chosen.plan.accumulation * 2
    cache.path.write_text(json.dumps(data))
    again = choose(Trials([5.0, 4.0, 6.0]), trials=3, cache=cache)
    assert any("does not reach this config's tokens per step" in n for n in again.notes), again.notes
    assert again.chosen.plan.micro_batch * again.chosen.plan.accumulation == 64


@pytest.mark.parametrize("text", ["[1, 2]", '"plans"', '{"KEY": [1]}', '{"KEY": {"version": "1.0", "plan": null}}',
                                  '{"KEY": {"version": "1.0", "machine": "machine-a", "plan": {"stage": 0}}}',
                                  '{"KEY": {"version": "1.0", "machine": "machine-a", "plan": PLAN, "factors": [1]}}',
                                  '{"KEY": {"version": "1.0", "machine": "machine-a", "plan": PLAN, '
                                  '"factors": {"compute": 0}}}'])
def test_a_corrupt_cache_or_plan_json_is_planned_again_not_a_crash(tmp_path, text):
    from zerogpt.planner.config_plan import workload_from_config

    key = PlanCache.key(workload_from_config(xl_cfg(), XL, 1, XL_CONFIG))
    plan = json.dumps(choose(None).chosen.plan.to_dict())
    text = text.replace("KEY", key).replace("PLAN", plan)
    (tmp_path / "plans.json").write_text(text)
    cached = choose(Trials([5.0]), trials=1, cache=PlanCache(str(tmp_path / "plans.json")))
    assert cached.chosen.fits and cached.measured  # planned, with its trial
    saved = json.loads(text)
    (tmp_path / PLAN_JSON).write_text(json.dumps(saved[key]) if isinstance(saved, dict) else text)
    resumed = choose(Trials([5.0]), trials=1, run_dir=str(tmp_path), resume=True)
    assert resumed.chosen.fits and resumed.measured


@pytest.mark.parametrize("slower, takes_offload", [(1.02, False), (1.10, True)])
def test_an_offload_plan_within_measurement_noise_loses_to_one_that_offloads_nothing(slower, takes_offload):
    """Offload is chosen by measurement, as the loss is: a plan offloading nothing that fits is tried, and taken
    unless an offloading one measured faster by more than the noise of trial steps (auto.MEASUREMENT_NOISE)."""
    from zerogpt.planner.auto import offloads

    tried = []

    def trial(config, plan):
        tried.append(plan)
        return dict(seconds=slower if not offloads(plan) else 1.0, device_peak=2**30, host_peak=2**30)

    result = choose_plan(xl_cfg(), XL, 1, gpu(80, 256), default_constants(gpu(80, 256)), model_config=XL_CONFIG,
                         trial=trial, trials=3, log=lambda _: None, machine_print="machine-b", version="1.0")
    assert {offloads(p) for p in tried} == {True, False}
    assert offloads(result.chosen.plan) == takes_offload
    assert "offloads, within measurement noise of the chosen" in result.table or takes_offload
