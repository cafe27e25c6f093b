"""What both exporters share about a checkpoint's model: its recorded class rebuilt and converted (ModelPlugin),
and the dtype names the weights are written in (DTYPES, resolve_dtype).

Below export.py (Hugging Face) and export_megatron.py (Megatron-LM), so neither imports the other for it. The
conversion is found through the model class the checkpoint records: a transformers class is written as is; any
other "pkg.mod.Cls" plugs in through `hf_config` and `to_hf_tensor` in its adapter module (the class's `adapter`
attribute, else "pkg.mod") and `model_from_config` in "pkg.mod" (model_zoo's families have them).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import torch

from model_zoo.hf import quiet_model_import
from zerogpt.amp import TORCH_DTYPES
from zerogpt.config.dtypes import DTYPES as DTYPE_NAMES

__all__ = ["DTYPES", "AUTO", "ModelPlugin", "resolve_dtype"]

DTYPES = TORCH_DTYPES  # --dtype NAME -> torch dtype: the one table of dtype names (zerogpt/config/dtypes.py)
AUTO = "auto"  # --dtype default: the source checkpoint's dtype (ModelPlugin.source_dtype), else fp32
_DTYPE_NAMES = {d.torch_name: name for name, d in DTYPE_NAMES.items()}  # config.json's spelling -> ours


def _import_class(class_path: str) -> type:
    module_name, _, cls_name = class_path.rpartition(".")
    try:
        with quiet_model_import():  # a transformers model class's import logs torchao's noise
            return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"the checkpoint's model class {class_path!r} cannot be imported ({e}); run from the "
                         f"directory that holds its package (e.g. the zerogpt checkout for model_zoo)") from None


class ModelPlugin:
    """How a checkpoint's recorded model class converts to Hugging Face and is rebuilt (see the module docstring).

    Example:
        >>> plugin = ModelPlugin(CheckpointReader(ckpt).meta["model"])      # doctest: +SKIP
        >>> plugin.hf_config().vocab_size, plugin.to_hf_tensor("transformer.wte.weight", w)[1].shape  # doctest: +SKIP
    """

    def __init__(self, model_meta: dict) -> None:
        self.class_path, self.config = model_meta.get("class"), model_meta.get("config")
        if not self.class_path or self.config is None:
            raise ValueError(f"the checkpoint records no model class/config ({model_meta!r}): it was saved from a "
                             f"model without a `config` attribute, which cannot be converted or rebuilt")
        self.cls = _import_class(self.class_path)
        # A transformers class is already an HF model: same names, same layout, its own config class.
        self.is_transformers = self.class_path.startswith("transformers.")
        self.module = sys.modules[self.cls.__module__]
        # The conversion rules live in the family's adapter module when the class names one (model_zoo's GPT and
        # Llama: `adapter = "model_zoo.hf"`, "model_zoo.llama_adapter"), else beside the class.
        adapter = getattr(self.cls, "adapter", None)
        self.adapter = importlib.import_module(adapter) if isinstance(adapter, str) else self.module

    def _hook(self, name: str, module: Any = None) -> Callable:
        module = module or self.adapter
        if not hasattr(module, name):
            raise ValueError(f"model class {self.class_path} has no Hugging Face conversion: its module "
                             f"{module.__name__} defines no {name}() (see ModelPlugin in zerogpt_tools/export.py)")
        return getattr(module, name)

    def hf_config(self) -> Any:
        if self.is_transformers:
            return self.cls.config_class.from_dict(dict(self.config))
        return self._hook("hf_config")(self.config)

    def source_dtype(self) -> str | None:
        """The dtype config.json gave for the weights this model was loaded from ("bfloat16"), or None.

        A Llama-family model built from a Hugging Face checkpoint keeps config.json's torch_dtype / dtype in its
        config's `extra`; a transformers config holds it itself; a model trained from scratch has none.
        """
        extra = self.config.get("extra")
        for where in (extra if isinstance(extra, dict) else {}, self.config):
            for key in ("dtype", "torch_dtype"):
                if isinstance(where.get(key), str):
                    return where[key].removeprefix("torch.")
        return None

    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return (name, tensor) if self.is_transformers else self._hook("to_hf_tensor")(name, tensor, self.config)

    def build(self) -> torch.nn.Module:
        """A freshly initialised model of the recorded class and config (to load checkpoint tensors into)."""
        if self.is_transformers:
            return self.cls(self.hf_config())
        return self._hook("model_from_config", self.module)(self.config)


def resolve_dtype(dtype: str, plugin: ModelPlugin) -> tuple[str, str | None]:
    """(the DTYPES key to write, a note saying why when --dtype auto chose it from the source checkpoint).

    auto writes what the model's Hugging Face source was stored in, so a continued bf16 Llama exports as the
    bf16 files it came as (half the bytes of fp32, and what transformers' dtype="auto" loads); a model trained
    from scratch has no source and exports its fp32 masters exactly.
    """
    if dtype != AUTO:
        return dtype, None
    source = plugin.source_dtype()
    chosen = _DTYPE_NAMES.get(source, "fp32")
    if chosen != "fp32":
        return chosen, f"the source checkpoint's {source}; --dtype fp32 writes the fp32 masters"
    if source is not None and source not in _DTYPE_NAMES:
        return "fp32", f"the source checkpoint's {source} is not one of {', '.join(DTYPES)}; wrote the fp32 masters"
    return "fp32", None
