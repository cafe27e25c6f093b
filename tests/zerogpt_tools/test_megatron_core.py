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
FAMILIES = ("gpt", "llama")
CASES = [(family, fmt) for family in FAMILIES for fmt in ("torch", "torch_dist")]


def _run_on_cpu(tp: int) -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    parallel_state.initialize_model_parallel(tp, 1)
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def _args(family: str, fmt: str, tp: int):
    if family == "gpt":
        return ref.gpt_args(tp, ckpt_format=fmt)
    return ref.llama_args(tp, ckpt_format=fmt, bf16=False, params_dtype=torch.float32)


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
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), parallel_output=False,
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type,
                     rotary_base=getattr(args, "rotary_base", 10000),
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
    """The checkpoint Megatron-LM's save_checkpoint writes for `model` (this rank's part; every rank calls)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if fmt == "torch_dist":
        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, directory)
    else:
        rank_dir = os.path.join(directory, f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")
        os.makedirs(rank_dir)
        torch.save({"model": model.state_dict(), **common}, os.path.join(rank_dir, "model_optim_rng.pt"))
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    return root


def load_megatron(model: torch.nn.Module, root: str, fmt: str) -> list[str]:
    """Load an exported checkpoint into `model` as Megatron-LM loads one; returns the weights it did not get."""
    from megatron.core import dist_checkpointing, parallel_state

    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if fmt == "torch_dist":
        sharded = model.sharded_state_dict()
        local_to_te = {local: te for te, local in TE_NORMS.items()}
        for value in sharded.values():
            _, _, name = getattr(value, "key", "").partition("decoder.layers.")
            if name in local_to_te:
                value.key = f"decoder.layers.{local_to_te[name]}"
        sharded = {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}
        loaded = dist_checkpointing.load(sharded, directory)  # with common.pt's args, iteration, ...
        state = {k: v for k, v in loaded.items() if k in sharded}
    else:
        rank_dir = os.path.join(directory, f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")
        state = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)["model"]
        state = {_local_name(k): v for k, v in state.items() if not k.endswith("_extra_state")}
    result = model.load_state_dict(state, strict=False)
    return [k for k in result.missing_keys if not k.endswith("_extra_state")] + result.unexpected_keys


def _local_name(key: str) -> str:
    head, sep, tail = key.partition(".layers.")
    layer, _, name = tail.partition(".")
    return f"{head}{sep}{layer}.{TE_NORMS[name]}" if name in TE_NORMS else key


def _rank(rank: int, world: int, init: str, root: str) -> None:
    """One rank of Megatron's TP = `world`: each case saved, imported and exported (rank 0), loaded back."""
    import torch.distributed as dist

    from tests.zerogpt_tools.test_megatron import zerogpt_logits
    from zerogpt_tools.export_megatron import export_megatron
    from zerogpt_tools.import_megatron import import_megatron

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    _run_on_cpu(world)
    out = {}
    for family, fmt in CASES if world == 1 else [(family, "torch") for family in FAMILIES]:
        where = os.path.join(root, f"tp{world}_{family}_{fmt}")
        args = _args(family, fmt, world)
        model = megatron_model(args, seed=0)
        source = save_megatron(model, args, os.path.join(where, "megatron"), fmt)
        dist.barrier()
        if rank == 0:
            stats = import_megatron(source, os.path.join(where, "run"))
            export_megatron(os.path.join(where, "run"), os.path.join(where, "back"), tp=1 if fmt == "torch_dist"
                            else world, core=True, dist=fmt == "torch_dist")
            out[(world, family, fmt)] = dict(imported=zerogpt_logits(stats["checkpoint"]),
                                             format=stats["source"].format)
        dist.barrier()
        back = megatron_model(args, seed=1)
        not_loaded = load_megatron(back, os.path.join(where, "back"), fmt)
        # tensor parallel: every rank runs the forwards; rank 0 keeps them
        logits = dict(megatron=megatron_logits(model), back=megatron_logits(back), not_loaded=not_loaded)
        if rank == 0:
            out[(world, family, fmt)].update(logits)
    if rank == 0:
        torch.save(out, os.path.join(root, f"results_tp{world}.pt"))
    dist.destroy_process_group()


def run_cases(root: str, world: int) -> None:
    """The child process: `world` ranks (not daemons: Megatron's writer starts a process of its own)."""
    import torch.multiprocessing as mp

    init = os.path.join(tempfile.mkdtemp(prefix="zerogpt-rdzv-"), "rdzv")
    mp.spawn(_rank, args=(world, init, root), nprocs=world, join=True)


@pytest.mark.timeout(300)
def test_megatron_cores_own_checkpoints_in_and_zerogpts_export_back(tmp_path):
    """Both families in both formats at TP = 1; the torch format at TP = 2, one file per tensor rank (torch_dist at
    TP = 2 hangs in Megatron's writer on gloo, not tried further)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for world in (1, 2):
        code = f"from tests.zerogpt_tools.test_megatron_core import run_cases; run_cases({str(tmp_path)!r}, {world})"
        child = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=140,
                               env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"))
        assert child.returncode == 0, child.stderr[-4000:]
        results.update(torch.load(tmp_path / f"results_tp{world}.pt", weights_only=False))
    assert len(results) == len(CASES) + len(FAMILIES)
    for case, r in results.items():
        assert r["format"] == case[2] and r["not_loaded"] == [], (case, r["not_loaded"])
        torch.testing.assert_close(r["imported"], r["megatron"], atol=2e-5, rtol=0, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(r["back"], r["megatron"], atol=2e-5, rtol=0, msg=lambda m: f"{case} back: {m}")
