"""The llama1b slice: Llama-3.2-1B at sequence 2048 without offload, zerogpt and transformers (compute_llama.py)."""
from __future__ import annotations

from gpu_slices import compute_llama


def run(args, budget, result: dict, save) -> None:
    compute_llama.run("llama1b", args, budget, result, save)
