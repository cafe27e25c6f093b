"""Hugging Face interop: exact GPT-2 conversion to and from our GPT, and loading local HF models.

Conversion: HF GPT-2 uses Conv1D, whose weight is (in, out), the transpose of nn.Linear's; module names are the
same on both sides (GPT-2's), so the rules are four small functions (configs both ways, one tensor at a time both
ways) that gpt.py's from_hf / to_hf and zerogpt's checkpoint exporter share (GPT.adapter names this module). The
rules see a config as its fields (a GPTConfig or its recorded dict) and give back GPTConfig keyword arguments, so
this module does not import the model: gpt.py imports it.
Megatron-LM: the same GPT-2 as Megatron's names and fused per-head qkv, and its args (section "GPT-2 conversion:
Megatron-LM"; files and TP/PP splits are zerogpt_tools/megatron_layout.py's).
Loading: nothing is downloaded; a directory must hold a `save_pretrained` model, and its safetensors files are
checked before transformers reads them. transformers is imported inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["GELU_APPROXIMATE", "hf_config", "to_hf_tensor", "from_hf_tensor", "gpt_config_from_hf",
           "load_hf_causal_lm", "load_checked", "quiet_model_import", "check_safetensors", "check_hf_dir",
           "config_from_megatron", "megatron_args", "to_megatron", "from_megatron"]

GELU_APPROXIMATE = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
"""GPTConfig.activation -> nn.GELU's `approximate` (the names are transformers' activation_function values)."""

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_VOCAB_ROWS = ("transformer.wte.weight", "lm_head.weight")  # (padded_vocab_size, n_embd): pad rows dropped in HF


class _GPTFields(SimpleNamespace):
    """A GPTConfig's fields with its two derived sizes, as GPTConfig derives them."""

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple


def as_gpt_config(config: Any) -> _GPTFields:
    """A GPTConfig, or its `dataclasses.asdict` form (what checkpoints record), as its fields: the rules read a
    config and give back GPTConfig keyword arguments, so this module does not import the model (gpt.py imports it)."""
    return _GPTFields(**(config if isinstance(config, dict) else dataclasses.asdict(config)))


# ----------------------------------------------------------------------------------------------------------
# GPT-2 conversion: configs and tensors, both ways

def gpt_config_from_hf(hc: Any, **overrides: Any) -> dict[str, Any]:
    """GPTConfig's keyword arguments for a transformers GPT2Config; ValueError for GPT-2 variants our GPT cannot
    reproduce.

    overrides: GPTConfig fields that do not change the weights, e.g. dropout, checkpoint.
    """
    unsupported = {k: getattr(hc, k, None) for k in ("scale_attn_by_inverse_layer_idx", "add_cross_attention")
                   if getattr(hc, k, False)}
    if not getattr(hc, "scale_attn_weights", True):
        unsupported["scale_attn_weights"] = False
    if not getattr(hc, "tie_word_embeddings", True):  # our GPT's head is its embedding: lm_head.weight unread
        unsupported["tie_word_embeddings"] = False
    if hc.activation_function not in GELU_APPROXIMATE:
        unsupported["activation_function"] = hc.activation_function
    if unsupported:
        raise ValueError(f"from_hf supports standard GPT-2 configs only; unsupported settings: {unsupported}; "
                         f"the generic transformers path takes any: model = dict(type='hf', path=DIR, "
                         f"generic=True)")
    return {**dict(vocab_size=hc.vocab_size, max_position_embeddings=hc.n_positions, n_layer=hc.n_layer,
                   n_head=hc.n_head, n_embd=hc.n_embd, n_inner=hc.n_inner, dropout=hc.resid_pdrop,
                   layer_norm_epsilon=hc.layer_norm_epsilon, activation=hc.activation_function), **overrides}


def hf_config(config: Any) -> Any:
    """The transformers GPT2Config of a GPTConfig (real vocab_size: the padded rows are not exported)."""
    from transformers import GPT2Config

    c = as_gpt_config(config)
    return GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.n_embd,
                      n_layer=c.n_layer, n_head=c.n_head, n_inner=c.n_inner, activation_function=c.activation,
                      resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
                      layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=True,
                      # GPT-2's <|endoftext|> is 50256 in GPT-2's own 50,257-token vocabulary only; any other
                      # tokenizer's ids are its own (zerogpt_tools.export sets them from the tokenizer it ships).
                      bos_token_id=50256 if c.vocab_size == 50257 else None,
                      eos_token_id=50256 if c.vocab_size == 50257 else None)


def to_hf_tensor(name: str, tensor: torch.Tensor, config: Any) -> tuple[str, torch.Tensor]:
    """One of our tensors as HF GPT-2 stores it: Conv1D weights transposed, padded vocab rows dropped.

    Names are the same on both sides (GPT-2's module names); the result is contiguous, ready for safetensors.
    """
    if name.endswith(_CONV1D):
        tensor = tensor.t()
    if name in _VOCAB_ROWS:
        tensor = tensor[: as_gpt_config(config).vocab_size]
    return name, tensor.contiguous()


def from_hf_tensor(name: str, tensor: torch.Tensor, config: Any) -> tuple[str, torch.Tensor]:
    """One HF GPT-2 tensor in our layout: Conv1D weights transposed, vocab rows zero-padded to padded_vocab_size."""
    c = as_gpt_config(config)
    if name.endswith(_CONV1D):
        tensor = tensor.t()
    if name in _VOCAB_ROWS and tensor.size(0) < c.padded_vocab_size:
        tensor = torch.cat([tensor, tensor.new_zeros(c.padded_vocab_size - tensor.size(0), tensor.size(1))])
    return name, tensor.contiguous()


# ----------------------------------------------------------------------------------------------------------
# GPT-2 conversion: Megatron-LM. The four hooks zerogpt_tools/megatron_layout.py calls for this family: shapes from
# a checkpoint's `args` and back, and tensors to and from Megatron-Core's names at TP=1, PP=1 (global layer
# indices; the vocabulary rows as they are). Files, legacy names, qkv versions and the TP/PP splits are the
# layout module's. Megatron's GPT-2 is this GPT: pre-LayerNorm, learned positions, biases, a tied head; its fused
# linear_qkv holds each head's [q_h; k_h; v_h] (checkpoint_version >= 2), ours [q; k; v] over all heads.

def _megatron_arg(args: dict[str, Any], key: str, default: Any = None) -> Any:
    value = args.get(key)
    return default if value is None else value


def config_from_megatron(args: dict[str, Any], vocab_size: int, pad_vocab_multiple: int) -> dict[str, Any]:
    """GPTConfig's keyword arguments for a Megatron GPT-2's `args` (a dict of its Namespace); ValueError naming
    the argument for what our GPT cannot reproduce.

    Args:
        vocab_size: the real vocabulary (the tokenizer's), <= args.padded_vocab_size.
        pad_vocab_multiple: chosen so the embedding has args.padded_vocab_size rows, as Megatron's has.
    """
    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"Megatron args {key}={args.get(key)!r}: {why}; model_zoo's GPT cannot reproduce it")

    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    if _megatron_arg(args, "untie_embeddings_and_output_weights", False):
        raise refuse("untie_embeddings_and_output_weights", "GPT-2 ties its head to the word embedding")
    if _megatron_arg(args, "normalization", "LayerNorm") != "LayerNorm":
        raise refuse("normalization", "GPT-2 uses LayerNorm")
    if not _megatron_arg(args, "add_bias_linear", True):
        raise refuse("add_bias_linear", "GPT-2's linear layers have biases")
    if _megatron_arg(args, "apply_residual_connection_post_layernorm", False):
        raise refuse("apply_residual_connection_post_layernorm", "GPT-2 is pre-LayerNorm")
    for key in ("swiglu", "squared_relu", "quick_geglu"):
        if _megatron_arg(args, key, False):
            raise refuse(key, "GPT-2's MLP is GELU")
    if _megatron_arg(args, "group_query_attention", False) and args.get("num_query_groups") not in (None, heads):
        raise refuse("num_query_groups", f"GPT-2 has one k/v head per query head ({heads})")
    if _megatron_arg(args, "kv_channels", hidden // heads) * heads != hidden:
        raise refuse("kv_channels", f"GPT-2's heads are hidden_size / num_attention_heads = {hidden // heads} wide")
    # Megatron's GELU is the tanh approximation when fused with the bias (--bias-gelu-fusion, its default) or
    # with --openai-gelu; the unfused path is torch's exact F.gelu.
    tanh = _megatron_arg(args, "openai_gelu", False) or _megatron_arg(args, "bias_gelu_fusion", False)
    return dict(vocab_size=vocab_size, max_position_embeddings=args["max_position_embeddings"],
                n_layer=args["num_layers"], n_head=heads, n_embd=hidden,
                n_inner=None if _megatron_arg(args, "ffn_hidden_size", 4 * hidden) == 4 * hidden
                else args["ffn_hidden_size"],
                dropout=_megatron_arg(args, "hidden_dropout", 0.0),
                layer_norm_epsilon=_megatron_arg(args, "norm_epsilon", args.get("layernorm_epsilon") or 1e-5),
                activation="gelu_new" if tanh else "gelu", pad_vocab_multiple=pad_vocab_multiple)


def megatron_args(config: Any) -> dict[str, Any]:
    """The Megatron arguments that give a GPTConfig's shape (the layout module adds vocab, TP/PP and the rest).

    GELU: gelu_new is written as --openai-gelu without --bias-gelu-fusion, so transformers' Megatron GPT-2
    converter, which reads those two flags, picks gelu_new as our own Hugging Face export does.
    """
    c = as_gpt_config(config)
    return dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head, kv_channels=c.head_dim,
                ffn_hidden_size=c.n_inner or 4 * c.n_embd, max_position_embeddings=c.max_position_embeddings,
                position_embedding_type="learned_absolute", add_position_embedding=True, normalization="LayerNorm",
                norm_epsilon=c.layer_norm_epsilon, layernorm_epsilon=c.layer_norm_epsilon, swiglu=False,
                add_bias_linear=True, add_qkv_bias=True, group_query_attention=False, num_query_groups=c.n_head,
                untie_embeddings_and_output_weights=False, openai_gelu=c.activation != "gelu",
                bias_gelu_fusion=False, hidden_dropout=c.dropout, attention_dropout=c.dropout)


_MEGATRON_LAYER = {  # our h.{i}. suffix -> Megatron-Core's decoder.layers.{i}. suffix (c_attn is regrouped)
    "ln_1.weight": "input_layernorm.weight", "ln_1.bias": "input_layernorm.bias",
    "attn.c_attn.weight": "self_attention.linear_qkv.weight", "attn.c_attn.bias": "self_attention.linear_qkv.bias",
    "attn.c_proj.weight": "self_attention.linear_proj.weight", "attn.c_proj.bias": "self_attention.linear_proj.bias",
    "ln_2.weight": "pre_mlp_layernorm.weight", "ln_2.bias": "pre_mlp_layernorm.bias",
    "mlp.c_fc.weight": "mlp.linear_fc1.weight", "mlp.c_fc.bias": "mlp.linear_fc1.bias",
    "mlp.c_proj.weight": "mlp.linear_fc2.weight", "mlp.c_proj.bias": "mlp.linear_fc2.bias",
}
_MEGATRON_EMBEDDING = [("transformer.wte.weight", "embedding.word_embeddings.weight"),
                       ("transformer.wpe.weight", "embedding.position_embeddings.weight")]
_MEGATRON_FINAL = [("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
                   ("transformer.ln_f.bias", "decoder.final_layernorm.bias")]
_QKV = ("attn.c_attn.weight", "attn.c_attn.bias")


def _megatron_pairs(config: _GPTFields) -> list[tuple[str, str]]:
    """(our name, Megatron-Core name) for every parameter, in model order (the tied head is wte)."""
    layers = [(f"transformer.h.{i}.{ours}", f"decoder.layers.{i}.{theirs}")
              for i in range(config.n_layer) for ours, theirs in _MEGATRON_LAYER.items()]
    return _MEGATRON_EMBEDDING + layers + _MEGATRON_FINAL


def _regroup_qkv(tensor: torch.Tensor, n_head: int, to_megatron: bool) -> torch.Tensor:
    """[q; k; v] (3, nh, hd, ...) <-> Megatron's per-head [q_h; k_h; v_h] (nh, 3, hd, ...), weight or bias."""
    rest = tensor.shape[1:]
    shape = (3, n_head, -1, *rest) if to_megatron else (n_head, 3, -1, *rest)
    return tensor.reshape(shape).transpose(0, 1).reshape(-1, *rest)


def to_megatron(read: Callable[[str], torch.Tensor],
                config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron-Core name, tensor) of every weight at TP=1, from `read(our name)`; one tensor at a time."""
    c = as_gpt_config(config)
    for ours, theirs in _megatron_pairs(c):
        tensor = read(ours)
        yield theirs, _regroup_qkv(tensor, c.n_head, True) if ours.endswith(_QKV) else tensor


def from_megatron(read: Callable[[str], torch.Tensor],
                  config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of every parameter from `read(Megatron-Core name)` at TP=1: to_megatron's inverse."""
    c = as_gpt_config(config)
    for ours, theirs in _megatron_pairs(c):
        tensor = read(theirs)
        yield ours, _regroup_qkv(tensor, c.n_head, False) if ours.endswith(_QKV) else tensor


# ----------------------------------------------------------------------------------------------------------
# Any local HF causal LM: model = dict(type="hf", path=DIR, ...) in a config

def load_hf_causal_lm(path: str, checkpoint: bool = False, **kwargs: Any) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained(path) from local files only.

    Memory: every rank holds the whole model while loading. transformers maps a checkpoint loaded in its own
    dtype (parameters are views of the safetensors file) and copies one loaded in another; zerogpt.initialize
    then reads all of it on every rank: a measured per-rank peak of 9.5 bytes/param for an fp32 checkpoint at
    stage 3 on 2 ranks (docs/training.md, "Any Hugging Face model").

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
    check_hf_dir(path)
    from transformers.utils import logging as hf_logging  # optional dependency

    # The "Loading weights" bar only where someone watches it, rank 0 in a terminal (as train_gpt's progress
    # bar): in a log every rank would add a line of it.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    if bar_was_on and not (sys.stderr.isatty() and os.environ.get("RANK", "0") == "0"):
        hf_logging.disable_progress_bar()
    try:
        model = load_checked(path, **kwargs)
    finally:
        if bar_was_on and not hf_logging.is_progress_bar_enabled():
            hf_logging.enable_progress_bar()
    if checkpoint:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_checked(path: str, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """`model_class.from_pretrained(path)` (default AutoModelForCausalLM) from local files, refusing in one line
    weights that do not fill the model config.json describes.

    transformers starts a tensor missing from the files at random (a Llama's weights under a hand-edited
    architectures=GPT2LMHeadModel load as a random GPT-2, behind a 40-line table), and a shape mismatch ends in that
    table and a traceback. Here both are a ValueError naming a tensor and the fix; files with extra tensors alone
    load, with transformers' report.
    """
    hf = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    if model_class is None:
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = hf.get("model_type")
        if "auto_map" not in hf and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"{path}/config.json: model_type {model_type!r} (architectures "
                             f"{hf.get('architectures')!r}) is not a causal LM the installed transformers knows; "
                             f"fix config.json's model_type, or point at the model's own directory")
        model_class = AutoModelForCausalLM
    held: list[logging.LogRecord] = []

    def hold_report(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addFilter(hold_report)
    try:
        with quiet_model_import():
            model, info = model_class.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                      **{"ignore_mismatched_sizes": True, **kwargs})
    finally:
        report_logger.removeFilter(hold_report)
    for name, in_files, in_model in sorted(info.get("mismatched_keys") or ()):
        raise ValueError(f"{path}: tensor {name!r} has shape {list(in_files)} but config.json makes it "
                         f"{list(in_model)}; config.json and the weights disagree")
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing:
        extra = f"; the files hold {len(unexpected)} tensors it has no place for (e.g. {unexpected[0]!r})" \
            if unexpected else ""
        raise ValueError(f"{path}: {len(missing)} tensors of the {type(model).__name__} that config.json describes "
                         f"(architectures {hf.get('architectures')!r}, model_type {hf.get('model_type')!r}) are not "
                         f"in its weight files (e.g. {missing[0]!r}){extra}; transformers would start them at random. "
                         f"Check config.json's architectures, model_type and sizes against the checkpoint")
    for record in held:  # extra tensors alone: transformers' own report, as it would have printed it
        report_logger.handle(record)
    return model


@contextlib.contextmanager
def quiet_model_import() -> Iterator[None]:
    """Drop the import noise of a transformers model class, and nothing else, while the block runs.

    A model class's first import pulls in torchao (transformers' quantizer registry). torchao's wheel carries
    kernels built for other Python and CUDA versions, so on import it logs "Failed to load .../_C_*.so" for each,
    and torch warns that it registers Enums as pytree constants: 4 lines per process, none about the run. Exactly
    those records are dropped; any other warning or error prints.
    """
    def not_import_noise(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load ") and ".so" in message)
        return "is an Enum subclass and is now natively supported" not in message

    noisy = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in noisy:
        logger.addFilter(not_import_noise)
    try:
        yield
    finally:
        for logger in noisy:
            logger.removeFilter(not_import_noise)


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
