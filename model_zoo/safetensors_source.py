"""A Hugging Face checkpoint directory read a slice at a time: its config.json, and the tensors of model.safetensors
(or of the shards its model.safetensors.index.json names), by name and flat element range, through safetensors' own
slice reads.

This is how pretrained weights reach a meta-built model: zerogpt.initialize asks the model for each rank's element
ranges (`init_param_range`), and the model asks this for them, so a rank reads only the rows that cover its shards
and the whole model never exists in one process. A file is opened for each read and closed after it: its mapped
pages are let go at once, so the host holds the engine's state plus about one tensor, never the checkpoint.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

__all__ = ["SafetensorsDir", "read_hf_config", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: str) -> dict[str, Any]:
    """config.json of a local HF model directory, with one-line errors for a missing or unreadable one."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: no config.json there; point at a directory written by save_pretrained "
                         f"(nothing is downloaded)")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


class SafetensorsDir:
    """The tensors of an HF model directory: names, shapes, and any element range of any tensor as fp32.

    Example:
        >>> src = SafetensorsDir("checkpoints/Meta-Llama-3.1-8B")                     # doctest: +SKIP
        >>> src.shape("model.norm.weight"), src.read_range("model.norm.weight", 0, 4)  # doctest: +SKIP
    """

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); it needs a "
                                 f"'weight_map' of tensor name -> file") from None
        elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
            weight_map = None
        else:
            bins = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))] \
                if os.path.isdir(directory) else []
            raise ValueError(f"{directory} holds no {SINGLE_FILE} or {INDEX_FILE}"
                             + (f" (only {', '.join(sorted(bins)[:3])}: PyTorch pickles are not read; convert them "
                                f"with transformers' save_pretrained(..., safe_serialization=True))" if bins else
                                "; point at a directory written by save_pretrained"))
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._file: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for fname in files:
            path = os.path.join(directory, fname)
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        self._meta[name] = (tuple(piece.get_shape()), piece.get_dtype())
                        self._file[name] = path
            except Exception as e:  # safetensors' own SafetensorError, or OSError for a missing shard
                raise ValueError(f"{path} is corrupt, truncated or missing ({type(e).__name__}: {e}); download or "
                                 f"save the checkpoint again") from None

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[self._known(name)][0]

    def dtype_name(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F32", ...)."""
        return self._meta[self._known(name)][1]

    def _known(self, name: str) -> str:
        if name not in self._meta:
            raise KeyError(f"{self.directory} has no tensor {name!r} (it has {len(self._meta)} tensors, e.g. "
                           f"{', '.join(list(self._meta)[:3])})")
        return name

    def read_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of dim 0 (all of a 0-d tensor), as stored: only those bytes are read."""
        from safetensors import safe_open

        with safe_open(self._file[self._known(name)], framework="pt") as f:
            piece = f.get_slice(name)
            return piece[lo:hi] if self.shape(name) else piece[:]

    def read_range(self, name: str, start: int, end: int, rows: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor as fp32, read as the rows of dim 0 that cover them.

        Args:
            rows: the row count of the tensor it fills, when that has more rows than the file (a vocabulary padded
                for matmul speed): the extra rows read as zeros.
        """
        shape = self.shape(name)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        stored_rows = shape[0] if shape else 1
        rows = stored_rows if rows is None else rows
        if not 0 <= start <= end <= rows * row:
            raise ValueError(f"{name}: range [{start}, {end}) lies outside its {rows * row} elements")
        lo, hi = start // row, -(-end // row)
        out = torch.empty((hi - lo) * row, dtype=torch.float32)
        stored = max(0, min(hi, stored_rows) - lo) * row
        if stored:  # cast while copying into `out`: no fp32 temporary beside it
            out[:stored].copy_(self.read_rows(name, lo, lo + stored // row).reshape(-1))
        out[stored:].zero_()
        return out[start - lo * row: end - lo * row]

    def describe(self) -> dict[str, Any]:
        """Tensor count and total stored bytes, for log lines."""
        sizes = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
        total = sum(math.prod(s) * sizes.get(d, 4) for s, d in self._meta.values())
        return dict(tensors=len(self._meta), bytes=total)
