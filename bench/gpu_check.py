"""zerogpt on one GPU: validate the CUDA paths, then measure offloaded pretraining against DeepSpeed ZeRO-Offload.

    python bench/gpu_check.py --out DIR                    # every phase, about 25 minutes on one H100
    # the same in three commands of under 10 minutes each (the device tool's limit per command):
    python bench/gpu_check.py --out DIR --only env,correctness,profile
    python bench/gpu_check.py --out DIR --only offload,no_offload
    python bench/gpu_check.py --out DIR --only largest
    python bench/gpu_check.py --merge DIR1 DIR2 DIR3 --out DIR   # one summary.json from the three
    python bench/gpu_check.py --out /tmp/gpucheck          # no CUDA: says what it skips, tiny forms, exit 0

Phases:
  env          torch / CUDA / NCCL / DeepSpeed versions, GPU, host RAM, which CPU Adam kernel runs
               (DeepSpeed's op if it builds, else torch's fused Adam: no nvcc needed).
  correctness  `pytest -m gpu tests` (tests/zero/test_gpu.py: world-1 NCCL, every stage x precision x
               offload against plain PyTorch, copy stream and eager hand-over, bit-exact resume).
  offload      GPT-2 XL, seq 1024, bf16, stage 3 + CPU optimizer offload, then + param offload:
               zerogpt, DeepSpeed ZeRO-Offload, same model/batch/seq, same run.
  largest      hidden 2560, growing depth, stage 3 + CPU optimizer + param offload, both systems,
               until host RAM (or GPU memory) stops it.
  no_offload   GPT-2 small / medium / XL at stages 0-3, zerogpt and DeepSpeed, beside plain PyTorch.
  profile      one offloaded zerogpt step of GPT-2 XL: forward, backward, device->host, CPU Adam,
               host->device, waits (torch.profiler), as a table in DIR/profile.txt.

Every measurement runs in its own process (clean peak GPU memory and host RSS; a crash or OOM is a row, not
the end of the run); a watchdog kills one that leaves less than --host-reserve-gib of host RAM free, so the
machine's OOM killer never fires. Each phase stops starting new measurements when its time budget is spent
and records what it skipped. DIR gets at most 5 files: gpu_check.log, summary.json, profile.txt,
pytest_gpu.xml, pytest_gpu.log.
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
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402

PHASES = ("env", "correctness", "offload", "largest", "no_offload", "profile")
BUDGET_S = dict(env=100, correctness=240, offload=210, largest=420, no_offload=270, profile=75)  # 22 min
PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0}  # dense bf16 without sparsity, by device name
VOCAB, TINY_VOCAB = 50257, 512
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
# one measurement, in a child process: build the system, train a few steps, report speed and memory

@dataclass
class Spec:
    """One measurement: system x model shape x ZeRO setting x batch."""

    system: str  # zerogpt | deepspeed | torch
    shape: tuple  # (n_layer, n_head, n_embd)
    stage: int = 3
    offload: str = "none"  # none | cpu | cpu+param
    batch: int = 8
    seq: int = 1024
    steps: int = 4
    warmup: int = 2
    checkpoint: bool = False  # activation checkpointing
    vocab: int = VOCAB
    meta_init: bool = False  # build under ZeroInitContext / deepspeed.zero.Init (models too big to build whole)
    profile_to: str | None = None  # write the profile of one more step here (zerogpt only)
    label: str = ""


def _reset_host_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _host_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _build_model(spec: Spec, device: torch.device) -> torch.nn.Module:
    from model_zoo.gpt import gpt2_small

    n_layer, n_head, n_embd = spec.shape
    torch.manual_seed(0)
    return gpt2_small(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=spec.vocab, dropout=0.0,
                      max_position_embeddings=spec.seq, checkpoint=spec.checkpoint)


def _make_zerogpt(spec: Spec, device: torch.device, precision: str):
    import zerogpt
    from zerogpt.optim import HybridAdam

    zero = dict(stage=spec.stage, offload_optimizer=dict(device="cpu" if spec.offload != "none" else "none"))
    if spec.offload == "cpu+param":
        zero["offload_param"] = dict(device="cpu")
    cfg = zerogpt.Config(dict(zero=zero, precision=precision))
    if spec.meta_init:
        with zerogpt.ZeroInitContext(cfg):
            model = _build_model(spec, device)
    else:
        with device:
            model = _build_model(spec, device)
    optimizer = HybridAdam(model.parameters(), lr=1e-4, weight_decay=0.0)
    engine, *_ = zerogpt.initialize(model, optimizer, config=cfg)
    engine.logger.setLevel("WARNING")
    return engine, engine.backward, lambda: (engine.step(), engine.zero_grad()), optimizer, engine.close


def _make_deepspeed(spec: Spec, device: torch.device, precision: str):
    import deepspeed

    zero = {"stage": spec.stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    pin = device.type == "cuda"
    if spec.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if spec.offload == "cpu+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "steps_per_print": 1 << 30, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": precision == "bf16"}}
    if spec.offload != "none":  # AdamW from the config: DeepSpeedCPUAdam, the op prepare_cpu_adam built
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    if spec.meta_init:
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu" if spec.offload == "cpu+param"
                                 else None, pin_memory=pin):
            model = _build_model(spec, device)
    else:
        with device:
            model = _build_model(spec, device)
    # On the device: torch's fused AdamW, as zerogpt's HybridAdam uses there (no FusedAdam JIT build)
    client = None if spec.offload != "none" else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                                                  fused=device.type == "cuda")
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                 optimizer=client)
    return engine, engine.backward, engine.step, optimizer, lambda: None


def _make_torch(spec: Spec, device: torch.device, precision: str):
    """The floor: fp32 params, bf16 autocast, torch's fused AdamW, no sharding and no communication."""
    with device:
        model = _build_model(spec, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def forward(x):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            return model(x)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return forward, lambda loss: loss.backward(), step, optimizer, lambda: None


def measure(spec: Spec) -> dict:
    """Train `spec` for warmup + steps; tokens/s, TFLOPS, MFU, peak GPU memory and peak host RSS."""
    from torch.profiler import record_function

    from model_zoo.gpt import GPTLMLoss
    from zerogpt.trainer import flops_per_token

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = "bf16" if cuda else "fp32"
    make = dict(zerogpt=_make_zerogpt, deepspeed=_make_deepspeed, torch=_make_torch)[spec.system]
    with torch.device("meta"):
        num_params = sum(p.numel() for p in _build_model(spec, device).parameters())  # tied head counted once
    forward, backward, step, optimizer, close = make(spec, device, precision)
    # peaks from here on: the training steps, not the model's construction
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _reset_host_peak()
    loss_fn = GPTLMLoss(shift=False)
    n_layer, _, n_embd = spec.shape
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g).to(device) for _ in range(2)]

    def train_step(i: int) -> torch.Tensor:  # the phases are named for the profiler (no-ops without one)
        x = batches[i % 2]
        with record_function("forward"):
            loss = loss_fn(forward(x[:, :-1]), x[:, 1:])
        with record_function("backward"):
            backward(loss)
        with record_function("step"):
            step()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    losses = [train_step(i).item() for i in range(spec.warmup)]
    sync()
    t0 = time.perf_counter()
    for i in range(spec.steps):
        loss = train_step(i)
    sync()
    seconds = time.perf_counter() - t0
    losses.append(loss.item())
    tokens_per_s = spec.batch * spec.seq * spec.steps / seconds
    tflops = tokens_per_s * flops_per_token(num_params, n_layer, n_embd, spec.seq) / 1e12
    peak = next((v for k, v in PEAK_TFLOPS_BF16.items() if cuda and k in torch.cuda.get_device_name(0)), None)
    out = dict(spec=asdict(spec), params=num_params, step_s=seconds / spec.steps, tokens_per_s=tokens_per_s,
               tflops=tflops, mfu=tflops / peak if peak else None, losses=losses,
               peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               peak_host_gib=_host_peak_bytes() / 2**30)
    if spec.profile_to:
        out["profile"] = profile_step(train_step, optimizer, spec, sync, cuda)
    close()
    return out


# -------------------------------------------------------------------------------------------------
# (e) the profile of one offloaded step

def profile_step(train_step, optimizer, spec: Spec, sync, cuda: bool) -> list[dict]:
    """Profile one more step; rows (part, host ms, device ms); the full table goes to spec.profile_to."""
    from torch.profiler import ProfilerActivity, profile, record_function

    original = optimizer.step

    def timed_step(*args, **kwargs):  # the CPU Adam kernel is not a torch op: name it for the profiler
        with record_function("cpu_adam"):
            return original(*args, **kwargs)
    optimizer.step = timed_step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function("train_step"):
            train_step(1)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    optimizer.step = original
    events = prof.key_averages()

    def host_ms(match) -> float:
        return sum(e.cpu_time_total for e in events if match(e.key)) / 1e3

    def device_ms(match) -> float:
        return sum(getattr(e, "device_time_total", 0.0) for e in events if match(e.key)) / 1e3

    rows = [
        dict(part="whole step (wall)", host_ms=wall_ms, device_ms=None),
        dict(part="forward", host_ms=host_ms(lambda k: k == "forward"), device_ms=None),
        dict(part="backward", host_ms=host_ms(lambda k: k == "backward"), device_ms=None),
        dict(part="optimizer step (engine)", host_ms=host_ms(lambda k: k == "step"), device_ms=None),
        dict(part="CPU Adam", host_ms=host_ms(lambda k: k == "cpu_adam"), device_ms=None),
        dict(part="device->host copies", host_ms=None, device_ms=device_ms(lambda k: "DtoH" in k)),
        dict(part="host->device copies", host_ms=None, device_ms=device_ms(lambda k: "HtoD" in k)),
        dict(part="NCCL kernels", host_ms=None, device_ms=device_ms(lambda k: "nccl" in k.lower())),
        dict(part="waits (host blocked on the device)",
             host_ms=host_ms(lambda k: k in ("cudaStreamSynchronize", "cudaEventSynchronize",
                                             "cudaDeviceSynchronize", "cudaStreamWaitEvent")), device_ms=None),
    ]
    table = format_table(["part", "host ms", "device ms"],
                         [[r["part"], _fmt(r["host_ms"]), _fmt(r["device_ms"])] for r in rows])
    try:
        top = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25)
    except Exception:  # an older torch names the column self_cuda_time_total
        top = events.table(sort_by="self_cpu_time_total", row_limit=25)
    with open(spec.profile_to, "w") as f:
        f.write(f"one offloaded zerogpt step: {spec.label}\n\n{table}\n\ntop ops by self time:\n{top}")
    return rows


# -------------------------------------------------------------------------------------------------
# the parent: run each Spec in a child process with a deadline and a host-RAM watchdog

def run_specs(specs: list[Spec], timeout_s: float, reserve_bytes: int) -> list[dict]:
    """Run measurements one after another in one fresh process (one start-up for several); a crash, GPU OOM,
    host-RAM kill or timeout is a result too, and ends the process's remaining specs with the same error."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result_path = os.path.join(tmp, "results.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps([asdict(s) for s in specs]),
               "--result", result_path]
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


def worker_main(specs_json: str, result_path: str) -> int:
    """Child process: one world-1 process group (NCCL on CUDA, as DeepSpeed and zerogpt use it), the specs in
    turn; the results file is rewritten after each, so a kill keeps the ones before it."""
    import gc

    import torch.distributed as dist

    specs = [Spec(**{**d, "shape": tuple(d["shape"])}) for d in json.loads(specs_json)]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    rdzv = tempfile.mkdtemp(prefix="gpu_check_pg_")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rdzv}/rdzv", rank=0, world_size=1)
    results = []
    try:
        for spec in specs:
            try:
                results.append(measure(spec))
            except torch.cuda.OutOfMemoryError as e:
                results.append(dict(spec=asdict(spec), error="gpu_oom", detail=str(e).splitlines()[0]))
            except Exception as e:
                results.append(dict(spec=asdict(spec), error=type(e).__name__,
                                    detail=str(e).splitlines()[0] if str(e) else ""))
            with open(result_path, "w") as f:
                json.dump(results, f)
            gc.collect()  # the last system's engine, model and optimizer state, before the next is built
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(rdzv, ignore_errors=True)
    return 0


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
        try:
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BUDGET_S["env"],
                                 env=_child_env(), cwd=REPO)
            adam = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else dict(
                deepspeed_op_error=" | ".join(res.stderr.strip().splitlines()[-2:]))
        except subprocess.TimeoutExpired:
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
    failed = counts["failures"] + counts["errors"] + (1 if timed_out or not os.path.exists(xml) else 0)
    summary["correctness"] = dict(ran=True, timed_out=timed_out, **counts)
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
                        label=f"{system} {depth}L x {n_embd} ({(depth * per_layer + fixed) / 1e9:.2f}B) offload=cpu+param")
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

def _fmt(x) -> str:
    return "" if x is None else f"{x:,.1f}"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


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
    p.add_argument("--largest-tries", type=int, default=3, help="sizes tried per system in the largest phase")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (4; tiny: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (2; tiny: 1)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every phase's time budget")
    p.add_argument("--host-reserve-gib", type=float, default=None,
                   help="kill a measurement that leaves less host RAM free than this (8; tiny: 1)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.result)
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
