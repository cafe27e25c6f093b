"""The Llama family under tensor, sequence and pipeline parallelism (zerogpt/parallel/families.py), gloo CPU, fp32.

Hugging Face checkpoints of every architecture (tests/model_zoo/hf_families.py), built on meta by
`model_zoo.from_pretrained`, sharded by `parallelize` and filled by `initialize` at TP=2, give transformers' logits,
and their TP2 checkpoint reads back as the Hugging Face tensors; a tiny Qwen3-like model (qk-norm, qkv bias, tied
head, GQA) trains at TP2, TP2 + SP and TP2 x PP2 + SP, an untied Llama at PP2, to the losses, grad norms and eval
loss of one process on the same global batch (test_tp_pp.py's Trainer runs); k/v heads that T does not divide are
refused before launch.
"""
from __future__ import annotations

import os

import pytest
import torch

from model_zoo.llama import Llama, LlamaConfig
from tests.dist_utils import run_distributed
from tests.model_zoo.hf_families import FAMILIES, VOCAB as HF_VOCAB, make_hf_model
from tests.parallel.test_pipeline import RTOL
from tests.parallel.test_tp_pp import _fit, reference
from tests.zero.recipes import SEQ, VOCAB

IDS = torch.randint(0, HF_VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
TP2_OVERRIDES = {"mistral": dict(num_key_value_heads=2)}  # its fixture is multi-query: 1 k/v head, refused at T=2
# (family, ZeRO stage, sequence_parallel): every family at stage 1; stage 3 (parameters gathered per module) with
# qk-norm, and with qkv biases, a tied head and SP
LOGIT_RUNS = [(family, 1, False) for family in sorted(FAMILIES)] + [("qwen3", 3, False), ("qwen2", 3, True)]


def tiny_qwen3(**overrides) -> torch.nn.Module:
    """4 layers, width 64, 4 query / 2 k/v heads of 32 (head_dim != width / heads), qk-norm, qkv bias, tied head;
    seeded 0."""
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=SEQ, qk_norm=True, qkv_bias=True,
                                       tie_word_embeddings=True, architecture="Qwen3ForCausalLM"), **overrides}))


def tiny_llama_untied(**overrides) -> torch.nn.Module:
    return tiny_qwen3(qk_norm=False, qkv_bias=False, tie_word_embeddings=False, architecture="LlamaForCausalLM",
                      **overrides)


# -- logits: from_pretrained (meta) -> parallelize -> initialize at TP=2 equal transformers' ------------------

def _tp2_logits(rank: int, world: int, root: str) -> dict:
    import zerogpt
    from model_zoo import from_pretrained
    from tests.parallel.engines import parallel_engine
    from zerogpt.parallel import ParallelDims

    torch.set_num_threads(1)
    out = {}
    for family, stage, sequence_parallel in LOGIT_RUNS:
        model = from_pretrained(os.path.join(root, family))
        config = zerogpt.Config(dict(zero=dict(stage=stage), precision="fp32"))
        engine, _ = parallel_engine(model, ParallelDims(tp=2), config, lambda m: torch.optim.AdamW(m.parameters()),
                                    sequence_parallel=sequence_parallel)
        engine.eval()
        with torch.no_grad():
            logits = engine(IDS)  # vocab-sharded: (2, 12, 256 / 2) per rank, the padded classes -inf
        out[(family, stage, sequence_parallel)] = (logits.to_local().shape, logits.full_tensor()[..., :HF_VOCAB])
        if stage == 3:  # one checkpoint of the TP2 pieces, read whole by the test
            engine.save_checkpoint(os.path.join(root, f"ckpt_{family}"))
        engine.close()
    return out


@pytest.mark.timeout(200)
def test_tp2_logits_equal_transformers_for_every_family(tmp_path):
    expected, models = {}, {}
    for family in sorted(FAMILIES):
        models[family] = make_hf_model(family, tmp_path / family, seed=len(family), **TP2_OVERRIDES.get(family, {}))
        with torch.no_grad():
            expected[family] = models[family](IDS).logits
    for rank, out in enumerate(run_distributed(_tp2_logits, 2, str(tmp_path), timeout=180)):
        for (family, stage, sp), (local_shape, logits) in out.items():
            assert local_shape == (2, 12, 128), (family, local_shape)
            diff = (logits - expected[family]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {family} TP2 ZeRO-{stage} sp={sp}: max diff {diff}"
    # the checkpoint's pieces (plain row / column blocks, q/k-norms and the row-parallel o_proj's input split,
    # biases with their rows) read back whole: the Hugging Face tensors, the padded vocab rows after them
    from zerogpt.checkpoint import CheckpointReader

    for family in {family for family, stage, _ in LOGIT_RUNS if stage == 3}:
        reader = CheckpointReader(str(tmp_path / f"ckpt_{family}"))
        assert reader.parallel == {"tp": 2, "pp": 1, "dp": 1}
        hf = models[family]
        for name, value in hf.state_dict().items():
            if name == "lm_head.weight" and hf.config.tie_word_embeddings:
                continue
            torch.testing.assert_close(reader.tensor(name)[:value.size(0)], value, rtol=0, atol=0,
                                       msg=lambda m: f"{family} {name}: {m}")


# -- training: TP2, TP2 + SP, PP2, TP2 x PP2 + SP as one process ---------------------------------------------

def _fits(rank: int, world: int, settings: list[tuple]) -> list[dict]:
    """test_tp_pp._fit of each (tp, pp, zero stage, meta, sequence_parallel, factory) in turn, on the same ranks."""
    return [_fit(rank, world, *setting) for setting in settings]


def _assert_trains_as_one_process(runs: list[dict], ref: dict, what: str) -> None:
    for r, run in enumerate(runs):
        for key in ("losses", "norms", "eval"):
            torch.testing.assert_close(run[key], ref[key], rtol=RTOL, atol=0,
                                       msg=lambda m: f"{what} rank {r} {key}: {m}")


@pytest.mark.timeout(300)
def test_tp2_and_pp2_train_as_one_process():
    """TP2 (meta build, ZeRO-1), TP2 + SP (ZeRO-3) of the Qwen3-like model, PP2 of the untied one (meta, ZeRO-1)
    on 2 ranks. The qk-norm weights act on each rank's own heads: without their gradient summed over the
    tensor-parallel ranks, the TP2 run's losses leave the one-process run's from the second step."""
    settings = [(2, 1, 1, True, False, tiny_qwen3), (2, 1, 3, False, True, tiny_qwen3),
                (1, 2, 1, True, False, tiny_llama_untied)]
    runs = run_distributed(_fits, 2, settings, timeout=280)
    refs = {tiny_qwen3: reference(1, tiny_qwen3), tiny_llama_untied: reference(1, tiny_llama_untied)}
    for i, (tp, pp, stage, meta, sp, factory) in enumerate(settings):
        what = f"TP{tp} PP{pp} ZeRO-{stage} sp={sp} {factory.__name__}"
        _assert_trains_as_one_process([run[i] for run in runs], refs[factory], what)
    tp_run, first, last = runs[0][0], runs[0][2], runs[1][2]
    assert "model.layers.0.self_attn.q_norm.weight" in tp_run["local_names"]
    # untied: the first stage holds the embedding and layers 0-1, the last layers 2-3, the norm and its own head
    assert "model.embed_tokens.weight" in first["local_names"] and "lm_head.weight" not in first["local_names"]
    assert {"model.norm.weight", "lm_head.weight", "model.layers.3.mlp.up_proj.weight"} <= set(last["local_names"])
    assert "model.layers.1.mlp.up_proj.weight" not in last["local_names"]


@pytest.mark.timeout(300)
def test_tp2_pp2_with_sequence_parallelism_trains_as_one_process():
    """The tied head's last-stage copy of the vocab-parallel embedding (meta build, ZeRO-2); the last stage receives
    (B, T/2, C) sequence shards, and its RoPE still covers the T positions its attention gathers (families.py,
    later_stage_sp)."""
    runs = run_distributed(_fits, 4, [(2, 2, 2, True, True, tiny_qwen3)], timeout=280)
    _assert_trains_as_one_process([run[0] for run in runs], reference(1, tiny_qwen3), "TP2 x PP2 + SP")
    assert "lm_head.weight" in runs[3][0]["local_names"] and "model.embed_tokens.weight" in runs[1][0]["local_names"]


# -- the k/v heads' refusal ----------------------------------------------------------------------------------

def test_kv_heads_that_t_does_not_divide_are_refused_before_launch():
    from zerogpt.config import Config
    from zerogpt.parallel import ParallelDims
    from zerogpt.preflight import PreflightError, check_parallel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 is not divisible by parallel.tensor.size=2"):
        ParallelDims(tp=2).check_config(config)
    ParallelDims(pp=2).check_config(config)  # a pipeline splits layers only

    def on_meta() -> torch.nn.Module:
        with torch.device("meta"):
            return Llama(config)

    run = Config(BATCH_SIZE=2, zero=dict(stage=1), parallel=dict(tensor=dict(size=2)))
    with pytest.raises(PreflightError, match=r"model \(Llama, .*\): num_key_value_heads=1 is not divisible by "
                                             r"parallel.tensor.size=2; each tensor-parallel rank holds whole"):
        check_parallel(run, 2, on_meta)
    with pytest.raises(PreflightError, match=r"num_attention_heads=4 is not divisible by parallel.tensor.size=8"):
        check_parallel(Config(BATCH_SIZE=2, zero=dict(stage=1), parallel=dict(tensor=dict(size=8))), 8, on_meta)
