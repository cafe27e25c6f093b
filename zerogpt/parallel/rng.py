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
module built with p = 0 is left as it is.

Pipeline stages are the converse: every rank starts from one seed, so stage s's blocks would draw exactly the masks
stage 0's blocks draw (layer L/P's the same as layer 0's). `seed_stage(stage)` forks the shared stream once per
stage after the model is built, as Megatron offsets its seed by 100 x the pipeline rank; the ranks of one stage
(its tensor- and data-parallel ranks) still draw alike.

The wrapper is a function torch.compile does not trace (`torch.compiler.disable`): inside a compiled block
(zerogpt/compile.py) the module runs eagerly between two compiled graphs, on its own stream, while the block's other
dropouts draw from inductor's generator, seeded from the shared stream alike on every rank. Forward hooks would be
traced instead: guarded per module (a recompile per block) and blind to inductor's random numbers.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["own_stream", "rank_stream", "seed_stage"]


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


def seed_stage(stage: int) -> None:
    """Put pipeline stage `stage` on its own stream: one draw from the shared global CPU generator (the same on
    every rank), mixed with the stage, seeds torch's generators (the CPU's and every CUDA device's)."""
    torch.manual_seed(_mixed_seed(int(torch.randint(0, 2**62, (), device="cpu")), stage))


def _dropout_p(module: nn.Module) -> float:
    return module.p if isinstance(module, nn.Dropout) else getattr(module, "dropout", 0.0)


def _drops(module: nn.Module) -> bool:
    return module.training and _dropout_p(module) > 0


def own_stream(module: nn.Module, rank: int) -> None:
    """Make `module`'s dropout draw from this rank's own stream (its forward wrapped; always undone, even on
    error). A module with p = 0 never draws, and is left as it is."""
    if _dropout_p(module) == 0:
        return
    forward = module.forward

    @torch.compiler.disable
    def forward_on_own_stream(*args: Any, **kwargs: Any) -> Any:
        if not _drops(module):
            return forward(*args, **kwargs)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        with rank_stream(rank, device):
            return forward(*args, **kwargs)

    module.forward = forward_on_own_stream
