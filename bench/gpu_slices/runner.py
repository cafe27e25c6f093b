"""The machinery every slice shares: its clock, the watched child processes that measure, and the setup of a bare
GPU machine (the packages .carry/ brings, the CPU Adam ops built once before any measurement needs them).

It owns no figure: the slices decide what to measure, record.py what the result file holds.
"""
from __future__ import annotations

import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

import torch

import gpu_measure

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH)
MEASURE = os.path.join(BENCH, "gpu_measure.py")
CARRY = os.path.join(REPO, ".carry")
SITE = os.environ.get("ZEROGPT_GPU_SITE", os.path.join(tempfile.gettempdir(), "zerogpt_gpu_site"))
"""Where the carried packages are installed on the device (outside the checkout, so nothing of it travels back)."""
MARGIN_S = 15.0
"""Seconds of every slice's budget kept back for writing its result after the last measurement."""

Spec = gpu_measure.Spec


def log(msg: str) -> None:
    print(msg, flush=True)


class Budget:
    """A slice's clock: `total_s` seconds from `start` (a time.monotonic() value: the process's start, so installs
    and builds count), less MARGIN_S for the result. Each step asks for its `share` of what is left, so time a
    step does not use flows to the ones after it."""

    def __init__(self, total_s: float, start: float, min_start_s: float = 20.0) -> None:
        self.total_s, self.end, self.min_start_s = total_s, start + total_s - MARGIN_S, min_start_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, weight: float, later_weight: float = 0.0) -> float:
        """Seconds for a step of `weight` when steps of `later_weight` in all still follow it."""
        return max(0.0, self.left()) * weight / (weight + later_weight)

    def can_start(self, seconds: float) -> bool:
        return seconds >= self.min_start_s


# -------------------------------------------------------------------------------------------------
# child processes: own process group, a deadline and the host-RAM watchdog

_children: set[subprocess.Popen] = set()


def child_env() -> dict:
    """This checkout first, then the carried packages (on the device), then whatever PYTHONPATH held."""
    parts = [REPO] + ([SITE] if os.path.isdir(SITE) else []) + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in dict.fromkeys(parts) if p), PYTHONUNBUFFERED="1")


def kill_children() -> None:
    """SIGKILL every watched process group still running (the slice's budget ran out in the parent)."""
    for proc in list(_children):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_watched(cmd: list[str], timeout_s: float, reserve_bytes: int, *, output_path: str | None = None,
                stop_when=None, stop_grace_s: float = 60.0, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group under a deadline and the host-RAM watchdog.

    `output_path`: its output goes there as it comes (kept if it is killed), else it is returned. `stop_when`: a
    callable polled every 0.2 s; once true the process gets SIGTERM (a clean stop: train_gpt.py ends after its
    step) and `stop_grace_s` to exit. `env`: variables added to child_env(). Returns the output, exit code, what
    killed it (None, "host_ram", "timeout"), whether it was stopped, wall seconds, CPU user/sys seconds (getrusage
    of children: its compilers too) and the epoch time it ended."""
    import psutil
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    sink = open(output_path, "w") if output_path else None
    proc = subprocess.Popen(cmd, stdout=sink or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(child_env(), **(env or {})), cwd=REPO, start_new_session=True)
    _children.add(proc)
    killed: list[str] = []
    stopped: list[float] = []

    def watchdog():
        deadline = t0 + timeout_s
        while proc.poll() is None:
            now = time.monotonic()
            if psutil.virtual_memory().available < reserve_bytes:
                killed.append("host_ram")
            elif now > deadline or (stopped and now > stopped[0] + stop_grace_s):
                killed.append("timeout")
            elif not stopped and stop_when is not None and stop_when():
                stopped.append(now)
                proc.send_signal(signal.SIGTERM)
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.2)
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    output = proc.stdout.read() if sink is None else None
    proc.wait()
    thread.join()
    _children.discard(proc)
    if sink is not None:
        sink.close()
        with open(output_path) as f:
            output = f.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return dict(output=output, returncode=proc.returncode, killed=killed[0] if killed else None,
                stopped=bool(stopped), wall_s=time.monotonic() - t0, user_s=after.ru_utime - before.ru_utime,
                sys_s=after.ru_stime - before.ru_stime, ended_at=time.time())


def run_specs(specs: list[Spec], timeout_s: float, reserve_bytes: int) -> list[dict]:
    """Measure `specs` one after another in one fresh gpu_measure.py process; a crash, GPU OOM, host-RAM kill or
    timeout is a result too, and ends the process's remaining specs with the same error (the first of them says
    whether it was building or training, and for how long). Each result gets the whole process's wall and CPU
    user/sys seconds (`process`: shared by its specs)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        run = run_watched([sys.executable, MEASURE, json.dumps([asdict(s) for s in specs]), result_path],
                          timeout_s, reserve_bytes)
        results, progress = [], None
        if os.path.exists(result_path):
            with open(result_path) as f:
                results = json.load(f)
        if os.path.exists(result_path + ".progress"):
            with open(result_path + ".progress") as f:
                progress = json.load(f)
    output = run.pop("output")
    if len(results) < len(specs) or any("error" in r for r in results):
        log("    worker output (last lines):\n      " + "\n      ".join(output.strip().splitlines()[-12:]))
    error = run.pop("killed") or f"exit {run['returncode']}"
    for k, spec in enumerate(specs[len(results):]):
        row = dict(spec=asdict(spec), error=error)
        if k == 0 and progress and progress["index"] == len(results):
            row.update(stopped_in=progress["part"], part_s=run["ended_at"] - progress["since"],
                       built=progress.get("built"))
        if k == 0:
            row["detail"] = " | ".join(output.strip().splitlines()[-3:])[-600:]
        results.append(row)
    for r in results:
        r["process"] = dict(run, specs=len(specs))
    for spec, r in zip(specs, results):
        if "error" in r:
            where = f" while {r['stopped_in']} ({r['part_s']:.0f} s)" if r.get("stopped_in") else ""
            log(f"    {spec.label}: FAILED ({r['error']}{where}) {r.get('detail', '')[:300]}")
        else:
            log(f"    {spec.label}: {r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.1f} TFLOPS"
                + (f", MFU {r['mfu']:.1%}" if r["mfu"] else "")
                + (f", GPU peak {r['peak_gpu_gib']:.1f} GiB" if r["peak_gpu_gib"] is not None else "")
                + f", host peak {r['peak_host_gib']:.1f} GiB, build {r['build_s']:.0f} s, {r['step_s']:.2f} s/step")
    return results


def measure_group(budget: Budget, specs: list[Spec], weight: float, later_weight: float, reserve_bytes: int,
                  skipped: list[str]) -> list[dict]:
    """`specs` in one process given its share of the budget; none started (each listed in `skipped`) when the
    share is under the budget's minimum."""
    seconds = budget.share(weight, later_weight)
    if not budget.can_start(seconds):
        for spec in specs:
            skipped.append(f"{spec.label}: not started, {seconds:.0f} s left of the slice's budget")
            log(f"    {spec.label}: not started ({seconds:.0f} s left)")
        return []
    return run_specs(specs, seconds, reserve_bytes)


def note_failures(result: dict, rows: list[dict]) -> None:
    """A row cut by the budget (timeout) is work skipped; any other error (GPU OOM, host RAM, a crash) is an
    outcome, listed under `errors`."""
    for r in rows:
        if "error" in r:
            where = f" while {r['stopped_in']} ({r['part_s']:.0f} s)" if r.get("stopped_in") else ""
            result["skipped" if r["error"] == "timeout" else "errors"].append(
                f"{r['spec']['label']}: {r['error']}{where}")


# -------------------------------------------------------------------------------------------------
# the machine: what it is, which commit it runs, what must be installed and built there

def device_tag(gpu_name: str | None) -> str:
    """The device's short name in result file names: "h100", "h200", "a100", ...; "cpu" without CUDA."""
    if not gpu_name:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", gpu_name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "", gpu_name.lower())[:12] or "gpu").lower()


def environment() -> dict:
    import psutil

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None, gpu=gpu,
                gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
                host_ram_gib=psutil.virtual_memory().total / 2**30, cpus=os.cpu_count(), nvcc=shutil.which("nvcc"),
                ninja=shutil.which("ninja"), device=device_tag(gpu))


def commit_info(explicit: str | None = None) -> dict:
    """The commit measured: --commit, else git in this checkout, else .carry/COMMIT (what bench/gpu_prepare.sh
    wrote here before the call: the device's copy of the tree has no .git). `dirty_files` counts tracked files
    that differ from it (they travel with the tree and are measured too)."""
    if explicit:
        return dict(commit=explicit, source="--commit")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=20)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        if head.returncode == 0:
            return dict(commit=head.stdout.strip(), dirty_files=len(status.stdout.splitlines()), source="git")
    except (OSError, subprocess.SubprocessError):
        pass
    path = os.path.join(CARRY, "COMMIT")
    if os.path.exists(path):
        with open(path) as f:
            return dict(json.load(f), source=".carry/COMMIT")
    return dict(commit=None, source="unknown: no git and no .carry/COMMIT (run bash bench/gpu_prepare.sh first)")


def _pip_install(args: list[str], timeout_s: float, env: dict | None = None) -> str | None:
    """pip install into SITE from local files only; None, or the last lines of its error."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "--target", SITE, *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout_s:.0f} s"
    return None if res.returncode == 0 else " | ".join((res.stdout + res.stderr).strip().splitlines()[-3:])[-500:]


def install_carried(deepspeed: bool, timeout_s: float) -> dict:
    """Install .carry/'s wheels (and with `deepspeed`, DeepSpeed from its sdist, ops not prebuilt) into SITE, once
    per machine: a warm machine's SITE already holds them. Children find them through child_env()."""
    t0 = time.monotonic()
    wheels = sorted(glob.glob(os.path.join(CARRY, "*.whl")))
    sdists = sorted(glob.glob(os.path.join(CARRY, "deepspeed-*.tar.gz")))
    out: dict = dict(site=SITE, wheels=[os.path.basename(w) for w in wheels],
                     deepspeed_sdist=[os.path.basename(s) for s in sdists])
    if not wheels and not sdists:
        out["error"] = (".carry/ holds no wheels or sdist: run `bash bench/gpu_prepare.sh` on the CPU machine and "
                        "name .carry in the device call's carry list")
        return out
    os.makedirs(SITE, exist_ok=True)
    done = os.path.join(SITE, ".zerogpt_wheels")
    if wheels and not os.path.exists(done):
        out["wheels_error"] = _pip_install(["--no-compile", *wheels], min(120.0, timeout_s))
        if out["wheels_error"] is None:
            open(done, "w").close()
    if deepspeed and sdists and not os.path.isdir(os.path.join(SITE, "deepspeed")):
        left = timeout_s - (time.monotonic() - t0)
        env = dict(os.environ, DS_BUILD_OPS="0")  # ops JIT-build at first use (build_ops, before any measurement)
        out["deepspeed_error"] = _pip_install(["--no-build-isolation", sdists[-1]], max(left, 30.0), env)
    out["install_s"] = time.monotonic() - t0
    return out


_BUILD_CODE = {
    "deepspeed_cpu_adam": ("import json, deepspeed\nfrom zerogpt.optim import cpu_adam_backend\n"
                           "out = dict(deepspeed=deepspeed.__version__)\n"
                           "try:\n    out['kernel'] = cpu_adam_backend('deepspeed')\n"
                           "except Exception as e:\n    out['error'] = f'{type(e).__name__}: {e}'[:400]\n"
                           "print(json.dumps(out))"),
    "zerogpt_host_adam": ("import json\nfrom zerogpt.optim.host_adam import load_host_adam\n"
                          "op, err = load_host_adam()\nprint(json.dumps(dict(built=op is not None, error=err)))"),
}


def _remove_stale_build_locks(since: float) -> list[str]:
    """torch's JIT build locks left by a build child we killed (created after `since`): they would make every
    later build of that op wait forever. Only on a machine this check has to itself (the GPU machine)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    removed = []
    for name in ("cpu_adam", "zerogpt_host_adam"):
        for lock in glob.glob(os.path.join(root, "**", name, "lock"), recursive=True):
            if os.path.getmtime(lock) >= since:
                os.remove(lock)
                removed.append(lock)
    return removed


def build_ops(timeout_s: float, deepspeed: bool) -> dict:
    """Build the CPU Adam ops (zerogpt's fused host step; DeepSpeed's cpu_adam when DeepSpeed is measured) in
    parallel child processes before any measurement: a worker killed mid-build would leave torch's build lock
    behind and hang every later build. If DeepSpeed's op does not build, zerogpt runs torch's fused Adam where it
    would have used it (ZEROGPT_CPU_ADAM=torch, inherited by the workers) and DeepSpeed's offload rows fail with
    its own error."""
    started, t0 = time.time(), time.monotonic()
    names = ["zerogpt_host_adam"] + (["deepspeed_cpu_adam"] if deepspeed else [])
    procs = {n: subprocess.Popen([sys.executable, "-c", _BUILD_CODE[n]], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO, start_new_session=True)
             for n in names}
    out: dict = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            last = stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
            out[name] = json.loads(last[0]) if last else dict(error=" | ".join(stderr.strip().splitlines()[-2:]))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its compilers
            proc.communicate()
            out[name] = dict(error=f"the build did not finish in {timeout_s:.0f} s")
    removed = _remove_stale_build_locks(started)
    if removed:
        out["removed_locks"] = removed
    out["build_s"] = time.monotonic() - t0
    if deepspeed and out["deepspeed_cpu_adam"].get("kernel") != "deepspeed":
        os.environ["ZEROGPT_CPU_ADAM"] = "torch"
    out["zerogpt_cpu_adam"] = os.environ.get("ZEROGPT_CPU_ADAM", "auto")
    return out


def setup(args, budget: Budget, *, deepspeed: bool, ops: bool) -> dict:
    """Ready a bare machine for a slice: the carried packages, then the ops (each under a share of the budget).
    Tiny (CPU) runs install and build nothing: they use this checkout's environment and torch's fused Adam, one
    thread per process (a 64-wide model gains nothing from more, and on a busy 2-core machine OpenMP's waiting
    threads made each step 10-50x slower)."""
    if args.tiny:
        os.environ["ZEROGPT_CPU_ADAM"] = "torch"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return dict(tiny="no installs or op builds in tiny form; CPU Adam: torch's fused (ZEROGPT_CPU_ADAM=torch); "
                         f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    log(f"  installing .carry/ into {SITE} (DeepSpeed: {deepspeed})")
    out = install_carried(deepspeed, min(150.0, budget.left() / 3))
    log(f"    {json.dumps(out)[:600]}")
    if ops:
        log("  building the CPU Adam ops")
        out["ops"] = build_ops(min(180.0, budget.left() / 3), deepspeed)
        log(f"    {json.dumps(out['ops'])[:600]}")
    return out
