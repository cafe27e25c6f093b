"""The auto slice (issue 47, point 6): does plan="auto" for GPT-2 XL reach 0.95x the shipped hand-tuned config?

Two runs through train_gpt.py on mock data, each as verify.run_train_gpt runs the shipped config (stopped by SIGTERM
once `--shipped-steps` + 1 steps are logged; tokens/s over the `--shipped-steps` steps after the first logged one,
the same count in both runs, however many more a run logged before it stopped):
1. configs/gpt2_xl_zero3_offload.py, hand-tuned for one 80 GB GPU: 64 x 1 x 1024 = 65,536 tokens per step;
2. configs/gpt2_xl_auto.py, plan="auto": TOKENS_PER_STEP = 64 x 1024 = 65,536 as well, split however the planner
   chooses. Its planner's trial steps run before the first logged step: inside the run's wall seconds, outside its
   tokens/s. A fresh plan cache (ZEROGPT_PLAN_CACHE in a temporary directory) makes every run search and try, as a
   first run on a machine does.
3. memory_model against the GPU's own count: bench/plan_memory.py --in-process on auto_plan's 2L-128 grid (72
   plans, every stage, offload, micro-batch and loss; fp32), each plan's max_memory_allocated over its steps less
   what was allocated before its build, against the device memory_model predicts (issue 47.6: within 10%; the CPU
   measures this grid's offloaded plans by an op count, and five of them missed). Results in
   DIR/plan_memory_gpu.json.
The two tokens per step are read from the configs and checked equal before anything runs. Figures:
auto_tokens_per_s, auto_shipped_tokens_per_s, auto_vs_shipped (their ratio), auto_plan (the chosen plan's line,
from the run's plan.json); auto_memory_within_10 (the share of plans predicted within 10%, `_what` the counts); the
run's plan.txt (the planner's table) is copied to DIR/plan_auto.txt. Shares of the time left: 35 / 50 / 15 %. The
tiny form shrinks both configs as verify's does: 2 layers x 64 wide, fp32, `--seq` tokens per sequence, 2 sequences
per step, and measures the grid's first MEMORY_TINY_PLANS plans (on a CPU: the op count).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from gpu_slices.runner import REPO, log, run_watched
from gpu_slices.verify import SHIPPED_CONFIG, TINY_BATCH, mock_run_overrides, run_train_gpt, shipped_overrides

AUTO_CONFIG = "configs/gpt2_xl_auto.py"
WEIGHTS = dict(shipped=35, auto=50, memory=15)  # shares of the measurement time, in this order: auto's trials run
# inside its own
MEMORY_SIZE, MEMORY_FILE, MEMORY_TINY_PLANS = "2L-128", "plan_memory_gpu.json", 2
PLAN_COPY = "plan_auto.txt"


def auto_overrides(args) -> tuple[list[str], int]:
    """train_gpt.py's --set overrides for the auto config and its tokens per step: the config's TOKENS_PER_STEP (in
    tiny form the shipped config's tiny step, TINY_BATCH x its accumulation x args.seq, set as TOKENS_PER_STEP).
    No memory key is set: the planner chooses them all."""
    import zerogpt

    sets = mock_run_overrides(args)
    if args.tiny:
        shipped = zerogpt.Config.from_file(os.path.join(REPO, SHIPPED_CONFIG))
        tokens = TINY_BATCH * shipped.GRADIENT_ACCUMULATION * args.seq
        sets.append(f"TOKENS_PER_STEP={tokens}")
        return sets, tokens
    return sets, zerogpt.Config.from_file(os.path.join(REPO, AUTO_CONFIG)).TOKENS_PER_STEP


def plan_collector(out: str):
    """collect(run_dir) for run_train_gpt: copy the planner's table (plan.txt) to out/PLAN_COPY, read the chosen
    plan from plan.json (its one-line description)."""
    from zerogpt.planner.auto import PLAN_JSON, PLAN_TABLE
    from zerogpt.planner.plan import Plan

    def collect(run_dir: str) -> dict:
        got: dict = {}
        table = os.path.join(run_dir, PLAN_TABLE)
        if os.path.exists(table):
            shutil.copyfile(table, os.path.join(out, PLAN_COPY))
            got["plan_table"] = PLAN_COPY
        try:
            with open(os.path.join(run_dir, PLAN_JSON)) as f:
                saved = json.load(f)
            got.update(plan=saved["plan"], plan_line=Plan(**saved["plan"]).describe(), factors=saved.get("factors"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            got["plan_error"] = f"{PLAN_JSON}: {type(e).__name__}: {e}"[:300]
        return got
    return collect


def run(args, budget, result: dict, save) -> None:
    reserve = int(args.host_reserve_gib * 2**30)
    figures = result["figures"]
    shipped_sets, auto_sets = shipped_overrides(args), auto_overrides(args)
    if shipped_sets[1] != auto_sets[1]:
        raise ValueError(f"{SHIPPED_CONFIG} gives {shipped_sets[1]:,} tokens per step, {AUTO_CONFIG} "
                         f"{auto_sets[1]:,}: make them equal, the comparison is at the same tokens per step")
    result["tokens_per_step"] = shipped_sets[1]
    runs = (("shipped", SHIPPED_CONFIG, shipped_sets), ("auto", AUTO_CONFIG, auto_sets))
    for k, (name, config, sets) in enumerate(runs):
        log(f"  {k + 1}. {config} through train_gpt.py")
        seconds = budget.share(WEIGHTS[name], sum(WEIGHTS[n] for n, *_ in runs[k + 1:]) + WEIGHTS["memory"])
        if not budget.can_start(seconds):
            result["skipped"].append(f"{config}: not started, {seconds:.0f} s left")
            continue
        with tempfile.TemporaryDirectory(prefix="gpu_check_plan_cache_") as cache:  # no plan found before
            env = dict(ZEROGPT_PLAN_CACHE=os.path.join(cache, "plans.json"))
            collect = plan_collector(args.out) if name == "auto" else None
            res = result[name] = run_train_gpt(args, seconds, reserve, config, sets, env, collect,
                                               most=args.shipped_steps)
        if res.get("error"):
            result["skipped" if res["error"] == "timeout" else "errors"].append(f"{config}: {res['error']}")
        save()
    auto, shipped = result.get("auto", {}), result.get("shipped", {})
    figures["auto_tokens_per_s"] = auto.get("tokens_per_s")
    figures["auto_shipped_tokens_per_s"] = shipped.get("tokens_per_s")
    both = figures["auto_tokens_per_s"] and figures["auto_shipped_tokens_per_s"]
    figures["auto_vs_shipped"] = figures["auto_tokens_per_s"] / figures["auto_shipped_tokens_per_s"] if both else None
    figures["auto_plan"] = auto.get("plan_line")
    if both:
        log(f"  plan='auto' ({figures['auto_plan']}): {figures['auto_tokens_per_s']:,.0f} tok/s vs the shipped "
            f"config's {figures['auto_shipped_tokens_per_s']:,.0f} = {figures['auto_vs_shipped']:.2f}x; wall "
            f"{auto['wall_s']:.0f} s (its trials included) vs {shipped['wall_s']:.0f} s")
    run_memory(args, budget, reserve, result)
    save()


def run_memory(args, budget, reserve: int, result: dict) -> None:
    """Part 3: plan_memory.py --in-process in a watched process; result["memory"] and the figure."""
    log(f"  3. memory_model against max_memory_allocated, {MEMORY_SIZE}'s grid in one process")
    seconds = budget.share(WEIGHTS["memory"])
    if not budget.can_start(seconds):
        result["skipped"].append(f"memory: not started, {seconds:.0f} s left")
        return
    path = os.path.join(args.out, MEMORY_FILE)
    cmd = [sys.executable, os.path.join(REPO, "bench", "plan_memory.py"), "--in-process", "--sizes", MEMORY_SIZE,
           "--out", path] + (["--limit", str(MEMORY_TINY_PLANS)] if args.tiny else [])
    run = run_watched(cmd, seconds, reserve)
    memory = result["memory"] = dict(file=MEMORY_FILE, killed=run["killed"], returncode=run["returncode"],
                                     wall_s=run["wall_s"])
    try:
        with open(path) as f:
            (size,) = json.load(f)["results"]
    except (OSError, ValueError, KeyError) as e:
        memory["error"] = f"{MEMORY_FILE}: {type(e).__name__}: {e}; output: {run['output'][-300:]}"
        result["errors"].append(f"memory: {memory['error']}")
        return
    rows = [r for r in size["plans"] if "error" not in r]
    device = memory["device"] = size["device"]
    memory["failed"] = [r["plan"] for r in size["plans"] if "error" in r]
    if device is None:  # no plan ran
        memory["error"] = f"no plan measured; failed: {memory['failed'][:3]}"
        result["errors"].append(f"memory: {memory['error']}")
        return
    memory["misses"] = [dict(plan=r["plan"], measured=r["measured_device"], predicted=r["predicted_device"],
                             error_pct=r["device_error_pct"]) for r in rows if abs(r["device_error_pct"]) > 10]
    measure = rows[0]["device_measure"]
    figures = result["figures"]
    figures["auto_memory_within_10"] = device["within_10"] / device["plans"]
    figures["auto_memory_within_10_what"] = (
        f"{device['within_10']} of {device['plans']} plans of {MEMORY_SIZE}, median {device['median']:+.1f}%, "
        f"max |{device['max_abs']:.1f}|%, by {measure}" + (f"; {len(memory['failed'])} failed" if memory["failed"]
                                                           else ""))
    log(f"  memory: {figures['auto_memory_within_10_what']}")
