"""The speed model: what each term responds to, and calibration recovering known factors. No torch."""
import pytest

from tests.planner.shapes import gpu, xl_work
from zerogpt.planner.plan import Plan
from zerogpt.planner.speed import TERMS, calibrate, default_constants, step_terms, tokens_per_s

K = default_constants(gpu(80))


def plan(**kw) -> Plan:
    base = dict(stage=3, offload_optimizer="cpu", offload_param="none", state_dtype="fp32", micro_batch=64,
                accumulation=1, checkpoint=False, chunked_loss=False)
    return Plan(**{**base, **kw})


def test_small_micro_batches_are_slower_for_the_same_tokens():
    work = xl_work()
    assert tokens_per_s(plan(micro_batch=4, accumulation=16), work, K) < tokens_per_s(plan(), work, K)


def test_checkpointing_costs_a_third_more_compute():
    work = xl_work()
    plain, ckpt = step_terms(plan(), work, K), step_terms(plan(checkpoint=True), work, K)
    assert ckpt["compute"] == pytest.approx(plain["compute"] * 4 / 3)


def test_offload_costs_link_and_host_step_and_param_offload_more_link():
    work = xl_work()
    on_device = step_terms(plan(offload_optimizer="none"), work, K)
    offloaded = step_terms(plan(), work, K)
    params_too = step_terms(plan(offload_param="cpu"), work, K)
    assert on_device["link"] == 0 and offloaded["link"] > 0 and params_too["link"] > offloaded["link"]
    assert offloaded["step"] > on_device["step"]
    kept = step_terms(plan(offload_param="cpu", device_budget=10**12), work, K)
    assert kept["link"] == offloaded["link"]  # every shard kept on the device: nothing gathered from the host


def test_calibration_recovers_the_factors_of_measured_steps():
    work = xl_work()
    truth = dict(compute=1.7, link=1.0, collective=1.0, step=0.5, overhead=1.0)
    plans = [plan(), plan(offload_optimizer="none"), plan(micro_batch=8, accumulation=8),
             plan(checkpoint=True, offload_param="cpu"), plan(state_dtype="bf16", micro_batch=16, accumulation=4)]
    trials = []
    for p in plans:
        terms = step_terms(p, work, K)
        trials.append((terms, sum(truth[t] * terms[t] for t in TERMS)))
    fitted, factors = calibrate(K, trials)
    assert factors["compute"] == pytest.approx(1.7, rel=0.05)
    assert factors["step"] == pytest.approx(0.5, rel=0.1)
    for p, (_, measured) in zip(plans, trials):
        assert sum(step_terms(p, work, fitted).values()) == pytest.approx(measured, rel=0.1)


def test_one_trial_scales_the_whole_step():
    terms = step_terms(plan(), xl_work(), K)
    fitted, factors = calibrate(K, [(terms, 2 * sum(terms.values()))])
    assert list(factors.values()) == pytest.approx([2.0] * len(factors))
    assert sum(step_terms(plan(), xl_work(), fitted).values()) == pytest.approx(2 * sum(terms.values()))
