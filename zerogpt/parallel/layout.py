"""How one rank's local tensor of a parameter maps onto the unsharded parameter (pure arithmetic, no tensors moved).

With tensor parallelism a rank holds, per parameter, a TP-local tensor: the unsharded parameter cut along one
dimension into (global start, length) blocks, concatenated in order (Megatron's layout: a column-parallel fused
QKV weight (3C, C) at T=2 keeps half of each of q, k and v; a row-parallel weight (C, 4C) keeps one half of its
columns). ZeRO then shards the flat local tensor over the data-parallel ranks. Checkpoints record the layout of
every piece so a piece can be placed in the unsharded parameter, and a rank of another layout can find the
elements it needs (checkpoint.py). The engine exposes its layouts as `engine.param_layouts` (name -> layout;
absent = the local tensor is the whole parameter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch


@dataclass(frozen=True)
class ParamLayout:
    """A local tensor as blocks of the unsharded parameter along one dimension.

    Example (fused QKV weight (3C, C), C = 64, T = 2, rank 1):
        >>> ParamLayout((192, 64), 0, ((32, 32), (96, 32), (160, 32))).local_shape
        (96, 64)
    """

    global_shape: tuple[int, ...]
    """The unsharded parameter's shape."""
    dim: int = 0
    """The dimension the blocks cut; every other dimension is whole."""
    blocks: tuple[tuple[int, int], ...] = ()
    """(global start, length) along `dim`, concatenated in order to form the local tensor; () = the whole dim."""

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        if not shape:
            if self.blocks:
                raise ValueError(f"a 0-dim parameter cannot be split, got blocks {self.blocks}")
            return
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"layout dim {self.dim} is out of range for shape {list(shape)}")
        blocks = tuple((int(s), int(n)) for s, n in self.blocks) or ((0, shape[self.dim]),)
        for start, length in blocks:
            if start < 0 or length < 0 or start + length > shape[self.dim]:
                raise ValueError(f"layout block ({start}, {length}) is outside dim {self.dim} of size "
                                 f"{shape[self.dim]} (shape {list(shape)})")
        object.__setattr__(self, "blocks", blocks)

    @classmethod
    def whole(cls, shape: Iterable[int]) -> "ParamLayout":
        """The layout of a tensor that is the whole parameter (no tensor parallelism, or replicated)."""
        return cls(tuple(shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if not self.global_shape:
            return ()
        shape = list(self.global_shape)
        shape[self.dim] = sum(length for _, length in self.blocks)
        return tuple(shape)

    @property
    def is_whole(self) -> bool:
        """True when the local tensor is the whole parameter, in order (a replicated parameter)."""
        return not self.global_shape or self.blocks == ((0, self.global_shape[self.dim]),)

    def to_json(self) -> dict:
        return {"shape": list(self.global_shape), "dim": self.dim, "blocks": [list(b) for b in self.blocks]}

    @classmethod
    def from_json(cls, obj: dict) -> "ParamLayout":
        return cls(tuple(obj["shape"]), obj["dim"], tuple(tuple(b) for b in obj["blocks"]))


def as_layout(layout: Any, local_shape: Iterable[int], name: str = "parameter") -> ParamLayout:
    """`layout` (a ParamLayout, anything with global_shape/dim/blocks, or None = whole) checked against the
    shape of the local tensor it describes; ValueError naming the parameter if they disagree."""
    local_shape = tuple(local_shape)
    if layout is None:
        return ParamLayout.whole(local_shape)
    if not isinstance(layout, ParamLayout):
        layout = ParamLayout(tuple(layout.global_shape), layout.dim, tuple(tuple(b) for b in layout.blocks))
    if layout.local_shape != local_shape:
        raise ValueError(f"{name}: its layout {layout} describes a local tensor of shape {list(layout.local_shape)}, "
                         f"but the rank holds {list(local_shape)}")
    return layout


def local_from_full(full: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """The local tensor `layout` describes, cut from the unsharded parameter `full` (a copy unless whole)."""
    if tuple(full.shape) != layout.global_shape:
        raise ValueError(f"tensor of shape {list(full.shape)} does not match the layout's {list(layout.global_shape)}")
    if layout.is_whole:
        return full
    return torch.cat([full.narrow(layout.dim, start, length) for start, length in layout.blocks], dim=layout.dim)


def global_runs(layout: ParamLayout, start: int, end: int) -> list[tuple[int, int, int]]:
    """Where elements [start, end) of the flattened local tensor lie in the flattened unsharded parameter.

    Returns (global offset, local offset, length) runs, each contiguous in both, in local order, adjacent runs
    merged. A local tensor of shape (outer, L, inner) (L = its blocks along `dim`) has one run per outer index
    and block: a dim-0 split gives one run per block, a dim-1 split of a (C, 4C) weight one per row.
    """
    if start >= end:
        return []
    if layout.is_whole:
        return [(start, start, end - start)]
    shape, dim = layout.global_shape, layout.dim
    inner = math.prod(shape[dim + 1:])
    local_row = sum(length for _, length in layout.blocks) * inner  # local elements per outer index
    global_row = shape[dim] * inner
    runs: list[tuple[int, int, int]] = []
    for outer in range(start // local_row, (end - 1) // local_row + 1):
        local = outer * local_row
        for block_start, length in layout.blocks:
            lo, hi = max(start, local), min(end, local + length * inner)
            if lo < hi:
                _append(runs, (outer * global_row + block_start * inner + lo - local, lo, hi - lo))
            local += length * inner
    return runs


def _append(runs: list[tuple[int, int, int]], run: tuple[int, int, int]) -> None:
    """Add `run`, merged into the last one when it continues it in both numberings."""
    if runs:
        g, loc, n = runs[-1]
        if g + n == run[0] and loc + n == run[1]:
            runs[-1] = (g, loc, n + run[2])
            return
    runs.append(run)


def overlaps(want: list[tuple[int, int, int]], have: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Copies that move `have`'s elements into `want`'s: (have offset, want offset, length), merged.

    Both are global_runs lists, offsets relative to their own buffers (e.g. a rank's slice and a saved piece):
    an element at global offset g is copied from have's buffer to want's when both runs contain g.
    """
    want, have = sorted(want), sorted(have)
    out: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(want) and j < len(have):
        wg, wl, wn = want[i]
        hg, hl, hn = have[j]
        lo, hi = max(wg, hg), min(wg + wn, hg + hn)
        if lo < hi:
            _append(out, (hl + lo - hg, wl + lo - wg, hi - lo))
        if wg + wn <= hg + hn:
            i += 1
        else:
            j += 1
    return out
