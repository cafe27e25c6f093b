"""One measurement of bench/gpu_check.py, in its own process: build a system (zerogpt, DeepSpeed or plain
PyTorch) on one device, train a few steps, report tokens/s, TFLOPS, MFU, the training steps' peak GPU
memory and host RSS, build seconds, the first step's seconds (torch.compile's time when compiling), CPU
user/sys seconds per step, (time_step) the optimizer-step call's wall time, zerogpt's own host-step seconds,
(count_syncs) the device syncs per step, and optionally profile one more step. The model is model_zoo's GPT
or a model_zoo Llama at a published size's widths (llama3_8b, llama3_2_1b, llama3_2_3b) and any depth; plain
PyTorch runs transformers' LlamaForCausalLM (SDPA) at the same shape. `fit_batch` halves the micro-batch after a
GPU out-of-memory until one fits; `compile_mode` is torch.compile's mode (zerogpt: its inductor options).

    python bench/gpu_measure.py SPECS_JSON RESULT_PATH    # run by gpu_check.py; SPECS_JSON: a list of Specs

The specs run in turn under one world-1 process group (NCCL on CUDA, gloo otherwise); RESULT_PATH is rewritten
after each, so a process killed by gpu_check's watchdog keeps the results before the kill, and
RESULT_PATH.progress names the spec and the part (build, train) running now, so the kill's row says where.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # run as gpu_check's worker: this checkout's packages first (bench/ is sys.path[0])
    sys.path.insert(0, os.path.dirname(_HERE))

import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402

import torch  # noqa: E402

from zerogpt.context import DistContext  # noqa: E402

VOCAB = 50257  # GPT-2's; Llama-3's is 128256 (LLAMA3_VOCAB)
LLAMA3_VOCAB = 128256

@dataclass
class Spec:
    """One measurement: system x model shape x ZeRO setting x batch."""

    system: str  # zerogpt | deepspeed | torch
    shape: tuple  # (n_layer, n_head, n_embd); a Llama: (num_hidden_layers, num_attention_heads, hidden_size)
    stage: int = 3
    offload: str = "none"  # none | cpu | cpu+param | disk | disk+param (disk: the optimizer state, zerogpt only)
    batch: int = 8  # micro-batch (sequences)
    seq: int = 1024
    steps: int = 4  # timed optimizer steps
    warmup: int = 2  # untimed optimizer steps first (the first one's time is first_step_s)
    checkpoint: bool = False  # activation checkpointing
    vocab: int = VOCAB
    meta_init: bool = False  # zerogpt: build on the meta device (as train_gpt.py); DeepSpeed: under zero.Init
    profile_to: str | None = None  # write the profile of one more step here (zerogpt only)
    label: str = ""
    accum: int = 1  # micro-batches per optimizer step (GRADIENT_ACCUMULATION / gradient_accumulation_steps)
    precision: str | None = None  # None: bf16 on CUDA, fp32 on CPU; "fp8": zerogpt's precision="fp8"
    compile: bool = False  # zerogpt: compile=True; torch: torch.compile(model)
    offload_path: str | None = None  # directory of disk offload
    state_dtype: str | None = None  # zerogpt zero.offload_optimizer.state_dtype (None: the default, not passed)
    bucket_mb: float | None = None  # zerogpt BucketTensorShardStrategy(bucket_mb) (None: the engine's default)
    prefetch: int | None = None  # zerogpt zero.prefetch (None: the default)
    time_step: bool = False  # time the optimizer-step call of each timed step (one more device sync per step)
    chunked_loss: bool = False  # GPTConfig.chunked_loss: the loss from model(x, labels=y), no whole-batch logits
    loss_chunk_size: int | None = None  # GPTConfig.loss_chunk_size, tokens (None: its default, 1024)
    loss_backend: str | None = None  # GPTConfig.loss_backend of the chunked loss (None: its default, "auto")
    model: str = "gpt"  # gpt (model_zoo.gpt) | a model_zoo.llama SIZES name: its widths at shape's depth
    count_syncs: int = 0  # steps after the timed ones run under torch.cuda.set_sync_debug_mode("warn"), counted
    fit_batch: bool = False  # after a GPU out-of-memory, measure again at half the batch, down to 1
    compile_mode: str | None = None  # torch.compile's mode (with compile); zerogpt: that mode's inductor options
    host_step_threads: int | None = None  # zerogpt host.step_threads (None: the default, not passed)
    clip: float | None = None  # clip the gradient norm to this, as training does (zerogpt clip_grad_norm, DeepSpeed
    # gradient_clipping, plain torch clip_grad_norm_ with foreach); None: no clipping


def _reset_host_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _host_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


LLAMA_MODELS = ("llama3_8b", "llama3_2_1b", "llama3_2_3b")
"""The model_zoo.llama sizes a Spec may name."""


def llama_shape(spec: Spec) -> dict:
    """The LlamaConfig keys of a Llama Spec: the named size's, at the Spec's depth and vocabulary; a narrower
    (n_head, n_embd) than the size's (the tiny CPU form) gets SwiGLU 3.5x (the 8B's 14336 / 4096) and 4 query
    heads per k/v head."""
    from model_zoo.llama import SIZES

    if spec.model not in LLAMA_MODELS:
        raise ValueError(f"Spec.model={spec.model!r}: valid are 'gpt' and {', '.join(map(repr, LLAMA_MODELS))}")
    n_layer, n_head, n_embd = spec.shape
    shape = dict(SIZES[spec.model], num_hidden_layers=n_layer, vocab_size=spec.vocab)
    if (n_head, n_embd) != (shape["num_attention_heads"], shape["hidden_size"]):
        shape.update(num_attention_heads=n_head, hidden_size=n_embd, intermediate_size=7 * n_embd // 2,
                     num_key_value_heads=max(1, n_head // 4), head_dim=n_embd // n_head)
    return shape


def build_model(spec: Spec, device: torch.device) -> torch.nn.Module:
    """The spec's model, built under whatever device or init context the caller holds."""
    n_layer, n_head, n_embd = spec.shape
    chunk = {} if spec.loss_chunk_size is None else dict(loss_chunk_size=spec.loss_chunk_size)
    if spec.loss_backend is not None:
        chunk["loss_backend"] = spec.loss_backend
    torch.manual_seed(0)
    if spec.model != "gpt":
        from model_zoo.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(**llama_shape(spec), checkpoint=spec.checkpoint, chunked_loss=spec.chunked_loss,
                                 **chunk))
    from model_zoo.gpt import gpt2_small

    return gpt2_small(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=spec.vocab, dropout=0.0,
                      max_position_embeddings=spec.seq, checkpoint=spec.checkpoint, chunked_loss=spec.chunked_loss,
                      **chunk)


def build_hf_llama(spec: Spec) -> torch.nn.Module:
    """transformers' LlamaForCausalLM at the Spec's Llama shape, SDPA attention: plain PyTorch's Llama."""
    import transformers

    shape = llama_shape(spec)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "rope_scaling", "tie_word_embeddings")
    config = transformers.LlamaConfig(**{k: shape[k] for k in keys if k in shape})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def flops_per_token(spec: Spec, model: torch.nn.Module) -> int:
    """PaLM FLOPs per token: model_zoo GPT's own count; a Llama's from its shape (gpu_slices/mfu.py: GQA and the
    whole vocabulary's head counted), the same figure for zerogpt's Llama and transformers'."""
    if spec.model == "gpt":
        return model.flops_per_token(spec.seq)
    from gpu_slices.mfu import llama_flops_per_token

    return llama_flops_per_token(llama_shape(spec), spec.seq)


def inductor_options(mode: str | None) -> dict:
    """The inductor settings torch.compile's `mode` stands for ({} for None or "default"): zerogpt compiles its
    blocks with torch.compile's defaults, so a mode is measured there by setting these for the whole process."""
    if mode in (None, "default"):
        return {}
    import torch._inductor

    return torch._inductor.list_mode_options(mode)


def zerogpt_config(spec: Spec, precision: str) -> dict:
    """The config dict of a zerogpt Spec; only the keys the Spec sets (a key the engine rejects is an error row)."""
    optimizer_device = spec.offload.split("+")[0]  # none | cpu | disk
    offload_optimizer = dict(device=optimizer_device)
    if optimizer_device == "disk":
        offload_optimizer["path"] = spec.offload_path or tempfile.gettempdir()
    if spec.state_dtype is not None:
        offload_optimizer["state_dtype"] = spec.state_dtype
    zero = dict(stage=spec.stage, offload_optimizer=offload_optimizer)
    if spec.offload.endswith("+param"):
        zero["offload_param"] = dict(device="cpu")
    if spec.bucket_mb is not None:
        from zerogpt.zero import BucketTensorShardStrategy

        zero["shard_strategy"] = BucketTensorShardStrategy(bucket_mb=spec.bucket_mb)
    if spec.prefetch is not None:
        zero["prefetch"] = spec.prefetch
    cfg = dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=spec.accum)
    if spec.clip is not None:
        cfg["clip_grad_norm"] = spec.clip
    if spec.host_step_threads is not None:
        cfg["host"] = dict(step_threads=spec.host_step_threads)
    if spec.compile:
        cfg["compile"] = True
    return cfg


def _make_zerogpt(spec: Spec, device: torch.device, precision: str):
    import zerogpt
    from zerogpt.optim import HybridAdam

    cfg = zerogpt.Config(zerogpt_config(spec, precision))
    if spec.meta_init:  # as train_gpt.py builds: no storage; initialize fills each shard from init_param_range
        with torch.device("meta"):
            model = build_model(spec, device)
        engine = zerogpt.initialize(model, dict(type=HybridAdam, lr=1e-4, weight_decay=0.0), config=cfg,
                                    ctx=DistContext.current())
    else:
        with device:
            model = build_model(spec, device)
        engine = zerogpt.initialize(model, HybridAdam(model.parameters(), lr=1e-4, weight_decay=0.0), config=cfg,
                                    ctx=DistContext.current())
    engine.logger.setLevel("WARNING")
    return engine, engine.backward, lambda: (engine.step(), engine.zero_grad()), engine.optimizer, engine.close


def _make_deepspeed(spec: Spec, device: torch.device, precision: str):
    # refused before the import, so the error row names the option even where DeepSpeed is missing
    if spec.offload.startswith("disk") or spec.precision == "fp8" or spec.compile or spec.chunked_loss:
        raise ValueError(f"the DeepSpeed path measures cpu offload in bf16, eager, with the plain loss only; got "
                         f"offload={spec.offload}, precision={spec.precision}, compile={spec.compile}, "
                         f"chunked_loss={spec.chunked_loss}")
    import deepspeed

    zero = {"stage": spec.stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    pin = device.type == "cuda"
    if spec.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if spec.offload == "cpu+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": spec.accum,
              "zero_optimization": zero, "steps_per_print": 1 << 30, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": precision == "bf16"}}
    if spec.clip is not None:
        config["gradient_clipping"] = spec.clip
    if spec.offload != "none":  # AdamW from the config: DeepSpeedCPUAdam, the op prepare_cpu_adam built
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    if spec.meta_init:
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu" if spec.offload == "cpu+param"
                                 else None, pin_memory=pin):
            model = build_model(spec, device)
    else:
        with device:
            model = build_model(spec, device)
    # On the device: torch's fused AdamW, as zerogpt's HybridAdam uses there (no FusedAdam JIT build)
    client = None if spec.offload != "none" else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                                                  fused=device.type == "cuda")
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                 optimizer=client)
    # destroy() drops DeepSpeed's hooks and buffers, so the next spec in this process starts from free memory
    return engine, engine.backward, engine.step, optimizer, getattr(engine, "destroy", lambda: None)


def _make_torch(spec: Spec, device: torch.device, precision: str):
    """The floor: fp32 params, bf16 autocast, torch's fused AdamW, no sharding and no communication;
    compile=True: the whole model through torch.compile (the chunked loss's head too, with chunked_loss)."""
    if spec.offload != "none" or spec.precision == "fp8":
        raise ValueError(f"plain torch runs without offload in bf16/fp32; got offload={spec.offload}, "
                         f"precision={spec.precision}")
    hf = spec.model != "gpt"  # a Llama: transformers' own, as a plain PyTorch user trains it
    if hf and spec.chunked_loss:
        raise ValueError("plain torch's Llama is transformers' LlamaForCausalLM: no chunked loss; got chunked_loss")
    with device:
        model = build_hf_llama(spec) if hf else build_model(spec, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    run = torch.compile(model, mode=spec.compile_mode) if spec.compile else model
    micro = [0]

    def forward(x, **kwargs):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = run(x, **kwargs)
        return out.logits if hf else out  # (B, T, vocab), as model_zoo's models return them

    def backward(loss):
        (loss / spec.accum).backward()

    def step():  # called after every micro-batch, as the engines' step is; acts on the last of the step
        micro[0] += 1
        if micro[0] % spec.accum == 0:
            if spec.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return forward, backward, step, optimizer, lambda: None


def _cpu_seconds() -> tuple[float, float]:
    """(user, sys) CPU seconds of this process so far, every thread (CPU Adam's OpenMP threads too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


@contextlib.contextmanager
def closed_on_error(close):
    """close() the system when the block raises (a GPU out-of-memory mid-step): its hooks, threads and memory go
    before the next try (fit_batch) or spec. A close that fails too is ignored: the first error is the row's."""
    try:
        yield
    except BaseException:
        try:
            close()
        except Exception:
            pass
        raise


def measure(spec: Spec, on_built=lambda facts: None) -> dict:
    """Train `spec` for warmup + steps optimizer steps of `accum` micro-batches each; tokens/s, TFLOPS, MFU, peak
    GPU memory and host RSS of the steps, build seconds and the build's host peak, the first step's seconds,
    CPU user/sys seconds per timed step, with `time_step` the optimizer-step call's mean wall seconds, zerogpt's
    own host-step seconds (engine.last_host_step_s) and with `count_syncs` the device syncs per step after them.
    `on_built(facts)` is called once the system is built, before the first step, with what the build alone tells
    (params, build_s, build_peak_host_gib): a step that fails or is killed later still leaves them.
    With `chunked_loss` the loss is the model's own (`model(x, labels=y).loss`, GPTConfig.chunked_loss);
    `chunked_loss_ran` says every micro-batch's output came without logits (the chunked path ran)."""
    from torch.profiler import record_function

    from model_zoo.gpt import GPTLMLoss
    from zerogpt.trainer.hooks.throughput import device_peak_tflops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = spec.precision or ("bf16" if cuda else "fp32")
    make = dict(zerogpt=_make_zerogpt, deepspeed=_make_deepspeed, torch=_make_torch)[spec.system]
    with torch.device("meta"):
        meta_model = build_model(spec, device)
        num_params = sum(p.numel() for p in meta_model.parameters())  # tied head counted once
        model_flops_per_token = flops_per_token(spec, meta_model)
    t_build = time.perf_counter()
    forward, backward, step, optimizer, close = make(spec, device, precision)
    with closed_on_error(close):
        if cuda:
            torch.cuda.synchronize()
        build_s = time.perf_counter() - t_build
        build_peak_host = _host_peak_bytes()  # the build's peak (the process's, since start-up)
        on_built(dict(params=num_params, build_s=build_s, build_peak_host_gib=build_peak_host / 2**30))
        # peaks from here on: the training steps, not the model's construction
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        _reset_host_peak()
        loss_fn = GPTLMLoss(shift=False)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g).to(device) for _ in range(2)]

        def sync():
            if cuda:
                torch.cuda.synchronize()

        step_call_s = []
        without_logits = []  # chunked_loss: per micro-batch, whether the model's output had no logits

        def micro_loss(x: torch.Tensor) -> torch.Tensor:
            """The loss of one (B, T+1) token window: from the logits, or the model's chunked loss."""
            if not spec.chunked_loss:
                return loss_fn(forward(x[:, :-1]), x[:, 1:])
            out = forward(x[:, :-1], labels=x[:, 1:])  # GPTOutput(loss, logits=None): no (B, T, vocab) logits
            without_logits.append(out.logits is None)
            return out.loss

        def train_step(i: int, time_step: bool = False) -> torch.Tensor:
            """One optimizer step: `accum` micro-batches, the step called after each (it acts on the last).
            The phases are named for the profiler (no-ops without one)."""
            for micro in range(spec.accum):
                x = batches[(i * spec.accum + micro) % 2]
                with record_function("forward"):
                    loss = micro_loss(x)
                with record_function("backward"):
                    backward(loss)
                last = micro == spec.accum - 1
                if last and time_step:
                    sync()
                    t = time.perf_counter()
                with record_function("step"):
                    step()
                if last and time_step:
                    sync()
                    step_call_s.append(time.perf_counter() - t)
            return loss

        t0 = time.perf_counter()
        losses = [train_step(0).item()] if spec.warmup else []
        sync()
        first_step_s = time.perf_counter() - t0  # with compile=True: torch.compile's tracing and codegen too
        losses += [train_step(i).item() for i in range(1, spec.warmup)]
        sync()
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        engine_host_s = []  # zerogpt: the seconds its chunk steps took, as the engine reports them after each step
        for i in range(spec.steps):
            loss = train_step(i, time_step=spec.time_step)
            engine_host_s.append(getattr(forward, "last_host_step_s", None))
        sync()
        seconds = time.perf_counter() - t0
        cpu1 = _cpu_seconds()
        losses.append(loss.item())
        # the engine's figure right after a step may be the one before (the host step behind the next forward): the
        # last timed step's is read once every step has finished
        engine_host_s = engine_host_s[1:] + [getattr(forward, "last_host_step_s", None)]
        engine_host_s = [s for s in engine_host_s if s is not None]
        tokens_per_step = spec.batch * spec.seq * spec.accum
        tokens_per_s = tokens_per_step * spec.steps / seconds
        tflops = tokens_per_s * model_flops_per_token / 1e12
        peak = device_peak_tflops(device)
        traffic = getattr(forward, "last_step_traffic", None)  # zerogpt's engine: the last step's host<->device bytes
        # zerogpt's engine: chunks stepped as their gradient left, and how many of those steps stood or were redone
        host_step = getattr(getattr(forward, "sharded_optim", None), "host_step", None)
        out = dict(spec=asdict(spec), params=num_params, flops_per_token=model_flops_per_token,
                   step_s=seconds / spec.steps, tokens_per_step=tokens_per_step,
                   tokens_per_s=tokens_per_s, tflops=tflops, mfu=tflops / peak if peak else None, losses=losses,
                   peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   peak_host_gib=_host_peak_bytes() / 2**30, build_peak_host_gib=build_peak_host / 2**30,
                   build_s=build_s, first_step_s=first_step_s if spec.warmup else None,
                   cpu_user_s_per_step=(cpu1[0] - cpu0[0]) / spec.steps,
                   cpu_sys_s_per_step=(cpu1[1] - cpu0[1]) / spec.steps,
                   host_step_s=sum(step_call_s) / len(step_call_s) if step_call_s else None,
                   h2d_bytes=traffic.h2d_bytes if traffic is not None else None,
                   d2h_bytes=traffic.d2h_bytes if traffic is not None else None,
                   engine_host_step_s=sum(engine_host_s) / len(engine_host_s) if engine_host_s else None,
                   speculation=None if host_step is None else dict(chunks=len(host_step.spares), stood=host_step.stood,
                                                                   redone=host_step.redone),
                   chunked_loss_ran=bool(without_logits) and all(without_logits))
        if spec.count_syncs:
            out.update(count_syncs(lambda: [train_step(i) for i in range(spec.count_syncs)], spec.count_syncs, cuda))
            sync()
        if spec.profile_to:
            out["profile"] = profile_step(train_step, optimizer, spec, sync, cuda)
        close()
    return out


def count_syncs(run_steps, steps: int, cuda: bool) -> dict:
    """Host<->device synchronizations while `run_steps` runs `steps` optimizer steps with no logging in them
    (the steps between two log steps of a training loop): torch.cuda.set_sync_debug_mode("warn") makes every
    synchronizing CUDA call (a blocking copy to the host, .item(), a stream or device synchronize) warn, and the
    warnings are counted by the Python line that made the call. None on the CPU, where nothing is a device sync."""
    if not cuda:
        return dict(syncs_per_step=None, sync_sites={})
    sites: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename, os.path.dirname(_HERE))}:{w.lineno}"] += 1
    return dict(syncs_per_step=sum(sites.values()) / steps, sync_sites=dict(sites.most_common(12)))


# -------------------------------------------------------------------------------------------------
# (e) the profile of one step

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
                                             "cudaDeviceSynchronize", "cudaMemcpy")), device_ms=None),
    ]
    table = format_table(["part", "host ms", "device ms"],
                         [[r["part"], _fmt(r["host_ms"]), _fmt(r["device_ms"])] for r in rows])
    try:
        top = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25)
    except Exception:  # an older torch names the column self_cuda_time_total
        top = events.table(sort_by="self_cpu_time_total", row_limit=25)
    with open(spec.profile_to, "w") as f:
        f.write(f"one zerogpt step: {spec.label}\n\n{table}\n\ntop ops by self time:\n{top}")
    return rows



def _fmt(x) -> str:
    return "" if x is None else f"{x:,.1f}"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])




def batch_after_oom(spec: Spec, row: dict) -> int | None:
    """The batch to try next after `row`: half of spec.batch when it ran out of GPU memory and fit_batch is set,
    else None (the row is the result). An allocation that failed where torch re-raised it as another error (a
    hook, a worker thread) still says "CUDA out of memory" in its detail."""
    oom = row.get("error") == "gpu_oom" or "out of memory" in str(row.get("detail", "")).lower()
    if spec.fit_batch and oom and spec.batch > 1:
        return spec.batch // 2
    return None


def measure_or_error(spec: Spec, on_built, built: dict) -> dict:
    """measure(spec), under its compile mode's inductor options; a failure is a row too (gpu_oom, or the
    exception's class), with the build's facts when the build had finished."""
    try:
        options = inductor_options(spec.compile_mode) if spec.compile and spec.system == "zerogpt" else {}
        if options:
            from torch._inductor import config as inductor_config

            with inductor_config.patch(options):
                return measure(spec, on_built=on_built)
        return measure(spec, on_built=on_built)
    except torch.cuda.OutOfMemoryError as e:
        return dict(spec=asdict(spec), error="gpu_oom", detail=str(e).splitlines()[0], built=built or None)
    except Exception as e:
        return dict(spec=asdict(spec), error=type(e).__name__, detail=str(e).splitlines()[0] if str(e) else "",
                    built=built or None)


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
    progress = result_path + ".progress"  # which spec and part runs now: a kill's row says where it stopped

    def mark(index: int, part: str, built: dict | None = None) -> None:
        with open(progress, "w") as f:
            json.dump(dict(index=index, part=part, since=time.time(), built=built), f)
    try:
        for index, spec in enumerate(specs):
            mark(index, "build")
            built: dict = {}  # the build's facts, kept in a failed step's row

            def on_built(facts: dict, index: int = index) -> None:
                built.update(facts)
                mark(index, "train", facts)
            tried = []  # fit_batch: the batches that ran out of GPU memory
            while True:
                built.clear()
                row = measure_or_error(spec, on_built, built)
                gc.collect()  # the last system's engine, model and optimizer state, before the next is built
                if cuda:
                    torch.cuda.empty_cache()
                smaller = batch_after_oom(spec, row)
                if smaller is None:
                    break
                tried.append(spec.batch)
                print(f"{spec.label}: GPU out of memory at batch {spec.batch}, trying {smaller}", flush=True)
                spec = replace(spec, batch=smaller, label=spec.label.replace(f"b{spec.batch}x", f"b{smaller}x"))
                mark(index, "build")
            if tried:
                row["oom_batches"] = tried
            results.append(row)
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(rdzv, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print("usage: gpu_measure.py SPECS_JSON RESULT_JSON\n\nThe measurement worker of bench/gpu_check.py, "
              "which starts it in a fresh process per system; run gpu_check.py instead.")
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
