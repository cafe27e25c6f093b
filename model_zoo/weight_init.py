"""GPT-2's weight init, addressable by element range: any slice of any parameter, computed on its own.

`init_param_range` is what `GPT.init_param_range` returns, and so what a plainly built GPT holds and what
zerogpt.initialize writes into each rank's shards of a GPT built under torch.device("meta"). The values are a
function of the model's `init_seed`, its config and the parameter's name only: not of how the parameter is split,
which rank asks, or what the global RNG did. This file knows the rule and the random stream, not the modules.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

__all__ = ["INIT_BLOCK", "init_param_range", "init_rule", "draw_range"]

INIT_BLOCK = 1 << 16
"""Elements per independently seeded block of a parameter's random init."""

_TIED_TO = {"lm_head.weight": "transformer.wte.weight"}


def _block_seed(init_seed: int, name: str, block: int) -> int:
    """A generator seed for one init block, the same in every process (Python's hash() of a str is not)."""
    digest = hashlib.blake2b(f"{init_seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**64; keep it positive for readability


def init_rule(config: Any, numels: dict[str, int], name: str) -> tuple[str, int, float | None, float]:
    """(canonical name, numel, std of its normal init or None, constant fill when std is None).

    `numels` maps each parameter name of the whole model to its element count, as fixed at build time.
    """
    name = _TIED_TO.get(name, name)  # the head is wte, tied or (on a last pipeline stage) a copy of it
    if name not in numels:
        raise KeyError(f"GPT has no parameter {name!r}; names are those of named_parameters(), e.g. "
                       f"'transformer.h.0.attn.c_attn.weight'")
    numel = numels[name]
    module_name, _, kind = name.rpartition(".")
    if kind == "bias":
        return name, numel, None, 0.0
    if module_name.rpartition(".")[2].startswith("ln_"):  # LayerNorm weight
        return name, numel, None, 1.0
    std = 0.02 / math.sqrt(2 * config.n_layer) if module_name.endswith("c_proj") else 0.02
    return name, numel, std, 0.0


def init_param_range(config: Any, init_seed: int, numels: dict[str, int], name: str, start: int,
                     end: int) -> torch.Tensor:
    """Elements [start, end) of flattened parameter `name` exactly as initialised, however it is split.

    GPT-2 init: N(0, 0.02) weights and embeddings, N(0, 0.02/sqrt(2*n_layer)) for `c_proj` weights (GPT-2
    paper §2.3: 2 residual adds per block), zero biases, LayerNorm ones/zeros, padded vocab rows zero.
    Random values are counter-based: each block of INIT_BLOCK elements of a parameter is drawn whole from
    its own generator seeded by (init_seed, name, block index), so a range costs its overlapping blocks
    only (memory: the range plus one block) and any split concatenates to the whole parameter bit for bit.

    Args:
        config: the model's GPTConfig (n_layer for the c_proj std; vocab_size and n_embd for the padded rows).
        init_seed: the model's `init_seed`, drawn once when it was built.
        numels: parameter name -> element count of the whole (unsplit) model.
        name: a parameter name as in named_parameters(); the tied "lm_head.weight" is "transformer.wte.weight".
        start, end: element offsets into the flattened (unsharded) parameter, 0 <= start <= end <= numel.
    Returns:
        (end - start,) float32 CPU tensor.
    Example:
        >>> init_param_range(GPTConfig(n_layer=2), 7, {"transformer.ln_f.bias": 768}, "transformer.ln_f.bias", 0, 3)
        tensor([0., 0., 0.])
    """
    name, numel, std, fill = init_rule(config, numels, name)
    out = draw_range(init_seed, name, numel, start, end, std, fill)
    if name == "transformer.wte.weight":  # padded vocab rows: never a real token; zero (they get zero grad)
        out[max(0, config.vocab_size * config.n_embd - start):] = 0.0
    return out


def draw_range(init_seed: int, name: str, numel: int, start: int, end: int, std: float | None,
               fill: float = 0.0) -> torch.Tensor:
    """Elements [start, end) of a parameter of `numel` elements drawn N(0, std) (or filled with `fill` when std is
    None), the same however the parameter is split: the counter-based stream every model_zoo family draws from.

    Each block of INIT_BLOCK elements is drawn whole from its own generator seeded by (init_seed, name, block index),
    so a range costs its overlapping blocks only (memory: the range plus one block) and any split concatenates to
    the whole parameter bit for bit.
    """
    if not 0 <= start <= end <= numel:
        raise ValueError(f"init_param_range({name!r}, {start}, {end}): the range must lie within the "
                         f"parameter's {numel} elements (0 <= start <= end <= {numel})")
    if std is None:
        return torch.full((end - start,), fill, dtype=torch.float32, device="cpu")
    out = torch.empty(end - start, dtype=torch.float32, device="cpu")
    # One generator reseeded per block, each whole block drawn straight into `out`: a fresh Generator per block
    # and a temporary per block made this ~40x slower (the build of a meta model was its init). randn is
    # normal_(0, 1) on a new tensor, so the values are the same bits.
    gen, scratch = torch.Generator(device="cpu"), None
    for block in range(start // INIT_BLOCK, -(-end // INIT_BLOCK)):
        lo, hi = block * INIT_BLOCK, min(numel, (block + 1) * INIT_BLOCK)
        gen.manual_seed(_block_seed(init_seed, name, block))
        a, b = max(start, lo), min(end, hi)
        if (a, b) == (lo, hi):
            out[a - start : b - start].normal_(generator=gen)  # whole block, always
        else:
            scratch = torch.empty(INIT_BLOCK, dtype=torch.float32) if scratch is None else scratch
            values = scratch[: hi - lo].normal_(generator=gen)
            out[a - start : b - start] = values[a - lo : b - lo]
    return out.mul_(std)
