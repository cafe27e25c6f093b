"""`precision = "fp8"`: Linear layers compute in float8 through torchao's float8 training, the rest in bf16.

`convert_linears` swaps each eligible nn.Linear for torchao's Float8Linear, as torchtitan does: the weight
stays the same Parameter (bf16 in ZeRO's chunks, so all-gathers and gradient reductions stay bf16, and the fp32
masters and Adam state are untouched), and each forward casts its input, weight and output gradient to float8
with dynamic per-tensor scales. State dicts keep the plain Linear keys, so checkpoints and Hugging Face exports
are those of a bf16 model.

Which layers convert (`gains_from_float8`, torchao's `module_filter_fn`); the others stay bf16:
- not the LM head: its logits feed the loss, where float8's 3-bit mantissa costs accuracy, and GPT-2 ties it
  to the embedding;
- not a Linear whose in or out features are not multiples of 16 (float8 matmuls need them);
- not a layer too small to gain: in_features <= 4096 and out_features <= 1024. At those shapes the dynamic
  scaling's casts and amax reductions cost more than the float8 matmul saves. The rule is torchao's own for
  tensorwise scaling (the recipe used here): torchao 0.18 `torchao.float8.float8_linear_utils.
  _auto_filter_for_tensorwise`, drawn from the tensorwise performance table of torchao/float8/README.md
  ("Performance", H100), and what torchtitan applies with `filter_fqns = ["auto_filter_small_kn"]`. It is
  written out here, not imported, because torchao marks that function experimental. So a Llama's k_proj and
  v_proj at 1-3B (width 2048-3072, 512-1024 kv features) stay bf16; GPT-2 XL's four Linears all convert.

FP8 runs only compiled (config: precision='fp8' with compile=False is refused, schema.FP8_NEEDS_COMPILE): eager,
the casts are separate kernels and the run is slower than bf16.

Float8 matmuls (torch._scaled_mm) need an NVIDIA GPU of compute capability 8.9 or newer; `convert_for_device`
refuses any other device before converting.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["convert_for_device", "convert_linears", "check_fp8_device", "gains_from_float8", "float8_choice",
           "SKIPPED", "SMALL_IN_FEATURES", "SMALL_OUT_FEATURES"]

SKIPPED = ("lm_head",)
"""Module names (fully qualified, or their last part) left in bf16."""
SMALL_IN_FEATURES, SMALL_OUT_FEATURES = 4096, 1024
"""A Linear with in_features <= SMALL_IN_FEATURES and out_features <= SMALL_OUT_FEATURES stays bf16 (torchao's
tensorwise rule, see the module docstring)."""


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


def convert_linears(model: nn.Module, *, only_gaining: bool = True) -> int:
    """Swap the eligible nn.Linear modules of `model` for torchao Float8Linear in place; returns how many.

    `only_gaining=False` converts small layers too (tests: a tiny model has only small layers). Needs torchao
    (`pip install 'zerogpt[fp8]'`), imported here, not with zerogpt. Works on any device (the conversion allocates
    nothing); only running the converted model needs a float8-capable GPU.
    """
    try:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ImportError(f"precision='fp8' needs torchao's float8 training: pip install 'zerogpt[fp8]' (or pip "
                          f"install torchao); importing it failed with: {e}") from e
    convert_to_float8_training(model, module_filter_fn=gains_from_float8 if only_gaining else _float8_capable)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def convert_for_device(model: nn.Module, device: torch.device) -> int:
    """check_fp8_device, then convert_linears: what initialize does for precision='fp8'."""
    check_fp8_device(device)
    return convert_linears(model)


def float8_choice(model: nn.Module) -> dict[str, bool]:
    """Each nn.Linear's fully qualified name -> whether convert_linears converts it (without torchao)."""
    return {name: gains_from_float8(m, name) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def gains_from_float8(module: nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: True for a Linear that float8 makes faster (the module docstring's rule)."""
    if not _float8_capable(module, fqn):
        return False
    return not (module.in_features <= SMALL_IN_FEATURES and module.out_features <= SMALL_OUT_FEATURES)


def _float8_capable(module: nn.Module, fqn: str) -> bool:
    """Not the head, and a Linear whose dims float8 matmuls take (multiples of 16)."""
    if fqn in SKIPPED or fqn.rsplit(".", 1)[-1] in SKIPPED:
        return False
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
