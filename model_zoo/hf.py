"""Build any local Hugging Face causal LM from a config's `model = dict(type="hf", path=DIR, ...)`.

Nothing is downloaded: the directory must hold a `save_pretrained` model. GPT-2 weight conversion to and
from our own GPT lives in model_zoo/gpt.py (from_hf / to_hf).
"""
from __future__ import annotations

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
    from zerogpt.export import check_hf_dir  # names a corrupt model.safetensors instead of a traceback

    check_hf_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    if checkpoint:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
