"""`compile = True`: each transformer block's forward through torch.compile, the engine's hooks left outside.

What is compiled is the bound `forward` of each block, not the module (`module.compile()` would wrap
`_call_impl`, and with it every hook registered on the block). So the block's own pre/post-forward hooks run
eagerly around the compiled code, and the gradient hooks (post-accumulate-grad hooks on the parameters,
zero/grad_hooks.py) fire on AccumulateGrad nodes, which AOT autograd leaves outside its graph. Every block runs
the same code on parameters of the same shapes, so the blocks share one compiled graph (dynamo passes module
parameters as graph inputs), compiled on the first step.

At stage 3 the gather hooks (zero/gather_hooks.py) sit on every parameter-owning submodule, inside the blocks:
a compiled block would break its graph at each and recompile as parameters change size between gathered and
released. So the blocks' parameters are first moved to block granularity (`Stage3GatherHooks.gather_per_block`:
one hook pair on the block gathers and releases all of them), and the compiled forward sees plain full-size
parameters. Under tensor parallelism the blocks compile with their DTensor parameters (chunk.py bind_param keeps
each wrapper's storage offset its slot's, which dynamo checks); with dropout on, the modules that draw from a rank's
own stream run eagerly between compiled graphs (parallel/rng.py). There the compiler's caches are turned off for
the process: in torch 2.13 a graph of DTensors split by such a module, loaded from AOTAutograd's cache, computes
wrong gradients for the parameters before the split under sequence parallelism (the same loss;
tests/parallel/test_rng.py), while the graph compiled afresh is right. The public switch
(`torch.compiler.config.force_disable_caches`) takes inductor's other caches with it: a restarted run compiles
afresh instead of loading its graphs, which costs compile time, not step time. A block's arguments that are still
in flight from an asynchronous DTensor redistribution (AsyncCollectiveTensor, e.g. a Llama's embedding output) are
waited on before the compiled code runs (`_waited_inputs`). Pipeline stages compile their own blocks.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.compiler.config
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from zerogpt.zero.gather_hooks import Stage3GatherHooks

__all__ = ["compile_blocks", "find_blocks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the largest nn.ModuleList (or ModuleDict, a pipeline stage's
    `h`) whose entries all have one class; model_zoo GPT's `transformer.h`, HF GPT-2's `transformer.h`, the Llama
    family's `model.layers`."""
    best: list[nn.Module] = []
    for sub in model.modules():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            entries = list(sub.values() if isinstance(sub, nn.ModuleDict) else sub)
            if entries and len({type(e) for e in entries}) == 1 and len(entries) > len(best):
                best = entries
    return best


def compile_blocks(model: nn.Module, *, backend: str | Callable = "inductor",
                   gather_hooks: Stage3GatherHooks | None = None, logger: Any = None) -> int:
    """Compile the forward of each block of `model` (find_blocks); returns how many were compiled.

    Call after the engine's hooks are registered (build_engine.initialize does). With a logger, the first
    step's time (the compilation's cost) is logged once, when the second forward starts.

    Args:
        backend: a torch.compile backend ("inductor"; tests use "aot_eager" or a counting backend).
        gather_hooks: stage 3's Stage3GatherHooks (engine.gather_hooks), moved to one hook pair per block before
            the blocks are compiled; None at stages 0-2.
        logger: where the compile time goes (the launch log); None = nowhere.
    Example:
        >>> compile_blocks(gpt2_tiny(), backend="aot_eager")
        2
    """
    blocks = find_blocks(model)
    if any(isinstance(p, DTensor) for block in blocks for p in block.parameters()):
        torch.compiler.config.force_disable_caches = True  # see the module docstring
    if gather_hooks is not None:
        gather_hooks.gather_per_block(blocks)
    for block in blocks:
        block.forward = _waited_inputs(torch.compile(block.forward, backend=backend))
    if logger is not None and blocks:
        _log_first_step(model, len(blocks), logger)
    return len(blocks)


def _waited_inputs(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` called with its AsyncCollectiveTensor arguments waited on first.

    Under tensor parallelism DTensor's redistributions are asynchronous: a module's output may be torch's
    AsyncCollectiveTensor, which waits at its first use. Into a compiled block straight from one (a Llama's first
    layer takes the vocab-parallel embedding's all-reduced or reduce-scattered output as it is; GPT adds the
    positions first, which waits), dynamo compiles a second graph for that block (a tensor-subclass input), whose
    backward hands the redistribution a plain gradient where it needs a DTensor (torch 2.13: "'Tensor' object
    has no attribute '_local_tensor'"). Waiting here, eagerly, is what the block's first op would do: the same
    values, and every block then shares one graph."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

    def forward(*args: Any, **kwargs: Any) -> Any:
        # wait_tensor on the wrapper itself, not AsyncCollectiveTensor.wait() (on its inner tensor, which autograd
        # does not track: the gradient would stop here): an autograd op whose backward is the identity
        args = tuple(wait_tensor(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args)
        return compiled(*args, **kwargs)

    return forward


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
