"""What the sharded-init tests (meta build, ZeroInitContext) share: the largest real storage any op returns while
a model is built, and a few training steps whose losses two builds must agree on."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestAllocation(TorchDispatchMode):
    """Watches every op (entered below ZeroInitContext's own mode, also its scratch work) for the largest real
    storage it returns: a build that materialised a whole parameter shows it here."""

    def __init__(self) -> None:
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.max_bytes = max(self.max_bytes, t.untyped_storage().nbytes())
        return out


def mean_losses(engine, vocab_size: int, steps: int, rank: int, world: int) -> list[float]:
    """`steps` steps on random (2, 16) token batches (each rank its own, seeded by rank); the mean loss over
    the ranks at each step."""
    from model_zoo.gpt import GPTLMLoss

    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab_size, (2, 17), generator=g)
        loss = GPTLMLoss(shift=False)(engine(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = loss.detach().clone().float()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
