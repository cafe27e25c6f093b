"""Checkpoints across tensor (T), pipeline (P) and data (D) parallelism (zerogpt/checkpoint.py, format version 2).

The engines here hold what TP and PP engines hold: Megatron-style TP-local slices of a tiny GPT's parameters with
`engine.param_layouts` saying where they lie, and pipeline stages holding their layers (the last with its own copy
of the tied head, `engine.tied_copies`). Their state is a reference taken from a real world-1 run after two
steps, cut by each engine's layouts. A checkpoint saved at (T, P, D) = (2, 1, 2) loads at (1, 2, 1), (2, 1, 1) and
(1, 1, 1) with masters, Adam state and parameters bit-equal to the reference; at (1, 1, 1) training then continues
bit-identically to the run that never stopped, and its Hugging Face export gives the reference logits.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from model_zoo.gpt import gpt2_tiny
from tests.dist_utils import run_distributed
from tests.layouts import (KINDS, TIED_HEAD, engine_mismatches, fill_engine, pipeline_stage, reference_from_checkpoint,
                           reference_from_engine, tp_local_model)
from tests.zero.reference import train_losses

VOCAB, SEQ, BATCH, LR, STEPS = 128, 16, 4, 3e-3, 2


def tiny_model():
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_embd=64)


def make_engine(model, stage: int = 2, ctx=None, **layout):
    """The engine over `model`; `layout`: ParallelModel's layouts / tied_copies for a hand-cut local model."""
    import zerogpt
    from zerogpt.context import DistContext
    from zerogpt.parallel import ParallelModel
    from zerogpt.zero import BucketTensorShardStrategy

    cfg = zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02))))
    return zerogpt.initialize(ParallelModel(model, **layout),
                              torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), config=cfg,
                              ctx=ctx or DistContext.current("cpu"))


def batches(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def mesh_context(tp: int, pp: int, dp: int):
    from zerogpt.context import DistContext
    from zerogpt.parallel.mesh import ParallelDims

    mesh = ParallelDims(tp=tp, pp=pp, dp=dp).build_mesh("cpu")
    return mesh, DistContext.current("cpu").with_mesh(mesh)


# ------------------------------------------------------------------------------------------------
# ranks of a (T, P, D) run (spawned)


def _tp_rank(rank: int, world: int, tp: int, dp: int, stage: int, reference: dict, save: str | None,
             load: str | None) -> list[str]:
    """A T x D run's rank: fill from the reference and save, or load; returns its mismatches with the reference."""
    mesh, ctx = mesh_context(tp, 1, dp)
    model = tiny_model()
    layouts = tp_local_model(model, tp, mesh["tp"].get_local_rank())
    engine = make_engine(model, stage, ctx, layouts=layouts)
    if load:
        engine.load_checkpoint(load)
    else:
        fill_engine(engine, reference, STEPS)
        engine.global_step = STEPS
    if save:
        engine.save_checkpoint(save)
    return engine_mismatches(engine, reference)


def _pp_rank(rank: int, world: int, reference: dict, load: str, save: str) -> list[str]:
    """A P = 2 run's rank (stage = rank): load, check, save again."""
    mesh, ctx = mesh_context(1, 2, 1)
    model = tiny_model()
    tied = pipeline_stage(model, mesh["pp"].get_local_rank())
    engine = make_engine(model, 2, ctx, tied_copies=tied)
    engine.load_checkpoint(load)
    engine.save_checkpoint(save)
    return engine_mismatches(engine, reference)


# ------------------------------------------------------------------------------------------------
# fixtures: the reference (a world-1 run) and its state saved at (2, 1, 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The reference after STEPS steps, the 3 losses of the run continued, and the (2, 1, 2) checkpoint."""
    root = tmp_path_factory.mktemp("reshard")
    engine = make_engine(tiny_model())
    train_losses(engine, batches(STEPS + 3)[:STEPS])
    reference = reference_from_engine(engine)
    engine.save_checkpoint(root / "w1")
    tail = train_losses(engine, batches(STEPS + 3)[STEPS:])
    engine.close()
    ckpt = str(root / "t2d2")
    mismatches = run_distributed(_tp_rank, 4, 2, 2, 2, reference, ckpt, None, timeout=150)
    assert mismatches == [[]] * 4, mismatches
    return dict(root=root, reference=reference, tail=tail, ckpt=ckpt)


def continue_at_world_1(ckpt: str, reference: dict) -> list[float]:
    engine = make_engine(tiny_model(), stage=3)  # another stage: still the same state, bit for bit
    assert engine.load_checkpoint(ckpt) == {}
    assert engine_mismatches(engine, reference) == []
    tail = train_losses(engine, batches(STEPS + 3)[STEPS:])
    engine.close()
    return tail


# ------------------------------------------------------------------------------------------------
# tests


@pytest.mark.timeout(200)
def test_saved_at_2_1_2_each_element_once_with_its_layout(run):
    meta = json.loads(open(os.path.join(run["ckpt"], "meta.json")).read())
    assert meta["version"] == 2 and meta["parallel"] == {"tp": 2, "pp": 1, "dp": 2}
    assert meta["tied"] == TIED_HEAD and "lm_head.weight" not in meta["params"]
    for name, tensor in run["reference"]["master"].items():  # global shapes, not the TP-local ones
        assert meta["params"][name]["shape"] == list(tensor.shape), name
    for kind in KINDS:
        saved = sum(end - start for entry in meta["files"].values() for k, _, start, end, _ in entry["pieces"]
                    if k == kind)
        assert saved == sum(t.numel() for t in run["reference"][kind].values()), kind
    qkv = [entry["layouts"]["transformer.h.0.attn.c_attn.weight"] for entry in meta["files"].values()
           if "transformer.h.0.attn.c_attn.weight" in entry.get("layouts", {})]
    assert {tuple(map(tuple, lay["blocks"])) for lay in qkv} == {((0, 32), (64, 32), (128, 32)),
                                                                ((32, 32), (96, 32), (160, 32))}
    reread = reference_from_checkpoint(run["ckpt"])
    for kind in KINDS:
        for name, tensor in run["reference"][kind].items():
            assert torch.equal(reread[kind][name], tensor), (kind, name)


@pytest.mark.timeout(200)
def test_2_1_2_to_1_2_1_to_1_1_1_is_exact_and_resumes_bit_identically(run):
    """The issue's chain: (2, 1, 2) -> (1, 2, 1) (the last stage's head copy filled from wte) -> (1, 1, 1)."""
    p2 = str(run["root"] / "p2")
    mismatches = run_distributed(_pp_rank, 2, run["reference"], run["ckpt"], p2, timeout=150)
    assert mismatches == [[], []], mismatches
    meta = json.loads(open(os.path.join(p2, "meta.json")).read())
    assert meta["parallel"] == {"tp": 1, "pp": 2, "dp": 1} and meta["tied"] == TIED_HEAD
    assert "lm_head.weight" not in meta["params"]  # the copy is not saved: wte is
    assert continue_at_world_1(p2, run["reference"]) == run["tail"]


@pytest.mark.timeout(200)
def test_2_1_2_to_1_1_1_resumes_bit_identically(run):
    assert continue_at_world_1(run["ckpt"], run["reference"]) == run["tail"]


@pytest.mark.timeout(200)
def test_2_1_2_loads_at_2_1_1_stage_3(run):
    mismatches = run_distributed(_tp_rank, 2, 2, 1, 3, run["reference"], None, run["ckpt"], timeout=150)
    assert mismatches == [[], []], mismatches


@pytest.mark.timeout(200)
def test_version_1_checkpoints_still_load(run, tmp_path):
    v1 = tmp_path / "v1"
    shutil.copytree(run["root"] / "w1", v1)
    meta = json.loads((v1 / "meta.json").read_text())
    for key in ("parallel", "buffer_files"):
        meta.pop(key, None)
    for entry in meta["files"].values():
        entry.pop("layouts", None)
    meta["version"] = 1
    (v1 / "meta.json").write_text(json.dumps(meta))
    assert continue_at_world_1(str(v1), run["reference"]) == run["tail"]


@pytest.mark.timeout(200)
def test_export_of_a_2_1_2_checkpoint_gives_the_unsharded_logits(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from zerogpt_tools.export import export_checkpoint

    export_checkpoint(run["ckpt"], str(tmp_path / "hf"), with_tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    model = tiny_model().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(run["reference"]["master"][name])
        ids = batches(1)[0, :, :-1]
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)
