"""The llama3b slice: Llama-3.2-3B at sequence 4096 (the largest micro-batch that fits) without offload, zerogpt
and transformers (compute_llama.py)."""
from __future__ import annotations

from gpu_slices import compute_llama


def run(args, budget, result: dict, save) -> None:
    compute_llama.run("llama3b", args, budget, result, save)
