"""`precision = "fp8"`: Linear layers compute in float8 through torchao's float8 training, the rest in bf16.

`convert_linears` swaps each eligible nn.Linear for torchao's Float8Linear, as torchtitan does: the weight
stays the same Parameter (bf16 in ZeRO's chunks, so all-gathers and gradient reductions stay bf16, and the fp32
masters and Adam state are untouched), and each forward casts its input, weight and output gradient to float8
with dynamic per-tensor scales. The LM head is skipped (its logits feed the loss, where float8's 3-bit mantissa
costs accuracy, and GPT-2 ties it to the embedding), and so is any Linear whose dims are not multiples of 16
(float8 matmuls need them). State dicts keep the plain Linear keys, so checkpoints and Hugging Face exports are
those of a bf16 model.

Float8 matmuls (torch._scaled_mm) need an NVIDIA GPU of compute capability 8.9 or newer; `convert_for_device`
refuses any other device before converting.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["convert_for_device", "convert_linears", "check_fp8_device", "SKIPPED"]

SKIPPED = ("lm_head",)
"""Module names (fully qualified, or their last part) left in bf16."""


def check_fp8_device(device: torch.device) -> None:
    """Raise ValueError (a user error: the launch reports it in one line) unless `device` can run float8 matmuls
    (CUDA, compute capability >= 8.9)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index) >= (8, 9):
            return
        name = f"{torch.cuda.get_device_name(index)} (compute capability " \
               f"{'.'.join(map(str, torch.cuda.get_device_capability(index)))})"
    else:
        name = f"{device.type!r}"
    raise ValueError(f"precision='fp8' needs float8 matmuls, which run only on an NVIDIA GPU of compute capability "
                       f"8.9 or newer (L4, L40, H100, H200, B200); this run's device is {name}. Use precision='bf16' "
                       f"(--set precision=bf16)")


def convert_linears(model: nn.Module) -> int:
    """Swap the eligible nn.Linear modules of `model` for torchao Float8Linear in place; returns how many.

    Needs torchao (`pip install 'zerogpt[fp8]'`). Works on any device (the conversion allocates nothing);
    only running the converted model needs a float8-capable GPU.
    """
    try:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ImportError(f"precision='fp8' needs torchao's float8 training: pip install 'zerogpt[fp8]' (or pip "
                          f"install torchao); importing it failed with: {e}") from e
    convert_to_float8_training(model, module_filter_fn=_eligible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def convert_for_device(model: nn.Module, device: torch.device) -> int:
    """check_fp8_device, then convert_linears: what initialize does for precision='fp8'."""
    check_fp8_device(device)
    return convert_linears(model)


def _eligible(module: nn.Module, fqn: str) -> bool:
    if fqn in SKIPPED or fqn.rsplit(".", 1)[-1] in SKIPPED:
        return False
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
