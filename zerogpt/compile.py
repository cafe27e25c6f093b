"""`compile = True`: each transformer block's forward through torch.compile, the engine's hooks left outside.

What is compiled is the bound `forward` of each block, not the module (`module.compile()` would wrap
`_call_impl`, and with it every hook registered on the block). So the block's own pre/post-forward hooks run
eagerly around the compiled code, and the gradient hooks (post-accumulate-grad hooks on the parameters,
zero/grad_hooks.py) fire on AccumulateGrad nodes, which AOT autograd leaves outside its graph. Every block runs
the same code on parameters of the same shapes, so the blocks share one compiled graph (dynamo passes module
parameters as graph inputs), compiled on the first step.

Stage 3 is left eager: its gather hooks sit on every parameter-owning submodule inside a block (each Linear and
LayerNorm, zero/gather_hooks.py), so a compiled block would break its graph at each of them and recompile as
their parameters change size between gathered and released. Compiling there needs the gather hooks moved to
block granularity first. Tensor parallelism is left eager too: dynamo (torch 2.13) fails on a DTensor
parameter whose local tensor is a chunk slot (chunk.py bind_param). Pipeline stages compile their own blocks.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["compile_blocks", "find_blocks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the largest nn.ModuleList (or ModuleDict, a pipeline stage's
    `h`) whose entries all have one class; model_zoo GPT's `transformer.h`, HF GPT-2's `transformer.h`."""
    best: list[nn.Module] = []
    for sub in model.modules():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            entries = list(sub.values() if isinstance(sub, nn.ModuleDict) else sub)
            if entries and len({type(e) for e in entries}) == 1 and len(entries) > len(best):
                best = entries
    return best


def compile_blocks(model: nn.Module, *, backend: str | Callable = "inductor", stage: int = 0,
                   logger: Any = None) -> int:
    """Compile the forward of each block of `model` (find_blocks); returns how many were compiled.

    Call after the engine's hooks are registered (build_engine.initialize does). With a logger, the first
    step's time (the compilation's cost) is logged once, when the second forward starts.

    Args:
        backend: a torch.compile backend ("inductor"; tests use "aot_eager" or a counting backend).
        stage: the ZeRO stage; at 3 nothing is compiled (see the module docstring) and a warning says so, as
            under tensor parallelism.
        logger: where the compile time goes (the launch log); None = nowhere.
    Example:
        >>> compile_blocks(gpt2_tiny(), backend="aot_eager")
        2
    """
    blocks = find_blocks(model)
    reason = _why_eager(blocks, stage)
    if reason:
        if logger is not None and blocks:
            logger.warning(f"compile=True: blocks left eager {reason}")
        return 0
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    if logger is not None and blocks:
        _log_first_step(model, len(blocks), logger)
    return len(blocks)


def _why_eager(blocks: list[nn.Module], stage: int) -> str:
    """Why these blocks cannot be compiled here (see the module docstring), or ''."""
    from torch.distributed.tensor import DTensor

    if stage == 3:
        return ("at zero.stage=3 (its gather hooks sit inside each block, on every Linear and LayerNorm, and "
                "would break the compiled graph)")
    if any(isinstance(p, DTensor) for block in blocks for p in block.parameters()):
        return "under tensor parallelism (dynamo fails on DTensor parameters bound to chunk slots)"
    return ""


def _log_first_step(model: nn.Module, count: int, logger: Any) -> None:
    """Log the time from the first training forward to the second: the first step, compilation of forward
    and backward included (an evaluation before it compiles its own no-grad graph, not counted). A root
    pre-forward hook that removes itself once it has logged."""
    started: list[float] = []

    def hook(module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if not started:
            started.append(time.perf_counter())
            return
        logger.info(f"compiled {count} blocks; first compiled step took {time.perf_counter() - started[0]:.1f} s")
        handle.remove()

    handle = model.register_forward_pre_hook(hook)
