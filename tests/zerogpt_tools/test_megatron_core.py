"""Megatron-LM checkpoints made by Megatron-Core itself, in and out of zerogpt (zerogpt_tools.import_megatron and
export --format megatron).

megatron-core (installed with the dev extra) builds its own GPTModel, a GPT-2 (learned positions, LayerNorm, GELU
with bias fusion, tied head) and a Llama (RoPE, RMSNorm, SwiGLU, 4 query heads in 2 groups, untied head), and gives
the reference logits with its own forward. Its files: the torch format holds that module's own state_dict in the
dict Megatron-LM's save_checkpoint writes; torch_dist is written by Megatron-Core's `dist_checkpointing.save`. The
import must give Megatron's logits, and Megatron must load zerogpt's export back (torch format: `load_state_dict`,
as Megatron-LM loads it; torch_dist: `dist_checkpointing.load`) to the same logits. Our export writes Transformer
Engine's names (a GPU run's default spec); on the CPU Megatron-Core builds the local spec, whose norms are their own
modules, so the load back renames those four keys (TE_NORMS below, from Megatron-Core's two layer specs).

Megatron-Core assumes CUDA in three places these models reach, none of them arithmetic: its writer synchronizes the
device, its RoPE moves a buffer to `torch.cuda.current_device()`, and its attention forks the CUDA RNG tracker
(dropout is off here). The child process (one gloo rank; not a daemon, since Megatron's writer starts a process
of its own) replaces those three with CPU no-ops before it builds anything.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.zerogpt_tools import megatron_reference as ref

pytest.importorskip("megatron.core")

ITERATION, SEQ = 7, 24
TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
CASES = [("gpt", "torch"), ("gpt", "torch_dist"), ("llama", "torch"), ("llama", "torch_dist")]


def _run_on_cpu() -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    parallel_state.initialize_model_parallel(1, 1)
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def _args(family: str, fmt: str):
    if family == "gpt":
        return ref.gpt_args(ckpt_format=fmt)
    return ref.llama_args(ckpt_format=fmt, bf16=False, params_dtype=torch.float32)


def megatron_model(args, seed: int) -> torch.nn.Module:
    """Megatron-Core's GPTModel (local spec) as `args` describe it, fp32, with random weights, norms and biases."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = args.position_embedding_type == "rope"
    shape = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                 ffn_hidden_size=args.ffn_hidden_size, use_cpu_initialization=True, params_dtype=torch.float32,
                 hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    if llama:
        config = TransformerConfig(**shape, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                                   normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon, gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, add_bias_linear=False)
    else:
        config = TransformerConfig(**shape, layernorm_epsilon=args.layernorm_epsilon, bias_activation_fusion=True,
                                   activation_func=torch.nn.functional.gelu)
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type, rotary_base=getattr(args, "rotary_base", 10000),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    with torch.no_grad():  # Megatron starts norms at 1 and biases at 0: make them tell a mix-up
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    return model.eval()


def megatron_logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, ref.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    with torch.no_grad():
        return model(ids, torch.arange(SEQ)[None].expand(2, SEQ), attention_mask=causal)[..., :ref.VOCAB]


def save_megatron(model: torch.nn.Module, args, root: str, fmt: str) -> str:
    """The checkpoint Megatron-LM's save_checkpoint writes for `model` at TP = PP = 1."""
    from megatron.core import dist_checkpointing

    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if fmt == "torch_dist":
        os.makedirs(directory)
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, directory)
    else:
        os.makedirs(os.path.join(directory, "mp_rank_00"))
        torch.save({"model": model.state_dict(), **common}, os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    return root


def load_megatron(model: torch.nn.Module, root: str, fmt: str) -> list[str]:
    """Load an exported checkpoint into `model` as Megatron-LM loads one; returns the weights it did not get."""
    from megatron.core import dist_checkpointing

    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if fmt == "torch_dist":
        sharded = model.sharded_state_dict()
        local_to_te = {local: te for te, local in TE_NORMS.items()}
        for value in sharded.values():
            prefix, _, name = getattr(value, "key", "").partition("decoder.layers.")
            if name in local_to_te:
                value.key = f"decoder.layers.{local_to_te[name]}"
        sharded = {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}
        loaded = dist_checkpointing.load(sharded, directory)  # with common.pt's args, iteration, ...
        state = {k: v for k, v in loaded.items() if k in sharded}
    else:
        state = torch.load(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"), weights_only=False)["model"]
        state = {_local_name(k): v for k, v in state.items() if not k.endswith("_extra_state")}
    result = model.load_state_dict(state, strict=False)
    return [k for k in result.missing_keys if not k.endswith("_extra_state")] + result.unexpected_keys


def _local_name(key: str) -> str:
    head, sep, tail = key.partition(".layers.")
    layer, _, name = tail.partition(".")
    return f"{head}{sep}{layer}.{TE_NORMS[name]}" if name in TE_NORMS else key


def run_cases(root: str) -> None:
    """The child process: every case, its tensors saved to ROOT/results.pt."""
    import torch.distributed as dist

    from tests.zerogpt_tools.test_megatron import zerogpt_logits
    from zerogpt_tools.export_megatron import export_megatron
    from zerogpt_tools.import_megatron import import_megatron

    init = os.path.join(tempfile.mkdtemp(prefix="zerogpt-rdzv-"), "rdzv")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    _run_on_cpu()
    out = {}
    for family, fmt in CASES:
        where = os.path.join(root, f"{family}_{fmt}")
        args = _args(family, fmt)
        model = megatron_model(args, seed=0)
        stats = import_megatron(save_megatron(model, args, os.path.join(where, "megatron"), fmt),
                                os.path.join(where, "run"))
        export_megatron(os.path.join(where, "run"), os.path.join(where, "back"), core=True,
                        dist=fmt == "torch_dist")
        back = megatron_model(args, seed=1)
        not_loaded = load_megatron(back, os.path.join(where, "back"), fmt)
        out[(family, fmt)] = dict(megatron=megatron_logits(model), imported=zerogpt_logits(stats["checkpoint"]),
                                  back=megatron_logits(back), not_loaded=not_loaded, format=stats["source"].format)
    torch.save(out, os.path.join(root, "results.pt"))
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_megatron_cores_own_checkpoints_in_and_zerogpts_export_back(tmp_path):
    code = f"from tests.zerogpt_tools.test_megatron_core import run_cases; run_cases({str(tmp_path)!r})"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=220,
                           env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"))
    assert child.returncode == 0, child.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for case, r in results.items():
        assert r["format"] == case[1] and r["not_loaded"] == [], (case, r["not_loaded"])
        torch.testing.assert_close(r["imported"], r["megatron"], atol=2e-5, rtol=0, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(r["back"], r["megatron"], atol=2e-5, rtol=0, msg=lambda m: f"{case} back: {m}")
