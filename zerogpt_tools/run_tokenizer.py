"""A run's tokenizer: where it is (find_tokenizer) and how it is written so transformers 4 and 5 load it
(save_tokenizer). Shared by export, generate, extend_vocab and import_megatron.

A run's own copy lives in RUN/tokenizer (import_megatron --tokenizer writes it there); a trained run names its
tokenizer in the config it recorded (data.tokenizer).
"""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["find_tokenizer", "save_tokenizer", "run_tokenizer_dir", "TOKENIZER_HINT"]

TOKENIZER_HINT = ("pass --tokenizer DIR (the tokenizer the model was trained with, e.g. the run's data.tokenizer "
                  "or a `python -m data_pipeline train-tokenizer` output)")


def run_tokenizer_dir(checkpoint_dir: str) -> str | None:
    """RUN/tokenizer for a checkpoint RUN/checkpoints/step_N, when that directory exists; else None."""
    parent = os.path.dirname(os.path.abspath(checkpoint_dir))
    if os.path.basename(parent) != "checkpoints":
        return None
    path = os.path.join(os.path.dirname(parent), "tokenizer")
    return path if os.path.isdir(path) else None


def find_tokenizer(explicit: str | None, reader: Any = None, model_dir: str | None = None) -> str | None:
    """The tokenizer path to use: --tokenizer, else an HF dir's own files, else the run's own RUN/tokenizer, else
    the run config's data.tokenizer; None when none of them names one."""
    if explicit:
        if not os.path.exists(explicit):
            raise ValueError(f"--tokenizer {explicit}: no such file or directory")
        return explicit
    if model_dir and {"tokenizer.json", "tokenizer_config.json", "vocab.json"} & set(os.listdir(model_dir)):
        return model_dir
    if reader is not None and (own := run_tokenizer_dir(reader.directory)):
        return own
    if reader is not None and reader.config_path:
        from zerogpt.config import Config, data_config

        try:
            path = data_config(Config.from_file(reader.config_path)).tokenizer
        except Exception as e:  # the recorded config imports code that is not importable here, or no longer loads
            raise ValueError(f"cannot read data.tokenizer from the run config {reader.config_path} "
                             f"({type(e).__name__}: {e}); {TOKENIZER_HINT}") from e
        if path and not os.path.exists(path):
            raise ValueError(f"the run config {reader.config_path} names data.tokenizer={path!r}, which does not "
                             f"exist from {os.getcwd()} (a relative path is resolved from the current directory); "
                             f"{TOKENIZER_HINT}")
        return path
    return None


def save_tokenizer(tok: Any, out_dir: str, model_max_length: int | None = None) -> None:
    """Save `tok` so AutoTokenizer loads it in transformers 4 and 5 (as data_pipeline's tokenizer dirs do)."""
    tok.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast", None):
        # transformers 5's generic class name is unknown to 4.x; this one means "tokenizer.json as is" in both.
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.pop("backend", None)
    for key in ("is_local", "local_files_only"):  # load-time arguments that transformers 5 writes back
        config.pop(key, None)
    if model_max_length:
        config["model_max_length"] = model_max_length
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
