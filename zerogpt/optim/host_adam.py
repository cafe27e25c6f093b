"""The fused host Adam step (csrc/host_adam.cpp): one pass per chunk shard from gradient to compute copy.

An offloaded step is bound by host memory bandwidth, so passes are what it costs. DeepSpeed's op updates
(master, grad, m, v) in one pass, then the engine casts the master into the compute copy in a second and
unscales/clips the gradient in a third; this op does all three in one, takes bf16 moments beside the fp32 master
(`zero.offload_optimizer.state_dtype='bf16'`: 4 bytes/param of state instead of 8), and runs on torch's own
intra-op thread pool. Built once per machine with ninja, like DeepSpeed's op, and cached in
~/.cache/torch_extensions: at install (`zerogpt build-ops`), else at first use, which says so (op_build.py).
"""
from __future__ import annotations

import os
from typing import Any

import torch

HOST_ADAM_DTYPES = (torch.float32, torch.bfloat16)  # what the op reads and writes besides the fp32 master
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "host_adam.cpp")
_NAME = "zerogpt_host_adam"  # its folder and library in torch's extension cache
_op: tuple[Any, str | None] | None = None  # (module or None, failure reason)


def load_host_adam() -> tuple[Any, str | None]:
    """Build/load the op once per process; returns (op or None, why it failed)."""
    global _op
    if _op is None:
        try:
            from torch.utils.cpp_extension import load

            from zerogpt.optim.op_build import HOST_ADAM, announced_build

            flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
            with announced_build(HOST_ADAM, _NAME, [_SOURCE]):  # a build says so: one line before, one after
                _op = (load(name=_NAME, sources=[_SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                            verbose=False), None)
        except Exception as e:  # compiler or ninja missing, ...
            _op = (None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _op


def require_host_adam(why: str) -> Any:
    """The op, or a RuntimeError that says what needed it and how to get it."""
    op, err = load_host_adam()
    if op is None:
        raise RuntimeError(f"{why} needs zerogpt's fused host Adam op, which failed to build ({err}); install "
                           f"ninja and a C++ compiler (g++), or set zero.offload_optimizer.state_dtype='fp32'")
    return op


def seed_of(chunk_index: int, rank: int) -> int:
    """The stochastic-rounding seed of one chunk shard: distinct per chunk and rank, the same on resume."""
    return (chunk_index * 1_000_003 + rank * 7_919) & 0x7FFFFFFF


def host_adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   adamw: bool, bias_correction: bool = True, grad_scale: float = 1.0,
                   out: torch.Tensor | None = None, seed: int = 0,
                   decay_ranges: list[tuple[int, int]] | None = None,
                   start: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One Adam(W) update of `master` in place; `out` (fp32 or bf16, master's size) receives the new master.

    `start` (master, exp_avg, exp_avg_sq): the state to update from, left as it is; `master`, `exp_avg` and
    `exp_avg_sq` then only receive the result, the same bits an update in place would leave. A speculative step
    (zerogpt/zero/host_step.py) writes a spare set this way, so the state it started from survives its rejection.

    `step` is the count after this update (1 first). `decay_ranges`, sorted (start, end) element ranges, are the
    only elements that take weight decay (a chunk shard's weights, not its biases and norms); None: all do.
    Moments may be fp32 or bf16; the gradient fp32 or bf16, multiplied by `grad_scale` as it is read. Both bf16
    moments are rounded stochastically at every beta: round-to-nearest drops a step's change below half an ulp (a
    bias where beta is near 1) and measured no better on the demo's betas (0.9, 0.95) (bench/README.md, "bf16 Adam
    moments").
    """
    op = require_host_adam("an Adam step with a fused compute copy or bf16 moments")
    op.adam_step(master, grad, exp_avg, exp_avg_sq, out, int(step), float(lr), float(betas[0]), float(betas[1]),
                 float(eps), float(weight_decay), bool(adamw), bool(bias_correction), float(grad_scale), int(seed),
                 None if decay_ranges is None else [int(i) for r in decay_ranges for i in r],
                 *(start if start is not None else (None, None, None)))
