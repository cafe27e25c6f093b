"""Dtype and precision names, one table: what "fp32", "bf16" and "fp16" mean wherever a config key
(`precision`, `zero.offload_optimizer.state_dtype`) or a tool's flag (export's --dtype, estimate's --precision)
names a dtype.

No torch here, so the config, memory_model.py and the command lines read it without importing torch;
`zerogpt.amp.TORCH_DTYPES` is the same table as torch dtypes.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["DtypeName", "DTYPES", "Precision", "StateDtype", "compute_dtype_name"]


class DtypeName(NamedTuple):
    torch_name: str
    """torch's attribute (torch.bfloat16), also Hugging Face config.json's `torch_dtype` spelling."""
    itemsize: int
    """Bytes per element."""


DTYPES: dict[str, DtypeName] = {
    "fp32": DtypeName("float32", 4),
    "bf16": DtypeName("bfloat16", 2),
    "fp16": DtypeName("float16", 2),
}
"""zerogpt's dtype names -> torch's name and bytes per element."""

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
"""A run's `precision`: a DTYPES name, or "fp8" (bf16 everywhere but the float8 matmuls in Linear layers:
zerogpt/fp8.py)."""

StateDtype = Literal["fp32", "bf16"]
"""`zero.offload_optimizer.state_dtype`: the DTYPES names that Adam's moments may rest in (the host Adam op's)."""


def compute_dtype_name(precision: str) -> str:
    """The DTYPES name parameters and activations compute in under `precision` ("fp8" -> "bf16")."""
    return "bf16" if precision == "fp8" else precision
