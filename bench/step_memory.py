"""Host memory of a training step: zerogpt ZeRO-1/2/3 beside DeepSpeed ZeRO-1/2/3, PyTorch FSDP2 and DDP.

    python bench/step_memory.py                                # gpt2_small, 2 gloo ranks, CPU
    python bench/step_memory.py --models gpt2_6l384 --systems zerogpt-3 deepspeed-3 fsdp2
    python bench/step_memory.py --loss --world 1               # the loss paths: whole-batch logits vs chunked

Every system trains the same GPT-2 as bench/step_time.py (dropout 0, fp32, AdamW, random tokens, one
thread per rank), each on fresh processes. Per step, rank 0 resets the kernel's peak-RSS counter
(`/proc/self/clear_refs` <- 5), runs forward + backward + optimizer step, and reads the peak back
(`VmHWM`): the exact high-water mark of the step, no sampling. Reported: resident memory between steps
("at rest": the model state the system keeps) and the step's peak, medians over the measured steps, both
private to the rank: the shared-memory pages the rank has touched (`RssShmem`: zerogpt's and DeepSpeed's
same-host collectives map one staging area that all ranks of the host share) are taken out and shown apart.

glibc malloc with a fixed mmap threshold of 64 KiB, for every system: each block from 64 KiB up is
mapped fresh and unmapped on free, so resident memory follows what is live. (glibc's default raises the
threshold as blocks are freed, after which freed blocks stay in the heap; zerogpt's own host-memory
setting keeps all freed memory for speed. Either would make a peak look like the process's history.)
The numbers include the Python interpreter and torch (a few hundred MiB), the same for every system.

`--loss` compares the loss paths instead of the systems, on one process: `model(x, labels=y)` with the whole
batch's logits ("plain-loss") and with GPTConfig.chunked_loss ("chunked-loss", model_zoo/loss.py), each step
forward + backward + torch AdamW, measured the same way.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from step_time import MODELS, SYSTEMS, batch, build_model, make_system, run_job  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MIB = 2**20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measure_system(rank: int, system: str, model_name: str, args) -> dict:
    return _measure_steps(make_system(system, build_model(model_name, args.seq, "cpu"), args, rank), rank, args)


LOSSES = ["plain-loss", "chunked-loss"]


def measure_loss(rank: int, system: str, model_name: str, args) -> dict:
    """A plain training step through `model(x, labels=y)`, the loss chunked or not (system: one of LOSSES)."""
    model = build_model(model_name, args.seq, "cpu")
    model.config.chunked_loss = system == "chunked-loss"
    model.lm_head.chunk_size = args.loss_chunk
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return _measure_steps(step, rank, args)


def _measure_steps(step, rank: int, args) -> dict:
    at_rest, peaks, shared = [], [], []
    for i in range(args.warmup + args.steps):
        tokens = batch(rank, i, args)
        dist.barrier()
        rest = _status_bytes("VmRSS") - _status_bytes("RssShmem")
        _reset_peak()
        step(tokens)
        shmem = _status_bytes("RssShmem")  # touched once, then resident: the same at the peak
        peak = _status_bytes("VmHWM") - shmem
        if i >= args.warmup:
            at_rest.append(rest)
            peaks.append(peak)
            shared.append(shmem)
    return {"at_rest": statistics.median(at_rest), "peak": statistics.median(peaks),
            "shared": statistics.median(shared)}


def report(rows: list[dict]) -> str:
    lines = ["| model | system | at rest (MiB) | step peak (MiB) | peak above rest | shared memory (MiB) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['system']} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['model']} | {r['system']} | {r['at_rest'] / MIB:,.0f} | {r['peak'] / MIB:,.0f} | "
                     f"{(r['peak'] - r['at_rest']) / MIB:,.0f} | {r['shared'] / MIB:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt2_small"], choices=list(MODELS))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--port", type=int, default=29534)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--loss", action="store_true", help="compare the plain and the chunked loss (no systems)")
    p.add_argument("--loss-chunk", type=int, default=256, help="tokens per chunk of the chunked loss")
    args = p.parse_args(argv)
    # what step_time's builders and workers read: CPU, fp32, one thread, glibc's default malloc
    args.device, args.dtype, args.threads, args.host_memory = "cpu", torch.float32, 1, "default"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc as each spawned rank starts
    rows = []
    systems, measure = (LOSSES, measure_loss) if args.loss else (args.systems, measure_system)
    for model_name in args.models:
        for system in systems:
            result = run_job(args, system, model_name, measure=measure)
            rows.append({"model": model_name, "system": system, **result})
            print(f"{model_name} {system}: {result}", flush=True)
    print(f"\nrank 0, private memory; {args.world} ranks x 1 thread, micro-batch {args.batch} x {args.seq} "
          f"tokens, cpu, glibc malloc, mmap threshold 64 KiB, torch {torch.__version__}\n")
    print(report(rows))


if __name__ == "__main__":
    main()
