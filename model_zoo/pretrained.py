"""Hugging Face checkpoints into model_zoo's native families, streamed: `from_pretrained(DIR)`.

config.json names the architecture; a Llama-family one (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM) builds model_zoo's `Llama` on the meta device with the safetensors files as its weight source
(`Llama.weight_source`, read through `init_param_range`; model_zoo/llama.py load_pretrained). zerogpt.initialize
then fills each rank's shards straight from the files, reading only the rows that cover them: no rank holds the
whole model, not even in passing. Outside zerogpt, `device="cpu"` (or "cuda") fills a whole model one tensor at a
time. Other architectures are not native: `load_path` says which path a directory takes and what it costs, and
model_zoo.build_model takes the others through transformers (model_zoo.hf.load_hf_causal_lm).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_zoo.llama import Llama, load_pretrained
from model_zoo.llama_adapter import ARCHITECTURES, GENERIC_PATH, MODEL_TYPES, native_architecture
from model_zoo.safetensors_source import read_hf_config

__all__ = ["from_pretrained", "is_native", "LoadPath", "load_path"]


@dataclass(frozen=True)
class LoadPath:
    """How a Hugging Face directory loads: natively (streamed into model_zoo's Llama) or through transformers."""

    directory: str
    native: bool
    architecture: str | None
    """the class it loads as: the native one, else config.json's label (or model_type when it has none)"""
    note: str | None = None
    """why the path differs from what config.json's label suggests, when it does"""

    def describe(self) -> str:
        """The one line a loader prints before it loads: the path taken and what it costs."""
        if self.native:
            return (f"model: {self.directory} ({self.architecture}) loads natively, streamed: model_zoo's Llama on "
                    f"the meta device, each rank reading only its own shards from the safetensors files")
        return (f"model: {self.directory} ({self.architecture}) loads through transformers' generic path "
                f"(AutoModelForCausalLM): the whole model on every rank while loading, ~9.5 bytes/param of host "
                f"memory per rank at peak; the native, streamed architectures are {', '.join(ARCHITECTURES)}")


def load_path(directory: str, generic: bool = False) -> LoadPath:
    """Which path `model = dict(type="hf", path=directory)` takes, chosen on config.json's `architectures` (its
    model_type deciding where the two contradict, as llama_adapter.native_architecture explains).

    Args:
        generic: the config's generic=True: transformers' path whatever the architecture.
    Raises:
        ValueError in one line for an architecture neither native nor known to transformers as a causal LM, naming
        the four native ones and the generic path.
    """
    hf = read_hf_config(directory)
    label = (hf.get("architectures") or [hf.get("model_type")])[0]
    arch, note = native_architecture(hf)
    if arch is not None and not generic:
        return LoadPath(directory, True, arch, note)
    model_type = hf.get("model_type")
    if "auto_map" not in hf and not _transformers_causal_lm(model_type):  # auto_map: the model's own code
        raise ValueError(f"{directory}/config.json: architectures={hf.get('architectures')!r} (model_type "
                         f"{model_type!r}) is neither one of the four native architectures ({', '.join(ARCHITECTURES)})"
                         f" nor a causal LM the installed transformers knows, which {GENERIC_PATH} needs")
    if generic:
        note = "generic=True in the model dict" + (f" (it is native as {arch})" if arch else "")
    elif label in ARCHITECTURES:
        note = (f"config.json's architectures says {label} but its model_type {model_type!r} is not "
                f"{', '.join(MODEL_TYPES)}: the fields are {model_type}'s, so transformers loads it")
    return LoadPath(directory, False, label, note)


def _transformers_causal_lm(model_type: str | None) -> bool:
    """Whether AutoModelForCausalLM builds this model_type (transformers is imported only here, for the check)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_native(directory: str) -> bool:
    """Whether config.json describes an architecture model_zoo builds natively (the Llama family)."""
    return native_architecture(read_hf_config(directory))[0] is not None


def from_pretrained(directory: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> Llama:
    """A native model of a local Hugging Face checkpoint, its weights streamed from the safetensors files.

    Args:
        directory: a save_pretrained directory (config.json, model.safetensors or sharded files with their index).
        device: "meta" (default): no storage; zerogpt.initialize fills each rank's shards from the files. Any other
            device: the whole model is filled there, one tensor at a time.
        dtype: the parameters' dtype off the meta device (the values are read as stored and cast).
        overrides: config fields that do not change the weights (checkpoint, chunked_loss, loss_chunk_size,
            attention_dropout, pad_vocab_multiple).
    Raises:
        ValueError naming config.json for an architecture no native family reproduces.
    Example:
        >>> model = from_pretrained("checkpoints/Meta-Llama-3.1-8B", checkpoint=True)   # doctest: +SKIP
        >>> engine = zerogpt.initialize(model, optimizer, config=cfg, ctx=ctx)           # doctest: +SKIP
    """
    return load_pretrained(directory, device=device, dtype=dtype, **overrides)
