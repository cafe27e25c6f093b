"""The search: every plan that reaches the tokens per step, its memory from memory_model.estimate, its speed from
speed.py, the fastest that fits with the machine's margin first. Pure (no torch, no engine).

Where the workload fixes a key it is the only value tried. Nothing fitting is one line (`PlanError`): what the
model needs at the least, what the machine has, and the smallest change that fits: a fixed key to free, disk
offload, more host RAM, another GPU, or fewer tokens per micro-batch (a shorter sequence).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from zerogpt.memory_model import estimate
from zerogpt.planner.plan import CONFIG_KEYS, GIB, Machine, Plan, PlanError, Workload
from zerogpt.planner.speed import SpeedConstants, step_terms

__all__ = ["Candidate", "Choice", "enumerate_plans", "evaluate", "search"]

BUCKETS_MB = (25.0, 64.0)
PREFETCH = (1, 2)


@dataclass(frozen=True)
class Candidate:
    """A plan with what the models say of it: bytes per home (device per rank; host and disk per host, every
    local rank's), whether it fits and why not, predicted seconds per term and tokens/s."""

    plan: Plan
    need: dict
    fits: bool
    why_not: str
    terms: dict
    tokens_per_s: float


@dataclass(frozen=True)
class Choice:
    """The search's answer: the fitting candidates, fastest first, and the ones that did not fit."""

    ranked: tuple[Candidate, ...]
    unfit: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(work: Workload) -> list[Plan]:
    """Every plan the engine accepts that reaches the workload's tokens per step, fixed keys kept (device_budget
    is 0 here: `evaluate` sizes it to what the device has left)."""
    fixed = work.fixed
    options = dict(
        stage=[0, 1, 2, 3] if work.world > 1 else [0, 3],  # at one rank stages 1-2 hold what stage 0 does
        offload_optimizer=["none", "cpu"] + (["disk"] if work.disk_path else []),
        offload_param=["none", "cpu"],
        state_dtype=["fp32", "bf16"] if work.host_adam else ["fp32"],
        micro_batch=_divisors(work.samples_per_rank),
        checkpoint=[False, True] if work.can_checkpoint else [False],
        chunked_loss=[False, True] if work.can_checkpoint else [False],
        bucket_mb=list(BUCKETS_MB),
        prefetch=list(PREFETCH))
    for key, value in fixed.items():
        if key in options:
            options[key] = [value]
    plans = []
    for values in itertools.product(*options.values()):
        p = dict(zip(options, values))
        if p["offload_param"] != "none" and p["stage"] != 3:
            continue
        if p["state_dtype"] == "bf16" and p["offload_optimizer"] == "none":
            continue
        if p["stage"] != 3 and p["prefetch"] != options["prefetch"][-1]:
            continue  # prefetch means nothing below stage 3: one value
        accumulation = work.samples_per_rank // p["micro_batch"]
        if "accumulation" in fixed and fixed["accumulation"] != accumulation:
            continue
        plans.append(Plan(accumulation=accumulation, device_budget=int(fixed.get("device_budget", 0)), **p))
    return plans


def _estimate(plan: Plan, work: Workload, machine: Machine) -> dict:
    return estimate(work.shape, plan.stage, work.world, work.precision, plan.offload_optimizer, plan.offload_param,
                    work.seq_len, plan.micro_batch, plan.checkpoint, prefetch=plan.prefetch,
                    bucket_mb=plan.bucket_mb, gpu_overhead=machine.gpu_overhead, accumulation=plan.accumulation,
                    optimizer_bytes_per_param=4 if plan.state_dtype == "bf16" else 8,
                    gather_per_block=work.compile, loss_chunk=work.loss_chunk if plan.chunked_loss else 0,
                    device_budget=plan.device_budget, on_gpu=machine.on_gpu)


def _needs(est: dict, machine: Machine) -> dict:
    """Bytes per capacity: the device per rank; host RAM and disk per host. A CPU run's device is host RAM too,
    the bytes both homes share held once (memory_model.estimate's host_ram)."""
    totals = est["totals"]
    return dict(device=totals["device"], host=est["host_ram"] * machine.local_ranks,
                disk=totals["disk"] * machine.local_ranks)


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _why_not(need: dict, machine: Machine) -> str:
    room = 1 - machine.margin
    caps = dict(device=machine.device_bytes, host=machine.host_bytes, disk=machine.disk_bytes)
    over = [f"{home} {_size(need[home])} > {_size(room * cap)}"
            for home, cap in caps.items() if cap is not None and need[home] > room * cap]
    return "; ".join(over)


def _with_device_budget(plan: Plan, work: Workload, machine: Machine, est: dict) -> tuple[Plan, dict]:
    """Param offload: keep as many param shards on the device as its room left allows (whole GiB steps down to
    64 MiB granularity), and the estimate with them; other plans are returned as they are."""
    if plan.offload_param == "none" or "device_budget" in work.fixed:
        return plan, est
    spare = int((1 - machine.margin) * machine.device_bytes) - est["totals"]["device"]
    if spare <= 0:
        return plan, est
    shard = est["model_states"]["params"]["host"]
    budget = min(spare, shard) // 2**26 * 2**26
    if budget <= 0:
        return plan, est
    kept = replace(plan, device_budget=budget)
    return kept, _estimate(kept, work, machine)


def evaluate(plan: Plan, work: Workload, machine: Machine, k: SpeedConstants) -> Candidate:
    """One plan's memory (memory_model.estimate) and speed (speed.step_terms)."""
    est = _estimate(plan, work, machine)
    plan, est = _with_device_budget(plan, work, machine, est)
    need = _needs(est, machine)
    why = _why_not(need, machine)
    terms = step_terms(plan, work, k)
    return Candidate(plan, need, not why, why, terms, work.tokens_per_step / sum(terms.values()))


def _simplicity(c: Candidate) -> tuple:
    """Among equally fast plans, the one with fewer moving parts: no offload, lower stage, no checkpointing."""
    p = c.plan
    return (p.offload_optimizer != "none", p.offload_param != "none", p.checkpoint, p.chunked_loss, p.stage,
            p.state_dtype != "fp32")


def _rank(work: Workload, machine: Machine, k: SpeedConstants) -> tuple[list[Candidate], list[Candidate]]:
    evaluated = [evaluate(p, work, machine, k) for p in enumerate_plans(work)]
    fits = sorted((c for c in evaluated if c.fits), key=lambda c: (-round(c.tokens_per_s, 6), _simplicity(c)))
    unfit = sorted((c for c in evaluated if not c.fits), key=lambda c: c.need["device"] + c.need["host"])
    return fits, unfit


def search(work: Workload, machine: Machine, k: SpeedConstants) -> Choice:
    """The fitting plans, fastest predicted first. Raises PlanError (one line) for a bad tokens per step, a fixed
    key that leaves no plan fitting, or a machine nothing fits."""
    work.check()
    fits, unfit = _rank(work, machine, k)
    if fits:
        return Choice(tuple(fits), tuple(unfit))
    raise PlanError(_nothing_fits(work, machine, k, unfit))


def _fits(work: Workload, machine: Machine, k: SpeedConstants) -> Candidate | None:
    fits, _ = _rank(work, machine, k)
    return fits[0] if fits else None


def _nothing_fits(work: Workload, machine: Machine, k: SpeedConstants, unfit: list[Candidate]) -> str:
    """The one line: the least the model needs, the machine's capacities, the smallest change that fits."""
    least = min(unfit, key=lambda c: (c.need["device"] - c.plan.device_budget, c.need["host"])) if unfit else None
    if least is not None and least.plan.device_budget and "device_budget" not in work.fixed:  # the least: none kept
        plan = replace(least.plan, device_budget=0)
        least = replace(least, plan=plan, need=_needs(_estimate(plan, work, machine), machine))
    needs = (f"at least {least.need['device'] / GIB:.2f} GiB device and {least.need['host'] / GIB:.2f} GiB host RAM "
             f"({least.plan.describe()})") if least else "no plan"
    head = (f"plan='auto': nothing fits: {work.shape.num_params / 1e9:.3f}B params, {work.tokens_per_step:,} tokens "
            f"per step needs {needs}; {machine.describe()} (margin {machine.margin:.0%})")
    for key, value in work.fixed.items():  # a fixed key that leaves nothing: name it
        found = _fits(replace(work, fixed={k2: v for k2, v in work.fixed.items() if k2 != key}), machine, k)
        if found:
            return (f"{CONFIG_KEYS[key]}={value!r} (fixed in the config) leaves no plan that fits: {head}; without "
                    f"it plan='auto' fits {found.plan.describe()}")
    return f"{head}; smallest change that fits: {_smallest_change(work, machine, k, unfit)}"


def _smallest_change(work: Workload, machine: Machine, k: SpeedConstants, unfit: list[Candidate]) -> str:
    if not work.disk_path and machine.disk_bytes:
        found = _fits(replace(work, disk_path="(disk)"), machine, k)
        if found:
            return ("the optimizer state on disk (--set zero.offload_optimizer.device=disk "
                    "--set zero.offload_optimizer.path=/nvme/dir)")
    room = 1 - machine.margin
    device_ok = [c for c in unfit if c.need["device"] <= room * machine.device_bytes
                 and (machine.disk_bytes is None or c.need["disk"] <= room * machine.disk_bytes)]
    if device_ok:
        host = min(c.need["host"] for c in device_ok) / room
        return f"more host RAM: {host / GIB:.1f} GiB (has {machine.host_bytes / GIB:.1f})"
    per = work.world * work.seq_len
    if work.tokens_per_step // per % 2 == 0:  # the same tokens over twice the ranks
        found = _fits(replace(work, world=2 * work.world), replace(machine, local_ranks=2 * machine.local_ranks,
                                                                  host_bytes=2 * machine.host_bytes), k)
        if found:
            return f"another GPU: world {2 * work.world} fits ({found.plan.describe()}) with a host per GPU"
    seq = work.seq_len // 2
    while seq >= 64:
        shorter = replace(work, seq_len=seq, tokens_per_step=work.tokens_per_step // work.seq_len * seq)
        if _fits(shorter, machine, k):
            return f"fewer tokens per micro-batch: SEQ_LEN={seq} ({shorter.tokens_per_step:,} tokens per step)"
        seq //= 2
    if not unfit:
        return "none"
    least = min(c.need["device"] for c in unfit)  # unfit is in order of device + host, not of device alone
    return f"a larger device: the least any plan needs is {least / GIB:.2f} GiB"
