"""Stage 3 (zero/gather_hooks.py): parameters gathered chunk by chunk in forward and backward through
module hooks, released after use, prefetched in the recorded order, on 2 gloo ranks.

Every model below trains 2 ranks x stage 3 and must reproduce plain single-process PyTorch (fp32:
relative 1e-5): activation checkpointing (recompute re-gathers), tied weights, a layer called twice,
a branch used on some steps only, keyword-argument forwards, a forward whose order changes by an
argument, frozen parameters, HF transformers' GPT2LMHeadModel (tiny config, built locally),
model_zoo's GPT, and GPT with no_grad eval forwards between steps and two forwards per backward. A probe wrapped around each chunk's gather() checks the memory invariants:
nothing gathered between steps, at most (own chunks + prefetch + held tied chunk) during a pass,
after the first pass only the first module's chunks are gathered cold (the rest were prefetched), and
a released chunk's memory is really freed between forward and backward (no tensor autograd saved for
backward, such as a Linear's `weight.t()`, keeps the gathered buffer alive).
"""
from __future__ import annotations

import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.dist_utils import run_distributed
from tests.zero.reference import assert_run_matches, engine_run, reference_run
from tests.zero.stage3_recipes import RECIPES, toy_frozen

WORLD = 2
PREFETCH = 2


ACCUM = {"toy_branch_some_steps": 2, "gpt_activation_checkpointing": 2}


# ----------------------------------------------------------------------------------------------
# the gather probe (lives in the spawned rank's process)

_PROBE: dict = {}


def _held(chunks) -> int:
    """Chunks whose full buffer exists: gathered, or in flight (an async all-gather's output buffer)."""
    return sum(c.full_buffer is not None for c in chunks)


def attach_probe(engine) -> None:
    """Wrap each chunk's gather(): log (phase, chunk, prefetch?, cold?) and the most chunks held at once,
    and keep a weak reference to every gathered buffer's storage. Wrap backward(): count, as backward
    starts, the released chunks whose buffers something still keeps alive."""
    _PROBE.clear()
    _PROBE.update(events=[], max_held={"forward": 0, "backward": 0}, buffers=[], pinned=[])
    chunks = engine.chunks
    for chunk in chunks:
        def gather(async_op: bool = False, chunk=chunk, original=chunk.gather) -> None:
            phase = "backward" if engine.gather_hooks.in_backward else "forward"
            cold = chunk.full_buffer is None
            original(async_op)
            _PROBE["events"].append((phase, chunk.plan.index, async_op, cold))
            _PROBE["max_held"][phase] = max(_PROBE["max_held"][phase], _held(chunks))
            if cold and chunk.full_buffer is not None:
                _PROBE["buffers"].append((chunk, StorageWeakRef(chunk.full_buffer.untyped_storage())))
        chunk.gather = gather

    def backward(loss, original=engine.backward) -> None:
        released = [(c, ref) for c, ref in _PROBE["buffers"] if c.full_buffer is None]
        for _ in range(100):  # gloo's worker thread lets go of a finished collective's tensors just after the wait
            if all(ref.expired() for _, ref in released):
                break
            time.sleep(0.01)
        _PROBE["pinned"].append(sorted({c.plan.index for c, ref in released if not ref.expired()}))
        _PROBE["buffers"] = []
        original(loss)
    engine.backward = backward


def inspect_step(engine, step: int) -> dict:
    """After each optimizer step: what is gathered now, and this step's gather log (then reset)."""
    events, max_held, pinned = _PROBE["events"], dict(_PROBE["max_held"]), _PROBE["pinned"]
    _PROBE.update(events=[], max_held={"forward": 0, "backward": 0}, buffers=[], pinned=[])
    return {
        "held_between_steps": _held(engine.chunks),
        "released_but_alive_at_backward": pinned,
        "nonempty_params": [n for n, p in engine.module.named_parameters() if p.numel() > 0],
        "events": events,
        "max_held": max_held,
        "recorded_order": list(engine.gather_hooks.recorded_order),
        "backward_order": list(engine.gather_hooks.backward_order),
        "num_chunks": len(engine.chunks),
        "max_chunks_per_module": max(len(c) for c in engine.gather_hooks.module_chunks.values()),
        "shard_numels": [c.shard.numel() for c in engine.chunks],
        "padded_numels": [c.plan.padded_numel for c in engine.chunks],
        "state_numels": {c.plan.index: sorted({v.numel() for v in engine.sharded_optim.states[c.plan.index]
                                                .state_tensors().values()}) if c.plan.trainable else []
                         for c in engine.chunks},
        "trainable": [c.plan.trainable for c in engine.chunks],
        "first_module_chunks": _first_module_chunks(engine),
    }


def _first_module_chunks(engine) -> int:
    order = engine.gather_hooks.recorded_order
    first_module = next(ids for ids in engine.gather_hooks.module_chunks.values() if order and ids[0] == order[0])
    return len(first_module)


def _run_all(rank: int, world: int) -> dict:
    from zerogpt.zero import TensorShardStrategy

    zero = dict(stage=3, shard_strategy=TensorShardStrategy(), prefetch=PREFETCH)
    return {name: engine_run(rank, world, recipe, zero, accum=ACCUM.get(name, 1), setup=attach_probe,
                             inspect=inspect_step) for name, recipe in RECIPES.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_run_all, WORLD, timeout=280)


# ----------------------------------------------------------------------------------------------
# parity


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RECIPES))
def test_stage3_matches_single_process_pytorch(runs, name):
    accum = ACCUM.get(name, 1)
    assert_run_matches(runs[0][name], reference_run(RECIPES[name], WORLD, accum), precision="fp32",
                       what=f"stage 3 {name}")
    assert runs[0][name]["losses"] == runs[1][name]["losses"]


# ----------------------------------------------------------------------------------------------
# gather / release / prefetch invariants


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RECIPES))
def test_nothing_gathered_between_steps(runs, name):
    for rank, run in enumerate(runs):
        for step, seen in enumerate(run[name]["inspect"]):
            assert seen["held_between_steps"] == 0, f"rank {rank} step {step}: chunks still gathered"
            assert seen["nonempty_params"] == [], f"rank {rank} step {step}: {seen['nonempty_params']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RECIPES))
def test_released_chunks_free_their_memory_before_backward(runs, name):
    """Autograd saves weights for backward (a Linear saves weight.t(), a view of the gathered buffer); if
    that view kept the buffer, stage 3 would hold every parameter from forward to backward."""
    for rank, run in enumerate(runs):
        for step, seen in enumerate(run[name]["inspect"]):
            assert seen["released_but_alive_at_backward"], f"rank {rank} step {step}: backward never called"
            for pinned in seen["released_but_alive_at_backward"]:
                assert pinned == [], f"rank {rank} step {step}: released chunks {pinned} still in memory"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["toy_plain", "toy_kwargs_shared_layer", "toy_order_changes", "gpt", "hf_gpt2"])
def test_at_most_chunks_in_use_plus_prefetch_are_gathered(runs, name):
    """Own chunks of the running module + PREFETCH ahead + 1 tied chunk (embedding = head, held
    from the embedding's forward to the head's) - far fewer than all chunks."""
    for step, seen in enumerate(runs[0][name]["inspect"]):
        bound = seen["max_chunks_per_module"] + PREFETCH + 1
        assert seen["num_chunks"] > 2 * bound, "model too small for this check to mean anything"
        for phase in ("forward", "backward"):
            assert 0 < seen["max_held"][phase] <= bound, \
                f"step {step} {phase}: {seen['max_held'][phase]} chunks held at once, bound {bound}"


@pytest.mark.timeout(300)
def test_activation_checkpointing_regathers_in_backward(runs):
    """Recompute runs each block's forward again inside backward: its chunks are gathered again there.
    The chunks backward starts with (the head, tied to the embedding, and the final norm: not
    recomputed) stay gathered from the end of forward, as the previous step's backward order says."""
    steps = runs[0]["gpt_activation_checkpointing"]["inspect"]
    for step, seen in enumerate(steps):
        backward = {c for phase, c, _, cold in seen["events"] if phase == "backward" and cold}
        forward = {c for phase, c, _, cold in seen["events"] if phase == "forward"}
        kept = set(steps[step - 1]["backward_order"][:PREFETCH]) if step else set()
        assert forward - kept <= backward, f"step {step}: chunks {sorted(forward - kept - backward)} never re-gathered"
        assert not kept & backward, f"step {step}: chunks {sorted(kept & backward)} released before backward"
        assert seen["max_held"]["backward"] < seen["num_chunks"]  # still released as grads complete


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_backward_starts_on_the_chunks_forward_kept(runs, name):
    """Forward's last chunks are what backward needs first: from the second step on they are kept or
    prefetched at the end of forward, so backward gathers nothing on demand before its first module."""
    steps = runs[0][name]["inspect"]
    for step, seen in enumerate(steps[1:], start=1):
        first = steps[step - 1]["backward_order"][0]
        cold_in_backward = [c for phase, c, async_op, cold in seen["events"]
                            if phase == "backward" and cold and not async_op]
        assert first not in cold_in_backward, f"step {step}: chunk {first} re-gathered on demand in backward"


def _cold_forward_gathers(seen: dict) -> int:
    return sum(1 for phase, _, async_op, cold in seen["events"] if phase == "forward" and cold and not async_op)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["toy_plain", "gpt", "hf_gpt2"])
def test_prefetch_follows_the_recorded_order(runs, name):
    steps = runs[0][name]["inspect"]
    first = steps[0]
    used = {c for phase, c, _, _ in first["events"] if phase == "forward"}
    assert _cold_forward_gathers(first) == len(used)  # nothing recorded yet: every chunk on demand
    for step, seen in enumerate(steps[1:], start=1):
        assert _cold_forward_gathers(seen) == seen["first_module_chunks"], \
            f"step {step}: {_cold_forward_gathers(seen)} chunks gathered on demand; prefetch missed"
        prefetched = [c for phase, c, async_op, cold in seen["events"] if phase == "forward" and async_op and cold]
        order = list(dict.fromkeys(seen["recorded_order"]))  # first use of each chunk
        expected = order[seen["first_module_chunks"]:]
        assert prefetched[: len(expected)] == expected, f"step {step}: prefetch out of recorded order"
        # then, at the end of forward, the chunks the previous backward started with
        assert set(prefetched[len(expected):]) <= set(steps[step - 1]["backward_order"][:PREFETCH])


@pytest.mark.timeout(300)
def test_order_change_is_rerecorded(runs):
    steps = runs[0]["toy_order_changes"]["inspect"]
    forward_order, reversed_order = steps[3]["recorded_order"], steps[4]["recorded_order"]
    assert forward_order != reversed_order
    assert steps[7]["recorded_order"] == reversed_order and steps[8]["recorded_order"] == forward_order
    cold = [_cold_forward_gathers(s) for s in steps]
    base = steps[1]["first_module_chunks"]
    # the first pass in a new order mispredicts (gathers on demand); the next one is prefetched again
    assert cold[4] > base and cold[8] > base
    assert cold[5] == cold[6] == cold[7] == cold[9] == base, cold


@pytest.mark.timeout(300)
def test_frozen_parameters_have_no_grads_or_optimizer_state_but_are_gathered(runs):
    for rank, run in enumerate(runs):
        seen = run["toy_frozen_embedding"]["inspect"][-1]
        frozen = [i for i, t in enumerate(seen["trainable"]) if not t]
        assert len(frozen) == 1, seen["trainable"]  # the tied embedding/head chunk
        assert seen["state_numels"][frozen[0]] == []  # no master, no Adam state
        for i, t in enumerate(seen["trainable"]):
            if t:  # Adam state exists only for this rank's shard
                assert seen["state_numels"][i] == [seen["shard_numels"][i]]
        gathered = {c for phase, c, _, _ in seen["events"] if phase == "forward"}
        assert frozen[0] in gathered  # still gathered for the forward
    # and unchanged by training (the reference never steps it either)
    init = toy_frozen().embed.weight
    torch.testing.assert_close(runs[0]["toy_frozen_embedding"]["params"]["embed.weight"], init.detach(),
                               rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_every_rank_holds_one_equal_shard(runs):
    for run in runs:
        seen = run["gpt"]["inspect"][0]
        assert seen["shard_numels"] == [p // WORLD for p in seen["padded_numels"]]


# ----------------------------------------------------------------------------------------------
# the seed tutorial's zero section (no stage) is stage 3


def _seed_form(rank: int, world: int) -> dict:
    from zerogpt.zero import TensorShardStrategy

    zero = dict(model_config=dict(offload_config=dict(device="cpu"), shard_strategy=TensorShardStrategy()),
                optimizer_config=dict(cpu_offload=True))
    seen = {}

    def setup(engine):
        seen.update(stage=engine.stage, strategy=type(engine.config.zero.shard_strategy).__name__,
                    shards=[c.shard.numel() for c in engine.chunks],
                    padded=[c.plan.padded_numel for c in engine.chunks],
                    persistent=[c.persistent_full for c in engine.chunks])

    run = engine_run(rank, world, RECIPES["gpt"], zero, setup=setup, inspect=inspect_step_light)
    return {**run, "seen": seen}


def inspect_step_light(engine, step):
    return _held(engine.chunks)


@pytest.mark.timeout(200)
def test_seed_tutorial_zero_config_means_stage_3():
    runs = run_distributed(_seed_form, WORLD, timeout=180)
    seen = runs[0]["seen"]
    assert seen["stage"] == 3 and seen["strategy"] == "TensorShardStrategy"
    assert seen["shards"] == [p // WORLD for p in seen["padded"]] and not any(seen["persistent"])
    assert runs[0]["inspect"] == [0] * len(runs[0]["inspect"])
    assert_run_matches(runs[0], reference_run(RECIPES["gpt"], WORLD, 1), precision="fp32", what="seed form")
