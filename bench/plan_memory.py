"""memory_model's predictions against the measured peaks, one fresh process per plan, over bench/auto_plan.py's grid
(issue 47 point 6, "memory predictions within 10%, device and host").

    python bench/plan_memory.py --out bench/results/plan_memory_cpu.json            # 8L-384, its 72 plans
    python bench/plan_memory.py --sizes 4L-256,8L-384 --out ...
    python bench/plan_memory.py --predict-again RESULTS.json --out ...   # new predictions, the same measurements
    python bench/plan_memory.py --in-process --sizes 2L-128 --out ...    # on a GPU: the device alone, one process

Each plan runs in its own interpreter, so nothing a previous plan freed is counted. The process first runs the same
plan on auto_plan's smallest model for one step (imports, op loads and thread pools are not the plan's), then takes
its resident memory as the baseline, resets the kernel's peak counter (/proc/self/clear_refs <- 5), builds the plan's
engine and trains 3 steps on random tokens, and reads the peak back (VmHWM): exact, no sampling. glibc malloc runs
with a fixed 64 KiB mmap threshold and zerogpt's keep-freed-host-memory off (as bench/step_memory.py), so resident
memory follows what is live: the peak is the live peak, not the allocator's history. It also runs with
MALLOC_PERTURB_, which writes every block as malloc hands it out, so an allocation is resident whole from the moment it
is made, as a GPU allocator counts it. Without it the kernel counts a page only once written, and a buffer made whole
and filled as the backward goes (stage 3's gradient bucket) counts only in part at the peak: 2L-128's stage-3 2x2
chunked-loss plan read 13.7 MiB that way and 16.3 MiB with every allocation whole (the in-process op count, LiveBytes,
says the same 16.3 MiB).

On a CPU run the "device" is host RAM too. Measured:
  host (both homes): VmHWM - baseline, everything the plan held at once;
  device, a plan without offload: the same peak (there is one home);
  device, an offloaded plan: the trial's CPU measure (zerogpt.planner.trial.StepClock) in a fourth step, after
    VmHWM is read: the device home's model state at the step's start, plus the peak of the bytes the step's ops on
    the training thread make until freed (LiveBytes), less what the engine holds in the host home meanwhile (at one
    rank the reduced gradient buffer becomes the host's grad shard, where a GPU run copies it out and frees the
    device's), plus the host shards a GPU would copy to the device to compute on (a CPU computes on them in place).
    The homes share memory on a CPU (memory_model.cpu_run_shared_bytes), so VmHWM cannot split them; the op count
    can. Taken for every plan without offload too, it is printed against VmHWM there: the agreement that makes it a
    measure (2026-11-28f: median -1.6 to -0.1%, at most 6.0%).
--in-process (the GPU slice `auto` runs it): every plan in this one process, the device peak alone. On CUDA that is
the caching allocator's max_memory_allocated over each step, less what was allocated before the plan's build: the
allocator counts what is live, not the heap's history, so no fresh process is needed (a warm-up plan first puts
cuBLAS's workspaces and the like in the baseline). On a CPU it is the op count above, for every plan.
Predicted: memory_model.estimate for the plan as measured (the grid and each plan from zerogpt.planner.search), with
on_gpu=False: device = totals["device"] (gpu_overhead 0: what a GPU would hold), host = host_ram (a CPU run's host
RAM: every home but disk, the bytes the two homes share on a CPU counted once). Errors are (predicted - measured) /
measured.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from zerogpt.atomic_write import write_json_atomic  # noqa: E402

MIB = 2**20
STEPS = 3
WARM = "2L-128"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _grid(size: str):
    """(workload, config, the grid's candidates as evaluated on an unlimited CPU machine)."""
    import torch

    from auto_plan import SIZES, VOCAB, config
    from model_zoo import build_model
    from zerogpt.memory_model import ModelShape
    from zerogpt.planner.config_plan import workload_from_config
    from zerogpt.planner.plan import Machine
    from zerogpt.planner.search import enumerate_plans, evaluate
    from zerogpt.planner.speed import default_constants

    cfg = config(SIZES[size])
    with torch.device("meta"):
        probe = build_model(dict(cfg.model), vocab_size=VOCAB)
    work = workload_from_config(cfg, ModelShape.from_config(probe.config), 1, probe.config)
    unlimited = Machine(device_bytes=2**50, host_bytes=2**50, on_gpu=False, name="cpu", gpu_overhead=0)
    k = default_constants(unlimited, 1e9)
    return work, cfg, [evaluate(p, work, unlimited, k) for p in enumerate_plans(work)]


def _run(size: str, index: int, ctx, steps: int) -> dict:
    """Build plan `index` of `size`'s grid, train `steps` steps and read VmHWM, then one more step under the op
    count: {"plan", "hwm", "op_device"}."""
    import torch

    from auto_plan import SEQ, VOCAB
    from model_zoo import GPTLMLoss, build_model
    from zerogpt import initialize
    from zerogpt.planner.config_plan import apply_plan
    from zerogpt.planner.trial import StepClock
    from zerogpt.trainer import Trainer
    from zerogpt.trainer.hooks.base import Hook

    _, cfg, grid = _grid(size)
    plan = grid[index].plan
    planned = apply_plan(cfg, plan)
    with torch.device("meta"):
        model = build_model(dict(planned.model), vocab_size=VOCAB)
    engine = initialize(model, dict(planned.optimizer), GPTLMLoss(shift=False), config=planned, ctx=ctx)
    out = dict(plan=plan.describe())

    class _AtStepEnd(Hook):
        def after_step(self, trainer) -> None:
            if trainer.state.step == steps:  # before the op count's step, which the peak must not see
                out["hwm"] = _status("VmHWM")
    clock = StepClock(engine.ctx.device, engine, measured_step=steps)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (plan.micro_batch, SEQ + 1), generator=g)
               for _ in range((steps + 1) * plan.accumulation)]
    Trainer(engine, hooks=[_AtStepEnd(), clock]).fit(batches, max_steps=steps + 1)
    engine.close()
    return dict(out, op_device=max(clock.device_peaks))


def child(size: str, index: int) -> dict:
    """One plan in this (fresh) process: warm up on the smallest model, then the measured run."""
    import gc

    import torch

    import zerogpt

    torch.set_num_threads(1)
    ctx = zerogpt.launch_from_torch(seed=0)
    try:
        _run(WARM, index, ctx, steps=1)
        gc.collect()
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out = _run(size, index, ctx, STEPS)
        out["peak"] = out.pop("hwm") - base
    finally:
        ctx.destroy()
    return out


def run_size_in_process(size: str, limit: int | None, log, on_result=None) -> dict:
    """The first `limit` plans (None: all) of `size`'s grid in this process, the device peak alone (the module's
    docstring, --in-process); `on_result(size_result)` after each plan, so a run cut short keeps what it measured."""
    import gc

    import torch

    import zerogpt

    work, _, grid = _grid(size)
    ctx = zerogpt.launch_from_torch(seed=0)
    cuda = ctx.device.type == "cuda"
    rows = []
    try:
        _run(WARM, 0, ctx, steps=1)
        for index, cand in enumerate(grid[:limit]):
            gc.collect()
            base = torch.cuda.memory_allocated(ctx.device) if cuda else 0
            try:
                m = _run(size, index, ctx, STEPS)
            except Exception as e:  # a plan that fails (a GPU out of memory) is a row too
                rows.append(dict(plan=cand.plan.describe(), error=f"{type(e).__name__}: {e}"[:200]))
                log(f"{size} {cand.plan.describe()}: {rows[-1]['error']}")
                continue
            row = dict(plan=m["plan"], stage=cand.plan.stage, offloaded=offloaded(cand.plan),
                       measured_device=m["op_device"] - base,
                       device_measure="max_memory_allocated" if cuda else "op count")
            rows.append(predicted_row(row, work, cand.plan))
            log(row_line(size, rows[-1]))
            if on_result is not None:
                on_result(size_result(size, work, rows))
    finally:
        ctx.destroy()
    return size_result(size, work, rows)


def measure(size: str, index: int, timeout: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_PERTURB_": "85",
           "ZEROGPT_KEEP_HOST_MEMORY": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", size, str(index)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return dict(error=(out.stderr.strip().splitlines() or ["no output"])[-1][:200])
    return json.loads(lines[-1])


def predict(work, plan) -> dict:
    """memory_model.estimate for `plan` on a CPU run (the arguments as zerogpt.planner.search passes them)."""
    from zerogpt.memory_model import estimate

    return estimate(work.shape, plan.stage, work.world, work.precision, plan.offload_optimizer, plan.offload_param,
                    work.seq_len, plan.micro_batch, plan.checkpoint, prefetch=plan.prefetch, bucket_mb=plan.bucket_mb,
                    gpu_overhead=0, accumulation=plan.accumulation,
                    optimizer_bytes_per_param=4 if plan.state_dtype == "bf16" else 8,
                    gather_per_block=work.compile, loss_chunk=work.loss_chunk if plan.chunked_loss else 0,
                    device_budget=plan.device_budget, on_gpu=False)


def offloaded(plan) -> bool:
    return plan.offload_optimizer != "none" or plan.offload_param != "none"


def error_pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def run_size(size: str, timeout: float, log) -> dict:
    work, _, grid = _grid(size)
    rows = []
    for index, cand in enumerate(grid):
        m = measure(size, index, timeout)
        if "error" in m:
            rows.append(dict(plan=cand.plan.describe(), error=m["error"]))
            log(f"{size} {cand.plan.describe()}: {m['error']}")
            continue
        off = offloaded(cand.plan)
        row = dict(plan=m["plan"], stage=cand.plan.stage, offloaded=off,
                   measured_device=m["op_device"] if off else m["peak"], measured_host=m["peak"],
                   op_device=m["op_device"], device_measure="op count" if off else "VmHWM")
        rows.append(predicted_row(row, work, cand.plan))
        log(row_line(size, rows[-1]))
    return size_result(size, work, rows)


def predicted_row(row: dict, work, plan) -> dict:
    """`row` (its measured figures) with memory_model's predictions for `plan` and their errors."""
    est = predict(work, plan)
    pred_device, pred_host = est["totals"]["device"], est["host_ram"]
    out = dict(row, predicted_device=pred_device, predicted_host=pred_host, shared=est["shared"],
               device_error_pct=error_pct(pred_device, row["measured_device"]))
    if "measured_host" in row:  # not in-process
        out["host_error_pct"] = error_pct(pred_host, row["measured_host"])
    return out


def row_line(size: str, row: dict) -> str:
    measure = row.get("device_measure", "op count" if row["offloaded"] else "VmHWM")
    host = (f", host {row['measured_host'] / MIB:.1f} predicted {row['predicted_host'] / MIB:.1f} "
            f"({row['host_error_pct']:+.0f}%)" if "measured_host" in row else "")
    return (f"{size} {row['plan']}: device {row['measured_device'] / MIB:.1f} MiB predicted "
            f"{row['predicted_device'] / MIB:.1f} ({row['device_error_pct']:+.0f}%, {measure}){host}")


def size_result(size: str, work, rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]

    def summary(key: str) -> dict | None:
        # an offloaded plan's device: the op count (not in results from before it left the host's buffers out)
        rows_ = [r for r in ok if key in r and (key == "host_error_pct" or not r["offloaded"]
                                                or r.get("device_measure") in ("op count", "max_memory_allocated"))]
        if not rows_:  # in-process: no host
            return None
        errors = [r[key] for r in rows_]
        return dict(median=statistics.median(errors), max_abs=max(map(abs, errors)),
                    within_10=sum(abs(e) <= 10 for e in errors), plans=len(errors),
                    median_by_stage={s: statistics.median(r[key] for r in rows_ if r["stage"] == s)
                                     for s in sorted({r["stage"] for r in rows_})})
    result = dict(model=size, params=work.shape.num_params, plans=rows, device=summary("device_error_pct"),
                  host=summary("host_error_pct"))
    single = [error_pct(r["op_device"], r["measured_host"]) for r in ok
              if not r["offloaded"] and "op_device" in r and "measured_host" in r]
    if single:  # the op count against VmHWM where both see the whole peak
        result["op_count_vs_vmhwm"] = dict(median=statistics.median(single), max_abs=max(map(abs, single)),
                                           plans=len(single))
    return result


def predict_again(path: str, log) -> list[dict]:
    """The results in `path` with this checkout's memory_model's predictions: the measurements as they were."""
    with open(path) as f:
        old = json.load(f)["results"]
    results = []
    for size_old in old:
        work, _, grid = _grid(size_old["model"])
        plans = {c.plan.describe(): c.plan for c in grid}
        rows = [r if "error" in r else predicted_row(r, work, plans[r["plan"]]) for r in size_old["plans"]]
        for r in rows:
            if "error" not in r:
                log(row_line(size_old["model"], r))
        results.append(size_result(size_old["model"], work, rows))
    return results


def summary_lines(results: list[dict]) -> list[str]:
    """The table printed at the end: per model, device and (not in-process) host errors."""
    def cols(x: dict | None) -> str:
        if x is None:
            return f"{'':>33}"
        return f"{x['median']:>12.1f}/{x['max_abs']:<9.1f}{x['within_10']:>6}/{x['plans']:<4}"

    def by_stage(x: dict | None) -> str:
        return "" if x is None else ", ".join(f"z{s} {v:+.0f}%" for s, v in x["median_by_stage"].items())
    lines = [f"{'model':8}{'plans':>6}{'device err med/max %':>22}{'within 10%':>11}{'host err med/max %':>20}"
             f"{'within 10%':>11}   median by stage (device | host)"]
    for r in results:
        d, h = r["device"], r["host"]
        lines.append(f"{r['model']:8}{d['plans']:>6}{cols(d)}{cols(h)}   {by_stage(d)} | {by_stage(h)}")
    for r in results:
        if "op_count_vs_vmhwm" in r:
            o = r["op_count_vs_vmhwm"]
            lines.append(f"{r['model']}: the op count against VmHWM without offload, median {o['median']:+.1f}%, "
                         f"max |{o['max_abs']:.1f}|% over {o['plans']} plans")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8L-384", help="comma-separated auto_plan model sizes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=300, help="seconds per plan's process")
    p.add_argument("--predict-again", metavar="RESULTS", default=None,
                   help="no measuring: this checkout's predictions against the measurements in RESULTS")
    p.add_argument("--in-process", action="store_true",
                   help="every plan in this process, the device alone (max_memory_allocated on CUDA)")
    p.add_argument("--limit", type=int, default=None, help="with --in-process: the first LIMIT plans of each size")
    p.add_argument("--child", nargs=2, metavar=("SIZE", "INDEX"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return 0
    start = time.perf_counter()
    log = functools.partial(print, flush=True)
    how = ("in one process, the device alone" if args.in_process else "resident whole (MALLOC_PERTURB_)")

    def save(results: list[dict]) -> None:
        if args.out:
            write_json_atomic(args.out, dict(steps=STEPS, allocations=how, results=results))
    if args.predict_again:
        results = predict_again(args.predict_again, log)
    elif args.in_process:
        results = []
        for size in args.sizes.split(","):
            results.append(run_size_in_process(size, args.limit, log,
                                               on_result=lambda partial: save(results + [partial])))
            save(results)
    else:
        results = [run_size(size, args.timeout, log) for size in args.sizes.split(",")]
    print("\ndevice: " + ("in this process, max_memory_allocated on CUDA, else the op count" if args.in_process
                          else "VmHWM without offload, the op count with it; host: VmHWM"))
    print("\n".join(summary_lines(results)))
    print(f"({time.perf_counter() - start:.0f} s)")
    save(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
