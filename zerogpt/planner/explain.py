"""The plan explained: one table of the chosen plan and its runners-up, predicted and measured memory and tokens/s,
and why each loser lost. Printed at start and written to the run directory (plan.txt)."""
from __future__ import annotations

from zerogpt.planner.plan import GIB, Machine, Workload
from zerogpt.planner.search import Candidate, Choice

__all__ = ["explain", "why_lost"]


def why_lost(c: Candidate, chosen: Candidate, measured: dict) -> str:
    """Why `c` is not the plan: it did not fit, ran out of memory or failed in its trial, was measured or predicted
    slower, or was not tried."""
    if not c.fits:
        return f"does not fit: {c.why_not}"
    mine, theirs = measured.get(c.plan), measured.get(chosen.plan)
    if mine is not None and mine.get("error"):
        return f"trial failed: {mine['error']}"
    if mine is not None and theirs is not None and "tokens_per_s" in mine:
        if mine["tokens_per_s"] > theirs["tokens_per_s"]:  # auto.MEASUREMENT_NOISE: offloading, for no gain measured
            return (f"offloads, within measurement noise of the chosen: {mine['tokens_per_s']:,.0f} vs "
                    f"{theirs['tokens_per_s']:,.0f} tokens/s")
        return f"measured slower: {mine['tokens_per_s']:,.0f} < {theirs['tokens_per_s']:,.0f} tokens/s"
    slowest = max(c.terms, key=c.terms.get)
    ratio = f"{c.tokens_per_s / chosen.tokens_per_s:.0%} of the chosen's predicted tokens/s"
    if c.tokens_per_s > chosen.tokens_per_s:  # the trials overruled the prediction, or it was not among them
        return f"not tried ({ratio}): alike a tried plan, or past the trials' count"
    return f"predicted slower: {ratio} (largest term: {slowest} {c.terms[slowest]:.3g} s)"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}" if n >= GIB / 10 else f"{n / GIB:.4f}"


def explain(choice: Choice, chosen: Candidate, work: Workload, machine: Machine, measured: dict | None = None,
            runners_up: int = 4, unfit: int = 2, note: str = "") -> str:
    """The table: the chosen plan first, then `runners_up` fitting plans and `unfit` of the closest that did not
    fit. `measured`: Plan -> {"device_peak", "host_peak", "tokens_per_s"} or {"error"} from the trials."""
    measured = measured or {}
    tried = [c for c in choice.ranked if c.plan in measured and c.plan != chosen.plan]
    others = [c for c in choice.ranked if c.plan not in measured and c.plan != chosen.plan]
    rows = [chosen] + tried + others[:runners_up] + list(choice.unfit[:unfit])
    head = (f"plan='auto': {work.shape.num_params / 1e6:,.1f}M params, {work.tokens_per_step:,} tokens/step "
            f"(seq {work.seq_len}, world {work.world}, {work.precision}); {machine.describe()}; "
            f"{len(choice.ranked)} of {len(choice.ranked) + len(choice.unfit)} plans fit")
    cols = f"{'':3}{'plan':58}{'dev GiB':>9}{'meas':>7}{'host GiB':>9}{'meas':>7}{'tok/s':>10}{'meas':>10}  why not"
    lines = [head] + ([note] if note else []) + [cols]
    for i, c in enumerate(rows):
        m = measured.get(c.plan, {})
        mark = "*" if c is chosen else " "
        lines.append(f"{mark:3}{c.plan.describe()[:57]:58}{_gib(c.need['device']):>9}{_gib(m.get('device_peak')):>7}"
                     f"{_gib(c.need['host']):>9}{_gib(m.get('host_peak')):>7}{c.tokens_per_s:>10,.0f}"
                     f"{format(m['tokens_per_s'], ',.0f') if 'tokens_per_s' in m else '-':>10}"
                     f"  {'chosen' if c is chosen else why_lost(c, chosen, measured)}")
    return "\n".join(lines)
