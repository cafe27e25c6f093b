"""The two flat-tensor collectives ZeRO is built on, under their current torch names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and warns on every call of the old names; older torch has only the old ones.
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_flat(output, input, group=None, async_op=False): output = concat of every rank's input."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_flat(output, input, group=None, async_op=False): output = this rank's slice of the sum."""
