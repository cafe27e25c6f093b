"""What the sharded-init tests measure: the largest real storage any op returns while a model is built."""
from __future__ import annotations

import torch
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
