"""zerogpt on one GPU: validate the CUDA paths, then measure offloaded pretraining against DeepSpeed ZeRO-Offload.

    python bench/gpu_check.py --out DIR                    # every phase: about 37 minutes of budgets on one
                                                           # H100, plus installs and builds
    # in commands of under 10 minutes each (the device tool's limit per command; a session's 30 minutes of
    # device time hold about three of them); the minutes are the phases' budgets:
    python bench/gpu_check.py --out DIR --only env,correctness,profile                          # ~7 min
    python bench/gpu_check.py --out DIR --only no_offload                                       # ~8 min
    python bench/gpu_check.py --out DIR --only offload                                          # ~4 min
    python bench/gpu_check.py --out DIR --only shipped_config                                   # ~8 min
    python bench/gpu_check.py --out DIR --only largest --largest-variants zerogpt,deepspeed     # ~9 min
    python bench/gpu_check.py --out DIR --only largest --largest-variants zerogpt_disk,zerogpt_bf16_state
    python bench/gpu_check.py --merge DIR1 DIR2 ... --out DIR   # one summary.json from them
    python bench/gpu_check.py --out /tmp/gpucheck          # no CUDA: says what it skips, tiny forms, exit 0

Phases:
  env            torch / CUDA / NCCL / DeepSpeed versions, GPU, host RAM, which CPU Adam kernel runs
                 (DeepSpeed's op if it builds, else torch's fused Adam: no nvcc needed).
  correctness    `pytest -m gpu` on the test files with GPU tests (tests/zero/test_gpu.py: world-1 NCCL,
                 every stage x precision x offload against plain PyTorch, copy stream and eager hand-over,
                 bit-exact resume).
  offload        GPT-2 XL, seq 1024, bf16, stage 3 + CPU optimizer offload, then + param offload:
                 zerogpt, DeepSpeed ZeRO-Offload, same model/batch/seq, same run.
  largest        hidden 2560, growing depth, stage 3 + param offload, optimizer state on the host (zerogpt,
                 DeepSpeed), on disk (zerogpt_disk) or on the host in bf16 (zerogpt_bf16_state): starts at the
                 deepest model zerogpt's memory model (what preflight checks) admits, then follows the measured
                 host bytes/param; reports bytes/param, build and step seconds, and what stopped each.
  no_offload     GPT-2 small / medium / XL at stages 0-3, zerogpt and DeepSpeed, beside plain PyTorch; for XL
                 also zerogpt with compile=True, precision="fp8", both, the chunked loss (GPTConfig.chunked_loss,
                 the loss from model(x, labels=y)) and compile + chunked loss, at stages 0 and 3, and plain
                 PyTorch under torch.compile, with the chunked loss, and both: MFU, peak GPU memory, the
                 compile time and the first step's loss.
  profile        one offloaded zerogpt step of GPT-2 XL: forward, backward, device->host, CPU Adam,
                 host->device, waits (torch.profiler), as a table in DIR/profile.txt.
  shipped_config `train_gpt.py --config configs/gpt2_xl_zero3_offload.py` on mock data for a few steps, then
                 the same micro-batch x accumulation x seq through gpu_measure.py for zerogpt and DeepSpeed:
                 tokens/s, h2d/d2h bytes per step, the optimizer-step call's time, process user/sys seconds.

Measurements run in child processes (bench/gpu_measure.py: own peak GPU memory and host RSS; a crash or
OOM is a row, not the end of the run); a watchdog kills one that leaves less than --host-reserve-gib of host
RAM free, so the machine's OOM killer never fires. Each phase stops starting new measurements when its time
budget is spent and records what it skipped. DIR gets at most 5 files: gpu_check.log, summary.json,
profile.txt, pytest_gpu.xml, pytest_gpu.log.
"""
from __future__ import annotations

import os
import sys

# bench/ holds tokenize.py, which would shadow the stdlib module of that name (imported by dataclasses via
# inspect): take bench/ off the path before any other import.
_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
sys.path.insert(0, REPO)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import importlib.util  # noqa: E402
from dataclasses import asdict  # noqa: E402

import torch  # noqa: E402

# bench/ is not a package (and is off the path): load the measurement module by its file
MEASURE = os.path.join(_HERE, "gpu_measure.py")
_spec = importlib.util.spec_from_file_location("gpu_measure", MEASURE)
gpu_measure = importlib.util.module_from_spec(_spec)
sys.modules["gpu_measure"] = gpu_measure  # dataclasses look their module up here
_spec.loader.exec_module(gpu_measure)
Spec, VOCAB, format_table = gpu_measure.Spec, gpu_measure.VOCAB, gpu_measure.format_table

PHASES = ("env", "correctness", "offload", "largest", "no_offload", "profile", "shipped_config")
BUDGET_S = dict(env=100, correctness=360, offload=210, largest=540, no_offload=480, profile=75,
                shipped_config=480)  # 37 min
TINY_VOCAB = 512
# GPT-2 shapes; "largest" grows n_layer at n_embd 2560 (head dim 128)
SHAPES = dict(gpt2_small=(12, 12, 768), gpt2_medium=(24, 16, 1024), gpt2_xl=(48, 25, 1600))
TINY = dict(gpt2_small=(2, 2, 64), gpt2_medium=(3, 2, 64), gpt2_xl=(4, 2, 64))
SHIPPED_CONFIG = "configs/gpt2_xl_zero3_offload.py"


def log(msg: str) -> None:
    print(msg, flush=True)


def _child_env() -> dict:
    """This checkout first, then whatever PYTHONPATH holds (on the device: the carried DeepSpeed)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))


# -------------------------------------------------------------------------------------------------
# the parent: run each Spec in a child process with a deadline and a host-RAM watchdog

def run_watched(cmd: list[str], timeout_s: float, reserve_bytes: int) -> dict:
    """Run `cmd` in its own process group under a deadline and the host-RAM watchdog; its output, exit code,
    what killed it (None, "host_ram" or "timeout"), wall seconds and CPU user/sys seconds (getrusage of
    children: the process and every descendant it waited for, its compilers and DataLoader workers too)."""
    import psutil
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env(),
                            cwd=REPO, start_new_session=True)  # its own group: a kill takes its compilers too
    killed: list[str] = []

    def watchdog():
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if psutil.virtual_memory().available < reserve_bytes:
                killed.append("host_ram")
            elif time.monotonic() > deadline:
                killed.append("timeout")
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.2)
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    output = proc.stdout.read()
    proc.wait()
    thread.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return dict(output=output, returncode=proc.returncode, killed=killed[0] if killed else None,
                wall_s=time.monotonic() - t0, user_s=after.ru_utime - before.ru_utime,
                sys_s=after.ru_stime - before.ru_stime)


def run_specs(specs: list[Spec], timeout_s: float, reserve_bytes: int) -> list[dict]:
    """Run measurements one after another in one fresh process (one start-up for several); a crash, GPU OOM,
    host-RAM kill or timeout is a result too, and ends the process's remaining specs with the same error.
    Each result gets the whole process's wall and CPU user/sys seconds (`process`: shared by its specs)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        run = run_watched([sys.executable, MEASURE, json.dumps([asdict(s) for s in specs]), result_path],
                          timeout_s, reserve_bytes)
        results = []
        if os.path.exists(result_path):
            with open(result_path) as f:
                results = json.load(f)
    output = run.pop("output")
    if len(results) < len(specs) or any("error" in r for r in results):
        log("    worker output (last lines):\n      " + "\n      ".join(output.strip().splitlines()[-12:]))
    error = run["killed"] or f"exit {run['returncode']}"
    results += [dict(spec=asdict(s), error=error) for s in specs[len(results):]]
    for r in results:
        r["process"] = dict(run, specs=len(specs))
    for spec, result in zip(specs, results):
        if "error" in result:
            log(f"    {spec.label}: FAILED ({result['error']}) {result.get('detail', '')[:300]}")
        else:
            log(f"    {spec.label}: {result['tokens_per_s']:,.0f} tok/s, {result['tflops']:.1f} TFLOPS"
                + (f", MFU {result['mfu']:.1%}" if result["mfu"] else "")
                + (f", GPU peak {result['peak_gpu_gib']:.1f} GiB" if result["peak_gpu_gib"] is not None else "")
                + f", host peak {result['peak_host_gib']:.1f} GiB, {result['step_s']:.2f} s/step")
    return results


# -------------------------------------------------------------------------------------------------
# the phases: each fills its part of the summary

class Phase:
    """A phase's clock: specs start only while its budget lasts; what did not start is recorded."""

    def __init__(self, name: str, args, summary: dict) -> None:
        self.name, self.args, self.summary = name, args, summary
        self.deadline = time.monotonic() + BUDGET_S[name] * args.budget_scale

    def run(self, spec: Spec, max_s: float | None = None) -> dict | None:
        return self.run_many([spec], max_s)[0]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run_many(self, specs: list[Spec], max_s: float | None = None) -> list[dict | None]:
        """Measure `specs` in one process (given at most `max_s` seconds); None for each when the phase's budget
        is already spent."""
        prepare_cpu_adam(self.args)
        left = min(self.left(), max_s or float("inf"))
        if left < 15:
            for spec in specs:
                self.summary["skipped"].append(f"{self.name}: {spec.label} (phase budget spent)")
                log(f"    {spec.label}: not started, the phase's {BUDGET_S[self.name] * self.args.budget_scale:.0f}"
                    f" s budget is spent")
            return [None] * len(specs)
        return run_specs(specs, left, int(self.args.host_reserve_gib * 2**30))


def _remove_stale_build_locks(since: float) -> None:
    """torch's JIT build lock of the cpu_adam op, left by the build child we killed (created after `since`):
    it would make every later build wait forever. Only on a machine this check has to itself (the GPU)."""
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    for lock in glob.glob(os.path.join(root, "**", "cpu_adam", "lock"), recursive=True):
        if os.path.getmtime(lock) >= since:
            os.remove(lock)
            log(f"  removed the stale build lock {lock}")


def prepare_cpu_adam(args) -> dict:
    """Build DeepSpeed's CPU Adam op once, here, before any measurement needs it; say which kernel runs.

    In a child process with a deadline: a build can take minutes. If it fails, the measurements run
    zerogpt on torch's fused Adam (ZEROGPT_CPU_ADAM=torch), the fallback that needs no compiler. A worker
    killed mid-build would leave torch's build lock behind and hang every later build, so workers never
    build: tiny runs (a shared CPU box) skip the build altogether.
    """
    if getattr(args, "cpu_adam", None) is not None:
        return args.cpu_adam
    if args.tiny:
        adam = dict(deepspeed_op_error="not attempted in tiny mode", fallback="torch-fused", auto="torch-fused")
    else:
        code = ("import json\nfrom zerogpt.optim import cpu_adam_backend\nout = {}\n"
                "try:\n    out['deepspeed_op'] = cpu_adam_backend('deepspeed')\n"
                "except Exception as e:\n    out['deepspeed_op_error'] = f'{type(e).__name__}: {e}'[:400]\n"
                "out['fallback'] = cpu_adam_backend('torch')\nout['auto'] = cpu_adam_backend()\n"
                "print(json.dumps(out))")
        started = time.time()
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_child_env(), cwd=REPO, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=BUDGET_S["env"])
            adam = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else dict(
                deepspeed_op_error=" | ".join(err.strip().splitlines()[-2:]))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its compilers
            proc.communicate()
            _remove_stale_build_locks(started)
            adam = dict(deepspeed_op_error=f"the build did not finish in {BUDGET_S['env']} s")
    adam["deepspeed_op_built"] = adam.get("deepspeed_op") == "deepspeed"
    if not adam["deepspeed_op_built"]:
        os.environ["ZEROGPT_CPU_ADAM"] = "torch"  # inherited by the workers
    args.cpu_adam = adam
    return adam


def phase_env(args, summary: dict) -> None:
    import psutil

    cuda = torch.cuda.is_available()
    env = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
               cuda_available=cuda, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
               gpu=torch.cuda.get_device_name(0) if cuda else None,
               gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
               host_ram_gib=psutil.virtual_memory().total / 2**30, cpus=os.cpu_count(),
               nvcc=shutil.which("nvcc"), ninja=shutil.which("ninja"))
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception as e:  # not installed, or broken against this torch
        env["deepspeed"], env["deepspeed_error"] = None, f"{type(e).__name__}: {e}"[:300]
    adam = prepare_cpu_adam(args)
    env["cpu_adam"] = adam
    summary["env"] = env
    summary["device"] = env["gpu"] or f"cpu ({platform.processor() or platform.machine()}, no CUDA)"
    log(f"  torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, DeepSpeed {env['deepspeed']}, "
        f"GPU {env['gpu']}, host RAM {env['host_ram_gib']:.0f} GiB, {env['cpus']} CPUs, nvcc {env['nvcc']}")
    log(f"  CPU Adam: DeepSpeed op built: {adam['deepspeed_op_built']}; runs: {adam.get('auto')}; "
        f"fallback: {adam.get('fallback')} {adam.get('deepspeed_op_error', '')}")


def phase_correctness(args, summary: dict) -> None:
    env = _child_env()
    # only the files that hold GPU tests: the others need packages (the data pipeline's) the device may lack
    files = sorted(os.path.relpath(os.path.join(d, f), REPO) for d, _, names in os.walk(os.path.join(REPO, "tests"))
                   for f in names if f.endswith(".py") and "mark.gpu" in open(os.path.join(d, f)).read())
    base = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-p", "no:cacheprovider", "-q"]
    if not torch.cuda.is_available():  # collect them at least: they import and parametrize
        res = subprocess.run(base + ["--collect-only"], capture_output=True, text=True, cwd=REPO, env=env,
                             timeout=BUDGET_S["correctness"] * args.budget_scale)
        line = next((ln for ln in res.stdout.splitlines()[::-1] if "collected" in ln), res.stdout[-200:])
        summary["correctness"] = dict(ran=False, collected=line.strip(), collect_rc=res.returncode)
        log(f"  no CUDA: GPU tests not run; collected: {line.strip()}")
        return
    xml = os.path.join(args.out, "pytest_gpu.xml")
    timed_out = False
    with open(os.path.join(args.out, "pytest_gpu.log"), "w") as out:
        try:
            subprocess.run(base + ["-rfE", f"--junitxml={xml}"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                           env=env, timeout=BUDGET_S["correctness"] * args.budget_scale)
        except subprocess.TimeoutExpired:
            timed_out = True
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    if os.path.exists(xml):
        import xml.etree.ElementTree as ET

        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    # a run that timed out, wrote no report or passed nothing (every GPU test skipped) proved nothing: one more
    failed = counts["failures"] + counts["errors"] + (1 if timed_out or not os.path.exists(xml) or passed <= 0 else 0)
    summary["correctness"] = dict(ran=True, timed_out=timed_out, passed=passed, **counts)
    summary["cuda_checks_failed"] = failed
    log(f"  pytest -m gpu: {counts}, timed out: {timed_out} -> cuda_checks_failed = {failed} "
        f"(details: pytest_gpu.log)")


def _xl(args) -> tuple:
    return (TINY if args.tiny else SHAPES)["gpt2_xl"]


def phase_offload(args, summary: dict) -> None:
    phase, rows = Phase("offload", args, summary), []
    for offload in ("cpu", "cpu+param"):
        for system in [s for s in ("zerogpt", "deepspeed") if s in args.systems]:
            spec = Spec(system, _xl(args), stage=3, offload=offload, batch=args.offload_batch, seq=args.seq,
                        steps=args.steps, warmup=args.warmup, checkpoint=True, vocab=args.vocab,
                        label=f"{system} gpt2_xl stage 3 offload={offload} b{args.offload_batch}x{args.seq}")
            rows.append(phase.run(spec))
    summary["offload_rows"] = [r for r in rows if r]
    for offload, key in (("cpu", "offload_gpt2_xl"), ("cpu+param", "offload_gpt2_xl_param")):
        got = {r["spec"]["system"]: r for r in summary["offload_rows"]
               if r["spec"]["offload"] == offload and "error" not in r}
        summary[key] = {f"{s}_{m}": got[s][m] if s in got else None for s in ("zerogpt", "deepspeed")
                        for m in ("tokens_per_s", "tflops", "mfu", "peak_gpu_gib", "peak_host_gib")}
        z, d = summary[key]["zerogpt_tokens_per_s"], summary[key]["deepspeed_tokens_per_s"]
        summary[key]["zerogpt_over_deepspeed"] = z / d if z and d else None


LARGEST_VARIANTS = dict(  # name: (system, zerogpt's optimizer home, zero.offload_optimizer.state_dtype)
    zerogpt=("zerogpt", "cpu", None), deepspeed=("deepspeed", "cpu", None),
    zerogpt_disk=("zerogpt", "disk", None), zerogpt_bf16_state=("zerogpt", "cpu", "bf16"))


def estimate_bytes(layers: int, n_head: int, n_embd: int, args, optimizer_home: str, state_dtype: str | None) -> dict:
    """zerogpt's memory model (zerogpt/memory_model.py estimate: what preflight and zerogpt_tools.estimate use) for
    stage 3 + param offload, bf16 (fp32 on CPU), activation checkpointing: bytes on the host, the device and the
    disk; state_dtype bf16 holds Adam's moments in 4 bytes/param instead of 8."""
    from zerogpt.memory_model import ModelShape, estimate

    shape = ModelShape(layers=layers, hidden=n_embd, heads=n_head, vocab=args.vocab, positions=args.seq)
    est = estimate(shape, 3, 1, "fp32" if args.tiny else "bf16", optimizer_home, "cpu", seq_len=args.seq,
                   batch=args.largest_batch, checkpoint=True,
                   optimizer_bytes_per_param=4 if state_dtype == "bf16" else 8)
    return dict(est["totals"], params=est["num_params"])


def largest_start(n_head: int, n_embd: int, args, optimizer_home: str, state_dtype: str | None,
                  host_bytes: float, device_bytes: float | None, disk_bytes: float | None) -> dict:
    """The deepest model the memory model admits within host RAM (times --largest-overhead, the measured host
    bytes over the estimate), device memory and disk: where the search starts."""
    def fits(layers: int) -> bool:
        est = estimate_bytes(layers, n_head, n_embd, args, optimizer_home, state_dtype)
        return (est["host"] * args.largest_overhead <= host_bytes
                and (device_bytes is None or est["device"] <= device_bytes)
                and (disk_bytes is None or est["disk"] <= disk_bytes))
    lo, hi = 0, 1
    while fits(hi) and hi < 4096:  # doubling, then bisection: a handful of pure-arithmetic calls
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    est = estimate_bytes(max(lo, 1), n_head, n_embd, args, optimizer_home, state_dtype)
    return dict(layers=lo, params=est["params"], est_host_gib=est["host"] / 2**30,
                est_host_bytes_per_param=est["host"] / est["params"], est_device_gib=est["device"] / 2**30,
                est_disk_gib=est["disk"] / 2**30)


def _fs_type(path: str) -> str | None:
    """The filesystem type /proc/mounts gives for `path` (tmpfs would put the "disk" tier in RAM)."""
    best, fs = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mount, kind = line.split()[1:3]
                if os.path.abspath(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                    best, fs = mount, kind
    except OSError:
        pass
    return fs


def phase_largest(args, summary: dict) -> None:
    """The largest GPT (hidden 2560, growing depth) each variant trains with every model state off the device.

    The first size tried is the deepest the memory model admits (zerogpt/memory_model.py, what preflight
    checks) within the host RAM free now less --host-reserve-gib, the estimate scaled by --largest-overhead; a
    size that trains gives its measured host bytes/param (peak RSS / params), which sets the next size; a size
    that fails halves the gap to the last one that trained. Each variant gets an equal share of what is left of
    the budget, so a slow build does not starve the others."""
    from zerogpt.preflight_memory import available_host_bytes, free_disk_bytes

    phase, out = Phase("largest", args, summary), {}
    n_head, n_embd = (2, 64) if args.tiny else (20, 2560)
    per_layer = 12 * n_embd**2 + 13 * n_embd
    available, source = available_host_bytes()
    host_bytes = max(available - args.host_reserve_gib * 2**30, 0)
    device_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    variants = [v for v in args.largest_variants if LARGEST_VARIANTS[v][0] in args.systems]
    for v in args.largest_variants:
        if v not in variants:
            out[v] = dict(error=f"{LARGEST_VARIANTS[v][0]} is not in --systems {','.join(args.systems)}")
    for k, name in enumerate(variants):
        system, home, state_dtype = LARGEST_VARIANTS[name]
        disk_path = os.path.join(args.disk_path, name) if home == "disk" else None
        if disk_path:
            os.makedirs(disk_path, exist_ok=True)
        start = largest_start(n_head, n_embd, args, home, state_dtype, host_bytes, device_bytes,
                              free_disk_bytes(disk_path) if disk_path else None)
        share = phase.left() / (len(variants) - k)
        deadline = time.monotonic() + share
        tried, best, first_fail = {}, None, None
        cap = args.largest_max_layers or start["layers"]
        depth = max(1, min(start["layers"], cap - 1 if args.tiny else cap))  # tiny: room for one size more
        for _ in range(args.largest_tries):
            est = estimate_bytes(depth, n_head, n_embd, args, home, state_dtype)
            spec = Spec(system, (depth, n_head, n_embd), stage=3, offload=f"{home}+param", batch=args.largest_batch,
                        seq=args.seq, steps=1, warmup=1, checkpoint=True, meta_init=True, vocab=args.vocab,
                        offload_path=disk_path, state_dtype=state_dtype,
                        label=f"{name} {depth}L x {n_embd} ({est['params'] / 1e9:.2f}B)")
            r = phase.run(spec, max_s=deadline - time.monotonic())
            if disk_path:
                shutil.rmtree(disk_path, ignore_errors=True)
                os.makedirs(disk_path, exist_ok=True)
            if r is None:
                break
            r["est_host_gib"] = est["host"] / 2**30
            if "error" not in r:
                r["host_bytes_per_param"] = r["peak_host_gib"] * 2**30 / r["params"]
                r["build_host_bytes_per_param"] = r["build_peak_host_gib"] * 2**30 / r["params"]
            tried[depth] = r
            if "error" in r:
                first_fail = depth if first_fail is None else min(first_fail, depth)
            elif best is None or depth > best:
                best = depth
            if first_fail is None:  # trained: the depth its measured bytes/param would fill the host with
                fixed = r["params"] - depth * per_layer
                measured = max(r["host_bytes_per_param"], r["build_host_bytes_per_param"])
                depth = max(depth + 1, int((host_bytes / measured - fixed) / per_layer))
                if args.largest_max_layers:
                    depth = min(depth, args.largest_max_layers)
            elif best is None:
                depth = max(1, int(depth * 0.7))
            else:
                depth = (best + first_fail) // 2
            if depth in tried or depth == best:
                break
        if disk_path:
            shutil.rmtree(disk_path, ignore_errors=True)
        rows = list(tried.values())
        b = tried.get(best, {})
        out[name] = dict(system=system, optimizer_home=home, state_dtype=state_dtype, layers=best,
                         params=b.get("params"), host_bytes_per_param=b.get("host_bytes_per_param"),
                         build_s=b.get("build_s"), step_s=b.get("step_s"), peak_host_gib=b.get("peak_host_gib"),
                         bounded_by=tried[first_fail].get("error") if first_fail else "not reached (tries or budget)",
                         estimate=start, host_bytes_free_gib=host_bytes / 2**30, host_bytes_source=source,
                         disk_path=disk_path, disk_fs=_fs_type(disk_path) if disk_path else None, rows=rows)
        if not rows and not tried:
            out[name]["error"] = "not started: the phase's budget is spent"
        errors = [f"{r['error']}: {r.get('detail', '')}"[:300] for r in rows if "error" in r]
        if errors:
            out[name]["errors"] = errors
        log(f"  {name}: largest {best} layers = {out[name]['params']} params, "
            + (f"{out[name]['host_bytes_per_param']:.1f} host B/param, build {b['build_s']:.0f} s, "
               f"step {b['step_s']:.2f} s; " if b and "error" not in b else "")
            + f"the next size failed with {out[name]['bounded_by']}; the estimate admitted {start['layers']} layers "
              f"({start['est_host_bytes_per_param']:.1f} B/param x {args.largest_overhead} overhead)")
    summary["largest"] = out
    summary["largest_params"] = out.get("zerogpt", {}).get("params")


# The rows beside the eager bf16 ones for GPT-2 XL: (system, label, precision, compile, chunked_loss), each at
# stages 0 and 3 (torch: once), in this order, in one process per system (a timeout there ends the rows after it,
# so torch's costliest compile, the whole model with the chunked head, goes last).
XL_VARIANTS = (
    ("zerogpt", "compile", None, True, False), ("zerogpt", "fp8", "fp8", False, False),
    ("zerogpt", "fp8+compile", "fp8", True, False), ("zerogpt", "chunked loss", None, False, True),
    ("zerogpt", "compile+chunked loss", None, True, True),
    ("torch", "compile", None, True, False), ("torch", "chunked loss", None, False, True),
    ("torch", "compile+chunked loss", None, True, True))
TINY_LOSS_CHUNK = 32  # tokens per chunk of the tiny chunked rows: 4 chunks of a 2 x 64 micro-batch


def phase_no_offload(args, summary: dict) -> None:
    """XL first (the figure the goals name), with its compile, FP8 and chunked-loss rows at stages 0 and 3, then
    medium and small; one process per system and model, and one for a system's XL variants (a key the engine
    rejects or a failed compile is an error row, and the rows after it still run). torch.compile's on-disk caches
    outlive a process: the compile time is that of a cold cache only on a fresh machine."""
    phase, rows = Phase("no_offload", args, summary), []
    batches = dict(gpt2_small=16, gpt2_medium=16, gpt2_xl=8) if not args.tiny else dict.fromkeys(SHAPES, 2)

    def spec(system, name, stage, precision=None, compile=False, chunked_loss=False, variant="eager"):
        shape, batch = (TINY if args.tiny else SHAPES)[name], batches[name]
        chunk = TINY_LOSS_CHUNK if args.tiny and chunked_loss else None  # None: GPTConfig's 256 tokens
        return Spec(system, shape, stage=stage, batch=batch, seq=args.seq, steps=args.steps + 2, warmup=args.warmup,
                    vocab=args.vocab, precision=precision, compile=compile, chunked_loss=chunked_loss,
                    loss_chunk_size=chunk,
                    label=f"{system} {name}" + ("" if system == "torch" else f" stage {stage}")
                    + ("" if variant == "eager" else f" {variant}") + f" b{batch}x{args.seq}")

    for name in [m for m in ("gpt2_xl", "gpt2_medium", "gpt2_small") if m in args.no_offload_models]:
        for system in [s for s in ("zerogpt", "deepspeed", "torch") if s in args.systems]:
            stages = [0] if system == "torch" else args.no_offload_stages
            rows += [dict(r, model=name, variant="eager")
                     for r in phase.run_many([spec(system, name, stage) for stage in stages]) if r]
        if name != "gpt2_xl" or not args.xl_variants:
            continue
        for system in [s for s in ("zerogpt", "torch") if s in args.systems]:
            todo = [(variant, spec(system, name, stage, precision, compile, chunked, variant))
                    for sys_, variant, precision, compile, chunked in XL_VARIANTS if sys_ == system
                    for stage in ([0] if system == "torch" else [t for t in (0, 3) if t in args.no_offload_stages])]
            results = phase.run_many([s for _, s in todo]) if todo else []
            rows += [dict(r, model=name, variant=variant) for (variant, _), r in zip(todo, results) if r]
    summary["no_offload_rows"] = rows
    xl = [r for r in rows if r["model"] == "gpt2_xl" and r["spec"]["system"] == "zerogpt" and r.get("mfu")
          and r["variant"] == "eager"]
    best = max(xl, key=lambda r: r["mfu"], default=None)
    summary["mfu_gpt2_xl_no_offload"] = best["mfu"] if best else None
    summary["mfu_gpt2_xl_no_offload_stage"] = best["spec"]["stage"] if best else None
    # compile, FP8 and the chunked loss beside eager: MFU, peak GPU memory (what the chunked loss saves), the
    # compile time (first step's seconds over the eager row's: tracing, codegen and autotuning) and the first
    # step's loss (a chunked row's should be its plain twin's, up to summation order)
    eager_first = {(r["spec"]["system"], r["spec"]["stage"]): r.get("first_step_s") for r in rows
                   if r["model"] == "gpt2_xl" and r["variant"] == "eager" and "error" not in r}
    table = []
    for r in rows:
        if r["model"] != "gpt2_xl" or r["spec"]["stage"] not in (0, 3):
            continue
        key = (r["spec"]["system"], r["spec"]["stage"])
        first, base = r.get("first_step_s"), eager_first.get(key)
        table.append(dict(system=key[0], stage=key[1], variant=r["variant"], mfu=r.get("mfu"),
                          tflops=r.get("tflops"), tokens_per_s=r.get("tokens_per_s"),
                          peak_gpu_gib=r.get("peak_gpu_gib"), first_step_s=first,
                          first_loss=r["losses"][0] if r.get("losses") else None,
                          chunked_loss_ran=r.get("chunked_loss_ran"),
                          compile_s=first - base if r["spec"]["compile"] and first is not None and base is not None
                          else None, error=(f"{r['error']}: {r.get('detail', '')}"[:300] if "error" in r else None)))
    summary["no_offload_gpt2_xl_variants"] = table


def _shipped_shape(args) -> dict:
    """The shipped config's micro-batch, accumulation, sequence and ZeRO knobs (tiny: its shape shrunk)."""
    import zerogpt

    cfg = zerogpt.Config.from_file(os.path.join(REPO, SHIPPED_CONFIG))
    zero = dict(cfg.zero)
    strategy = zero.get("shard_strategy")
    out = dict(batch=cfg.BATCH_SIZE, accum=cfg.GRADIENT_ACCUMULATION, seq=cfg.SEQ_LEN, stage=zero["stage"],
               bucket_mb=getattr(strategy, "bucket_mb", None), prefetch=zero.get("prefetch"),
               offload="cpu+param" if dict(zero.get("offload_param") or {}).get("device") == "cpu" else "cpu",
               shape=SHAPES["gpt2_xl"], precision=None, overrides=[])
    if args.tiny:
        out.update(batch=1, accum=2, seq=args.seq, shape=TINY["gpt2_xl"], precision="fp32")
        n_layer, n_head, n_embd = TINY["gpt2_xl"]
        out["overrides"] = [f"model.n_layer={n_layer}", f"model.n_head={n_head}", f"model.n_embd={n_embd}",
                            f"model.max_position_embeddings={args.seq}", f"SEQ_LEN={args.seq}", "BATCH_SIZE=1",
                            "GRADIENT_ACCUMULATION=2", "precision=fp32"]
    return out


def _train_records(path: str, skip: int, tokens_per_step: int) -> dict:
    """metrics.jsonl's train records after the first `skip` (log_interval 1: one per step): tokens/s over them,
    each step's seconds (tokens per step / the record's tokens/s, which excludes hook time), h2d/d2h bytes."""
    with open(path) as f:
        recs = [r for r in map(json.loads, f) if r.get("split") == "train"]
    timed = recs[skip:]
    out = dict(records=len(recs), timed_steps=len(timed))
    if not timed:
        return out
    step_s = [tokens_per_step / r["tokens_per_s"] for r in timed]
    out.update(step_s=step_s, tokens_per_s=tokens_per_step * len(timed) / sum(step_s),
               tflops=sum(r["tflops"] or 0 for r in timed) / len(timed),
               h2d_bytes=[r.get("h2d_bytes") for r in timed], d2h_bytes=[r.get("d2h_bytes") for r in timed],
               host_step_s=[r.get("host_step_s") for r in timed],
               host_rss_mib_max=max((r.get("mem") or {}).get("host_rss_mb") or 0 for r in timed),
               device_peak_mib_max=max((r.get("mem") or {}).get("device_peak_mb") or 0 for r in timed),
               losses=[r["loss"] for r in recs])
    return out


def phase_shipped_config(args, summary: dict) -> None:
    """configs/gpt2_xl_zero3_offload.py as a user runs it (train_gpt.py, mock data), then the same micro-batch x
    accumulation x seq through gpu_measure.py for zerogpt and DeepSpeed ZeRO-Offload, which also time the
    optimizer-step call (host_step_s). Issue 29 point 5."""
    phase, shipped = Phase("shipped_config", args, summary), _shipped_shape(args)
    prepare_cpu_adam(args)  # before train_gpt.py too: without DeepSpeed's op it runs torch's fused Adam
    tokens_per_step = shipped["batch"] * shipped["accum"] * shipped["seq"]
    out = dict(config=SHIPPED_CONFIG, batch=shipped["batch"], accum=shipped["accum"], seq=shipped["seq"],
               tokens_per_step=tokens_per_step, vocab=args.vocab,
               host_step_note="train_gpt's host_step_s: metrics.jsonl's, the seconds of the chunk steps of the "
                              "last finished step (behind the next forward on a GPU: the previous step's); "
                              "gpu_measure's host_step_s: the wall seconds of the optimizer-step call at the "
                              "accumulation boundary with the device synchronized before and after (the host work "
                              "the backward did not hide)")
    # 1. train_gpt.py: warmup 1 step (untimed: its record is dropped), then the timed ones; eval 1 batch at the
    #    start and the end, and the end's checkpoint (no key turns it off), all outside the records' times
    out_dir = tempfile.mkdtemp(prefix="gpu_check_shipped_")
    sets = ["data.mock=true", f"data.vocab_size={args.vocab}", f"train.max_steps={args.shipped_steps + 1}",
            "train.log_interval=1", "train.eval_iters=1", "lr_scheduler.warmup_steps=1",
            f"train.output_dir={out_dir}", *shipped["overrides"]]
    cmd = [sys.executable, os.path.join(REPO, "train_gpt.py"), "--config", SHIPPED_CONFIG,
           *[a for kv in sets for a in ("--set", kv)]]
    out["train_gpt_command"] = " ".join(cmd[1:])
    left = phase.left()
    if left < 15:
        summary["skipped"].append("shipped_config: train_gpt.py (phase budget spent)")
        out["train_gpt"] = dict(error="not started: the phase's budget is spent")
    else:
        log(f"  {out['train_gpt_command']}")
        run = run_watched(cmd, min(left, args.shipped_train_s), int(args.host_reserve_gib * 2**30))
        output = run.pop("output")
        res = dict(process=run, **{k: v for k, v in run.items() if k in ("wall_s", "user_s", "sys_s")})
        metrics = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            res.update(_train_records(metrics, skip=1, tokens_per_step=tokens_per_step))
        if run["killed"] or run["returncode"] != 0 or not res.get("timed_steps"):
            res["error"] = run["killed"] or f"exit {run['returncode']}"
            res["detail"] = "\n".join(output.strip().splitlines()[-8:])[-1500:]
            log("    train_gpt.py output (last lines):\n      " + "\n      ".join(output.strip().splitlines()[-12:]))
        out["train_gpt"] = res
        if res.get("tokens_per_s"):
            log(f"    train_gpt.py: {res['tokens_per_s']:,.0f} tok/s over {res['timed_steps']} steps, h2d "
                f"{res['h2d_bytes'][-1]}, d2h {res['d2h_bytes'][-1]} bytes/step; process user {res['user_s']:.0f} s, "
                f"sys {res['sys_s']:.0f} s, wall {res['wall_s']:.0f} s")
    shutil.rmtree(out_dir, ignore_errors=True)  # the checkpoint (about 22 GB for GPT-2 XL)
    # 2. the same batch shape through gpu_measure.py, each system in its own process (its own CPU times) and
    #    with an equal share of what is left, so a slow zerogpt build does not leave DeepSpeed out
    for k, system in enumerate(("zerogpt", "deepspeed")):
        if system not in args.systems:
            out[system] = dict(error=f"{system} is not in --systems {','.join(args.systems)}")
            continue
        extra = dict(bucket_mb=shipped["bucket_mb"], prefetch=shipped["prefetch"]) if system == "zerogpt" else {}
        spec = Spec(system, shipped["shape"], stage=shipped["stage"], offload=shipped["offload"],
                    batch=shipped["batch"], accum=shipped["accum"], seq=shipped["seq"], steps=args.shipped_steps, warmup=1,
                    checkpoint=True, vocab=args.vocab, precision=shipped["precision"], time_step=True,
                    label=f"{system} shipped config {shipped['batch']}x{shipped['seq']} x {shipped['accum']} accum",
                    **extra)
        r = phase.run(spec, max_s=phase.left() / (2 - k))
        out[system] = r if r else dict(error="not started: the phase's budget is spent")
    z, d = out["zerogpt"].get("tokens_per_s"), out["deepspeed"].get("tokens_per_s")
    out["zerogpt_over_deepspeed"] = z / d if z and d else None
    summary["shipped_config"] = out


def phase_profile(args, summary: dict) -> None:
    path = os.path.join(args.out, "profile.txt")
    spec = Spec("zerogpt", _xl(args), stage=3, offload="cpu", batch=args.offload_batch, seq=args.seq, steps=1,
                warmup=2, checkpoint=True, profile_to=path, vocab=args.vocab,
                label=f"zerogpt gpt2_xl stage 3 offload=cpu b{args.offload_batch}x{args.seq}")
    r = Phase("profile", args, summary).run(spec)
    summary["profile"] = (r or {}).get("profile") or (r or {}).get("error")
    if os.path.exists(path):
        with open(path) as f:
            log("\n".join(f.read().splitlines()[:16]))


# -------------------------------------------------------------------------------------------------
# summary, tables, merge

def rows_table(rows: list[dict]) -> str:
    def cell(r, key, fmt):
        return "" if r.get(key) is None else fmt.format(r[key])
    def variant(spec):
        return " ".join(filter(None, [spec.get("precision"), "compile" if spec.get("compile") else None,
                                      "chunked loss" if spec.get("chunked_loss") else None,
                                      spec.get("state_dtype") and f"state {spec['state_dtype']}"]))
    return format_table(
        ["system", "model", "stage", "offload", "variant", "batch x seq x accum", "tok/s", "TFLOPS", "MFU",
         "GPU peak GiB", "host peak GiB", "error"],
        [[r["spec"]["system"], r.get("model", "x".join(map(str, r["spec"]["shape"]))), r["spec"]["stage"],
          r["spec"]["offload"], variant(r["spec"]),
          f"{r['spec']['batch']}x{r['spec']['seq']}x{r['spec'].get('accum', 1)}", cell(r, "tokens_per_s", "{:,.0f}"),
          cell(r, "tflops", "{:.1f}"), cell(r, "mfu", "{:.1%}"), cell(r, "peak_gpu_gib", "{:.1f}"),
          cell(r, "peak_host_gib", "{:.1f}"), r.get("error", "")] for r in rows])


def empty_summary() -> dict:
    return dict(device=None, cuda_checks_failed=None,
                offload_gpt2_xl=dict(zerogpt_tokens_per_s=None, deepspeed_tokens_per_s=None, zerogpt_tflops=None,
                                     deepspeed_tflops=None),
                largest_params=None, mfu_gpt2_xl_no_offload=None, phases_run=[], skipped=[], tiny=False)


def merge(dirs: list[str]) -> dict:
    """One summary from several runs: each run contributes the keys of the phases it ran (later runs win);
    the lists of phases run and of what was skipped are joined."""
    out = empty_summary()
    for d in dirs:
        with open(os.path.join(d, "summary.json")) as f:
            part = json.load(f)
        for name in part.get("phases_run", []):
            out.update({key: part[key] for key in PHASE_KEYS[name] if key in part})
        out["phases_run"] += [p for p in part.get("phases_run", []) if p not in out["phases_run"]]
        out["skipped"] += part.get("skipped", [])
        out["tiny"] = out["tiny"] or part.get("tiny", False)
    return out


PHASE_FNS = dict(env=phase_env, correctness=phase_correctness, offload=phase_offload, largest=phase_largest,
                 no_offload=phase_no_offload, profile=phase_profile, shipped_config=phase_shipped_config)
PHASE_KEYS = dict(env=["env", "device"], correctness=["correctness", "cuda_checks_failed"],
                  offload=["offload_rows", "offload_gpt2_xl", "offload_gpt2_xl_param"],
                  largest=["largest", "largest_params"],
                  no_offload=["no_offload_rows", "mfu_gpt2_xl_no_offload", "mfu_gpt2_xl_no_offload_stage",
                              "no_offload_gpt2_xl_variants"],
                  profile=["profile"], shipped_config=["shipped_config"])


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> None:
        for stream in self.streams:
            stream.write(s)
            stream.flush()

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the log, summary.json and profile.txt")
    p.add_argument("--only", default=",".join(PHASES), help=f"comma-separated phases of {', '.join(PHASES)}")
    p.add_argument("--systems", default=None,
                   help="systems the tables measure (zerogpt,deepspeed,torch; tiny: zerogpt,torch, since DeepSpeed's "
                        "CPU Adam op would JIT-build inside a measurement)")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR", help="merge these runs' summaries into --out")
    p.add_argument("--tiny", action="store_true", help="tiny models and steps (the default without CUDA)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (1024; tiny: 64)")
    p.add_argument("--offload-batch", type=int, default=None, help="micro-batch of the offload runs (16; tiny: 2)")
    p.add_argument("--largest-batch", type=int, default=None, help="micro-batch of the largest-model runs (4)")
    p.add_argument("--largest-tries", type=int, default=2, help="sizes tried per variant in the largest phase (2)")
    p.add_argument("--largest-variants", default=",".join(LARGEST_VARIANTS),
                   help=f"what the largest phase sizes, in order: {', '.join(LARGEST_VARIANTS)} (zerogpt_disk: Adam "
                        "state on disk; zerogpt_bf16_state: zero.offload_optimizer.state_dtype='bf16')")
    p.add_argument("--largest-overhead", type=float, default=1.45,
                   help="measured host bytes over the memory model's estimate, for the first size tried "
                        "(1.45: 25.6 bytes/param measured vs 18.0 estimated at 3.9B on the H100, 2026-11-24)")
    p.add_argument("--largest-max-layers", type=int, default=None, help="cap on the depth tried (tiny: 3)")
    p.add_argument("--disk-path", default=os.path.join(tempfile.gettempdir(), "gpu_check_disk"),
                   help="directory for zerogpt's disk tier in the largest phase (emptied after each try)")
    p.add_argument("--no-offload-models", default="gpt2_xl,gpt2_medium,gpt2_small",
                   help="models of the no_offload phase, of gpt2_xl, gpt2_medium, gpt2_small")
    p.add_argument("--no-offload-stages", default="0,1,2,3",
                   help="ZeRO stages of the no_offload phase (its XL compile/FP8/chunked-loss rows: those of 0 "
                        "and 3)")
    p.add_argument("--no-xl-variants", dest="xl_variants", action="store_false",
                   help="leave out the no_offload phase's compile, FP8 and chunked-loss rows")
    p.add_argument("--shipped-steps", type=int, default=None,
                   help="timed optimizer steps of the shipped_config phase, after one untimed (2; tiny: 1)")
    p.add_argument("--shipped-train-s", type=float, default=240,
                   help="at most this many seconds for the shipped_config phase's train_gpt.py run (240 of its 480)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (4; tiny: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (2; tiny: 1)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every phase's time budget")
    p.add_argument("--host-reserve-gib", type=float, default=None,
                   help="kill a measurement that leaves less host RAM free than this (8; tiny: 1)")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        summary = merge(args.merge)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(json.dumps({k: summary[k] for k in empty_summary() if k not in ("skipped",)}, indent=1))
        return 0

    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    tiny = args.tiny
    defaults = dict(seq=(64, 1024), offload_batch=(2, 16), largest_batch=(1, 4), steps=(2, 4), warmup=(1, 2),
                    host_reserve_gib=(1.0, 8.0), shipped_steps=(1, 2), largest_max_layers=(3, None))
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.vocab = TINY_VOCAB if tiny else VOCAB
    args.systems = args.systems or ("zerogpt,torch" if tiny else "zerogpt,deepspeed,torch")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.largest_variants = [v.strip() for v in args.largest_variants.split(",") if v.strip()]
    args.no_offload_models = [m.strip() for m in args.no_offload_models.split(",") if m.strip()]
    args.no_offload_stages = [int(t) for t in args.no_offload_stages.split(",") if t.strip()]
    bad = [v for v in args.largest_variants if v not in LARGEST_VARIANTS] + \
        [m for m in args.no_offload_models if m not in SHAPES]
    if bad:
        p.error(f"unknown largest variant(s) or model(s) {bad}; variants: {', '.join(LARGEST_VARIANTS)}; "
                f"models: {', '.join(SHAPES)}")
    phases = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in phases if s not in PHASES]
    if unknown:
        p.error(f"--only: unknown phase(s) {unknown}; valid: {', '.join(PHASES)}")

    log_file = open(os.path.join(args.out, "gpu_check.log"), "a")
    sys.stdout = _Tee(sys.__stdout__, log_file)
    summary_path = os.path.join(args.out, "summary.json")
    summary = empty_summary()
    summary["tiny"] = tiny
    log(f"gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')}: phases {phases}, systems {args.systems}, "
        f"{'TINY ' if tiny else ''}seq {args.seq}")
    if not cuda:
        log("no CUDA on this machine: skipped the GPU tests (collected only) and every GPU measurement at full "
            "size; the offload, largest, no_offload and profile phases run in tiny form on the CPU (fp32), "
            "so their numbers say nothing about a GPU")
        summary["skipped"].append("no CUDA: GPU tests collected, not run; measurements in tiny CPU form")
    for name in phases:
        t0 = time.monotonic()
        log(f"\n== {name} (budget {BUDGET_S[name] * args.budget_scale:.0f} s)")
        try:
            PHASE_FNS[name](args, summary)
        except Exception as e:  # a broken phase is reported; the others still run
            summary["skipped"].append(f"{name}: failed with {type(e).__name__}: {e}"[:400])
            log(f"  phase {name} FAILED: {type(e).__name__}: {e}")
        summary["phases_run"].append(name)
        log(f"   ({name} took {time.monotonic() - t0:.0f} s)")
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
    shipped = summary.get("shipped_config", {})
    rows = summary.get("offload_rows", []) \
        + [r for s in summary.get("largest", {}).values() for r in s.get("rows", [])] \
        + summary.get("no_offload_rows", []) + [shipped[s] for s in ("zerogpt", "deepspeed") if "spec" in
                                                 shipped.get(s, {})]
    if rows:
        log("\n" + rows_table(rows))
    log("\nsummary: " + json.dumps({k: summary[k] for k in ("device", "cuda_checks_failed", "offload_gpt2_xl",
                                                             "largest_params", "mfu_gpt2_xl_no_offload")}))
    log(f"files: {sorted(os.listdir(args.out))}")
    sys.stdout = sys.__stdout__
    log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
