"""Build any local Hugging Face causal LM from a config's `model = dict(type="hf", path=DIR, ...)`.

Nothing is downloaded: the directory must hold a `save_pretrained` model. GPT-2 weight conversion to and
from our own GPT lives in model_zoo/gpt.py (from_hf / to_hf).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn


def load_hf_causal_lm(path: str, checkpoint: bool = False, **kwargs: Any) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained(path) from local files only.

    Args:
        path: directory written by `save_pretrained` (config.json + weights).
        checkpoint: enable HF gradient (activation) checkpointing.
        kwargs: passed to from_pretrained (e.g. dtype=torch.bfloat16, attn_implementation="sdpa").
    Returns:
        the HF model; calling it returns an output object with `.logits` (GPTLMLoss accepts it directly).
    """
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model = dict(type='hf', path={path!r}): no config.json there; point path at a "
                         f"directory written by save_pretrained (nothing is downloaded)")
    from transformers import AutoModelForCausalLM  # optional dependency

    check_hf_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    if checkpoint:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def check_safetensors(paths: list[str], model_dir: str) -> None:
    """Each file opens as safetensors: a corrupt or truncated one is named here, not deep in transformers' loader."""
    from safetensors import safe_open

    for path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError for a missing file
            raise ValueError(f"{path} is corrupt, truncated or missing ({type(e).__name__}: {e}); export the "
                             f"checkpoint again: python -m zerogpt_tools.export RUN_DIR --out {model_dir}") from None


def check_hf_dir(model_dir: str) -> None:
    """Before transformers loads `model_dir`: its safetensors weights (if it has any) open."""
    if not os.path.isdir(model_dir):
        return  # the loader's own error names the missing directory
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    check_safetensors([os.path.join(model_dir, n) for n in names], model_dir)
