"""Dropout that draws from a rank's own random stream, for the activations only that rank holds.

Under tensor parallelism every rank is seeded alike, and most dropouts must stay that way: they act on
activations every tensor-parallel rank holds whole (the residual stream), and different masks would make the
ranks' copies diverge. But the attention-probability dropout acts on a rank's own heads, and under sequence
parallelism the residual dropouts act on a rank's own positions: drawn from the shared stream, rank 1's heads
or positions would get exactly rank 0's masks. Megatron forks a per-rank stream for these; so does this.

`own_stream(module, rank)` wraps the module's forward: on entry one seed is drawn from the global CPU generator
(the same draw on every rank, so the shared stream stays in step), mixed with the rank, and the module runs on
generators seeded with that; on exit the global state is back, advanced by the one draw. Activation
checkpointing restores the RNG state before it recomputes a segment, so the recomputation draws the same seed
and the same masks. Nothing happens in eval mode or with p = 0: runs without dropout draw nothing extra, and a
module built with p = 0 gets no hooks at all, so a compiled block (zerogpt/compile.py) has none to trace.
"""
from __future__ import annotations

import contextlib
import hashlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["has_own_stream", "own_stream", "rank_stream"]

_OWN_STREAM: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _mixed_seed(seed: int, rank: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def rank_stream(rank: int, device: torch.device) -> Iterator[None]:
    """Run the block on this rank's own random stream, forked from the shared one (see the module doc)."""
    seed = _mixed_seed(int(torch.randint(0, 2**62, (), device="cpu")), rank)
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[device.index if device.index is not None else
                                          torch.cuda.current_device()].manual_seed(seed)
        yield


def _dropout_p(module: nn.Module) -> float:
    return module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout", 0.0)


def _drops(module: nn.Module) -> bool:
    return module.training and _dropout_p(module) > 0


def has_own_stream(module: nn.Module) -> bool:
    """Whether `own_stream` hooked `module` (it drops, p > 0)."""
    return module in _OWN_STREAM


def own_stream(module: nn.Module, rank: int) -> None:
    """Make `module`'s dropout draw from this rank's own stream (forward hooks; always undone, even on error).
    A module with p = 0 never draws, and is left without hooks."""
    if _dropout_p(module) == 0:
        return
    _OWN_STREAM.add(module)
    open_streams: list[contextlib.ExitStack] = []

    def enter(mod: nn.Module, args: tuple[Any, ...]) -> None:
        stack = contextlib.ExitStack()
        if _drops(mod):
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            stack.enter_context(rank_stream(rank, device))
        open_streams.append(stack)

    def leave(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if open_streams:
            open_streams.pop().close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
