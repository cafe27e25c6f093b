"""zerogpt on one GPU: validate the CUDA paths, then measure offloaded pretraining against DeepSpeed ZeRO-Offload.

    python bench/gpu_check.py --out DIR                    # every phase, about 25 minutes on one H100
                                                           # (22 of measuring, the rest installs and builds)
    # the same in three commands of under 10 minutes each (the device tool's limit per command):
    python bench/gpu_check.py --out DIR --only env,correctness,profile
    python bench/gpu_check.py --out DIR --only offload,no_offload
    python bench/gpu_check.py --out DIR --only largest
    python bench/gpu_check.py --merge DIR1 DIR2 DIR3 --out DIR   # one summary.json from the three
    python bench/gpu_check.py --out /tmp/gpucheck          # no CUDA: says what it skips, tiny forms, exit 0

Phases:
  env          torch / CUDA / NCCL / DeepSpeed versions, GPU, host RAM, which CPU Adam kernel runs
               (DeepSpeed's op if it builds, else torch's fused Adam: no nvcc needed).
  correctness  `pytest -m gpu` on the test files with GPU tests (tests/zero/test_gpu.py: world-1 NCCL,
               every stage x precision x offload against plain PyTorch, copy stream and eager hand-over,
               bit-exact resume).
  offload      GPT-2 XL, seq 1024, bf16, stage 3 + CPU optimizer offload, then + param offload:
               zerogpt, DeepSpeed ZeRO-Offload, same model/batch/seq, same run.
  largest      hidden 2560, growing depth, stage 3 + CPU optimizer + param offload, both systems,
               until host RAM (or GPU memory) stops it.
  no_offload   GPT-2 small / medium / XL at stages 0-3, zerogpt and DeepSpeed, beside plain PyTorch.
  profile      one offloaded zerogpt step of GPT-2 XL: forward, backward, device->host, CPU Adam,
               host->device, waits (torch.profiler), as a table in DIR/profile.txt.

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

PHASES = ("env", "correctness", "offload", "largest", "no_offload", "profile")
BUDGET_S = dict(env=100, correctness=240, offload=210, largest=420, no_offload=270, profile=75)  # 22 min
TINY_VOCAB = 512
# GPT-2 shapes; "largest" grows n_layer at n_embd 2560 (head dim 128)
SHAPES = dict(gpt2_small=(12, 12, 768), gpt2_medium=(24, 16, 1024), gpt2_xl=(48, 25, 1600))
TINY = dict(gpt2_small=(2, 2, 64), gpt2_medium=(3, 2, 64), gpt2_xl=(4, 2, 64))
HOST_BYTES_PER_PARAM = 18  # stage 3 + CPU optimizer + param offload, bf16: 2 param + 4 master + 8 Adam + 4 grad


def log(msg: str) -> None:
    print(msg, flush=True)


def _child_env() -> dict:
    """This checkout first, then whatever PYTHONPATH holds (on the device: the carried DeepSpeed)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))


# -------------------------------------------------------------------------------------------------
# the parent: run each Spec in a child process with a deadline and a host-RAM watchdog

def run_specs(specs: list[Spec], timeout_s: float, reserve_bytes: int) -> list[dict]:
    """Run measurements one after another in one fresh process (one start-up for several); a crash, GPU OOM,
    host-RAM kill or timeout is a result too, and ends the process's remaining specs with the same error."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        cmd = [sys.executable, MEASURE, json.dumps([asdict(s) for s in specs]), result_path]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env(),
                                start_new_session=True)  # its own group: a kill takes its compilers too
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
        results = []
        if os.path.exists(result_path):
            with open(result_path) as f:
                results = json.load(f)
    if len(results) < len(specs) or any("error" in r for r in results):
        log("    worker output (last lines):\n      " + "\n      ".join(output.strip().splitlines()[-12:]))
    error = killed[0] if killed else f"exit {proc.returncode}"
    results += [dict(spec=asdict(s), error=error) for s in specs[len(results):]]
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

    def run(self, spec: Spec) -> dict | None:
        return self.run_many([spec])[0]

    def run_many(self, specs: list[Spec]) -> list[dict | None]:
        """Measure `specs` in one process; None for each when the phase's budget is already spent."""
        prepare_cpu_adam(self.args)
        left = self.deadline - time.monotonic()
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


def phase_largest(args, summary: dict) -> None:
    """Grow depth at hidden 2560 with every model state on the host until a size fails; bisect once or twice."""
    import psutil

    phase, out = Phase("largest", args, summary), {}
    n_head, n_embd = (2, 64) if args.tiny else (20, 2560)
    per_layer, fixed = 12 * n_embd**2 + 13 * n_embd, (args.vocab + args.seq + 2) * n_embd
    usable = psutil.virtual_memory().total - args.host_reserve_gib * 2**30
    bound = max(1, int((usable / HOST_BYTES_PER_PARAM - fixed) / per_layer))  # depth where host RAM runs out
    for system in [s for s in ("zerogpt", "deepspeed") if s in args.systems]:
        tried, best, first_fail = {}, None, None
        depth = 1 if args.tiny else max(1, int(0.8 * bound))
        for _ in range(args.largest_tries):
            spec = Spec(system, (depth, n_head, n_embd), stage=3, offload="cpu+param", batch=args.largest_batch,
                        seq=args.seq, steps=1, warmup=1, checkpoint=True, meta_init=True, vocab=args.vocab,
                        label=f"{system} {depth}L x {n_embd} ({(depth * per_layer + fixed) / 1e9:.2f}B) "
                              f"offload=cpu+param")
            r = phase.run(spec)
            if r is None:
                break
            tried[depth] = r
            if "error" in r:
                first_fail = depth if first_fail is None else min(first_fail, depth)
            elif best is None or depth > best:
                best = depth
            if first_fail is None:
                depth = depth * 2 if args.tiny else int(depth * 1.2) + 1
            elif best is None:
                depth = max(1, int(depth * 0.7))
            else:
                depth = (best + first_fail) // 2
            if depth in tried or depth == best:
                break
        out[system] = dict(layers=best, params=tried[best]["params"] if best else None,
                           bounded_by=tried[first_fail]["error"] if first_fail else "not reached (tries or budget)",
                           host_ram_bound_layers=bound, rows=list(tried.values()))
        log(f"  {system}: largest {best} layers = {out[system]['params']} params; next size failed with "
            f"{out[system]['bounded_by']}; host RAM would bound it near {bound} layers")
    summary["largest"] = out
    summary["largest_params"] = out.get("zerogpt", {}).get("params")


def phase_no_offload(args, summary: dict) -> None:
    """XL first (the figure the goals name), then medium and small; one process per system and model."""
    phase, rows = Phase("no_offload", args, summary), []
    batches = dict(gpt2_small=16, gpt2_medium=16, gpt2_xl=8) if not args.tiny else dict.fromkeys(SHAPES, 2)
    for name in ("gpt2_xl", "gpt2_medium", "gpt2_small"):
        shape, batch = (TINY if args.tiny else SHAPES)[name], batches[name]
        for system in [s for s in ("zerogpt", "deepspeed", "torch") if s in args.systems]:
            stages = [0] if system == "torch" else [0, 1, 2, 3]
            specs = [Spec(system, shape, stage=stage, batch=batch, seq=args.seq, steps=args.steps + 2,
                          warmup=args.warmup, vocab=args.vocab,
                          label=f"{system} {name}" + ("" if system == "torch" else f" stage {stage}")
                          + f" b{batch}x{args.seq}") for stage in stages]
            rows += [dict(r, model=name) for r in phase.run_many(specs) if r]
    summary["no_offload_rows"] = rows
    xl = [r for r in rows if r["model"] == "gpt2_xl" and r["spec"]["system"] == "zerogpt" and r.get("mfu")]
    best = max(xl, key=lambda r: r["mfu"], default=None)
    summary["mfu_gpt2_xl_no_offload"] = best["mfu"] if best else None
    summary["mfu_gpt2_xl_no_offload_stage"] = best["spec"]["stage"] if best else None


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
    return format_table(
        ["system", "model", "stage", "offload", "batch x seq", "tok/s", "TFLOPS", "MFU", "GPU peak GiB",
         "host peak GiB", "error"],
        [[r["spec"]["system"], r.get("model", "x".join(map(str, r["spec"]["shape"]))), r["spec"]["stage"],
          r["spec"]["offload"], f"{r['spec']['batch']}x{r['spec']['seq']}", cell(r, "tokens_per_s", "{:,.0f}"),
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
                 no_offload=phase_no_offload, profile=phase_profile)
PHASE_KEYS = dict(env=["env", "device"], correctness=["correctness", "cuda_checks_failed"],
                  offload=["offload_rows", "offload_gpt2_xl", "offload_gpt2_xl_param"],
                  largest=["largest", "largest_params"],
                  no_offload=["no_offload_rows", "mfu_gpt2_xl_no_offload", "mfu_gpt2_xl_no_offload_stage"],
                  profile=["profile"])


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
    p.add_argument("--largest-tries", type=int, default=2, help="sizes tried per system in the largest phase (2)")
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
                    host_reserve_gib=(1.0, 8.0))
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.vocab = TINY_VOCAB if tiny else VOCAB
    args.systems = args.systems or ("zerogpt,torch" if tiny else "zerogpt,deepspeed,torch")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
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
    rows = summary.get("offload_rows", []) + [r for s in summary.get("largest", {}).values() for r in s["rows"]] \
        + summary.get("no_offload_rows", [])
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
