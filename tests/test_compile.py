"""`compile = True` (zerogpt/compile.py): each block's forward compiled, the engine's hooks outside.

World size 1 on the CPU: the stage sweep trains the tiny GPT eagerly and compiled and compares losses and
parameters in fp32; a counting backend shows the blocks share one graph compiled once (no graph break, no
recompile over the steps). One test goes through the config with the inductor backend (C++ on the CPU) and
activation checkpointing; one saves and resumes a compiled engine; a 2-stage pipeline (2 gloo ranks) compiles each
stage's blocks and trains as eagerly.
"""
from __future__ import annotations

import logging

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import compile_blocks, find_blocks
from zerogpt.config import engine_config

VOCAB, SEQ, BATCH, STEPS = 128, 16, 2, 3


class CountingBackend:
    """aot_eager that counts the graphs dynamo hands it (one per compile: a graph break or a recompile adds
    one)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


def build_engine(stage: int, *, compile_with=None, checkpoint: bool = False, offload: str = "none",
                 config_compile: bool = False, logger=None):
    """The tiny GPT on a world-1 engine; `compile_with` a backend compiles its blocks as initialize does."""
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, checkpoint=checkpoint)
    zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(device=offload))
    cfg = zerogpt.Config(dict(zero=zero, precision="fp32", compile=config_compile))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                                config=cfg, ctx=cpu_ctx(logger=logger))
    if compile_with is not None:
        compile_blocks(engine.module, backend=compile_with, stage=stage)
    return engine


def batches(steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=g)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_config_key():
    assert engine_config(zerogpt.Config()).compile is False
    assert engine_config(zerogpt.Config().apply_overrides(["compile=true"])).compile is True
    assert engine_config(zerogpt.Config(dict(compile=True))).compile is True
    with pytest.raises(TypeError, match="compile must be bool"):
        zerogpt.Config(dict(compile="yes")).validate()


def test_find_blocks_is_the_gpt_blocks():
    model = gpt2_tiny()
    assert find_blocks(model) == list(model.transformer.h)
    assert compile_blocks(model, backend="aot_eager") == 2
    assert all("forward" in vars(block) for block in model.transformer.h)  # the bound forward, not _call_impl
    assert "forward" not in vars(model.transformer.ln_f)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_same_losses_as_eager_and_one_graph(stage):
    eager = build_engine(stage)
    expected = train_losses(eager, batches())
    eager.close()
    backend = CountingBackend()
    compiled = build_engine(stage, compile_with=backend)
    losses = train_losses(compiled, batches())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    if stage == 3:  # its gather hooks sit inside each block: left eager (zerogpt/compile.py)
        assert backend.graphs == 0
    else:  # both blocks, every step: one graph, so no graph break and no recompile
        assert backend.graphs == 1
        assert "graph_break" not in torch._dynamo.utils.counters
    compiled.close()


@pytest.mark.timeout(120)
def test_checkpointing_and_offload_compile_once():
    eager = build_engine(2, checkpoint=True, offload="cpu")
    expected = train_losses(eager, batches())
    eager.close()
    backend = CountingBackend()
    compiled = build_engine(2, compile_with=backend, checkpoint=True, offload="cpu")
    torch.testing.assert_close(train_losses(compiled, batches()), expected, rtol=1e-5, atol=1e-6)
    assert backend.graphs == 1
    compiled.close()


@pytest.mark.timeout(120)
def test_inductor_through_the_config_logs_the_first_step(caplog):
    eager = build_engine(1)
    expected = train_losses(eager, batches())
    eager.close()
    logger = logging.getLogger("test_compile")
    with caplog.at_level(logging.INFO, logger="test_compile"):
        compiled = build_engine(1, config_compile=True, logger=logger)
        losses = train_losses(compiled, batches())
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)  # inductor fuses: fp32 rounding differs
    assert "forward" in vars(compiled.module.transformer.h[0])
    lines = [r.getMessage() for r in caplog.records if "compiled 2 blocks" in r.getMessage()]
    assert len(lines) == 1 and "first compiled step took" in lines[0], lines
    compiled.close()


@pytest.mark.timeout(120)
def test_resume_of_a_compiled_engine(tmp_path):
    data = batches(6)
    straight = build_engine(2, compile_with="aot_eager")
    expected = train_losses(straight, data)
    straight.close()
    first = build_engine(2, compile_with="aot_eager")
    head = train_losses(first, data[:3])
    first.save_checkpoint(str(tmp_path / "step_3"))
    first.close()
    resumed = build_engine(2, compile_with="aot_eager")
    resumed.load_checkpoint(str(tmp_path / "step_3"))
    assert head + train_losses(resumed, data[3:]) == expected
    resumed.close()


def _pipeline_fit(rank: int, world: int) -> dict:
    """PP2 on 2 gloo ranks, trained by the Trainer as tests/parallel/test_tp_pp.py trains it: eager, then with
    each stage's blocks compiled."""
    from tests.parallel.test_pipeline import STEPS, Record, _trainer_data
    from tests.parallel.test_tp_pp import build
    from zerogpt.trainer import Trainer

    out = {}
    for compiled in (False, True):
        engine, pipeline = build(1, 2, 1)
        backend = CountingBackend()
        blocks = compile_blocks(engine.module, backend=backend) if compiled else 0
        train_data, _ = _trainer_data(engine.ctx.dp_size)
        record = Record()
        Trainer(engine, hooks=[record], pipeline=pipeline).fit([b[engine.ctx.dp_rank] for b in train_data],
                                                               max_steps=STEPS)
        engine.close()
        out[compiled] = {"losses": record.losses, "blocks": blocks, "graphs": backend.graphs}
    return out


@pytest.mark.timeout(200)
def test_pipeline_stages_compile_their_blocks():
    from tests.dist_utils import run_distributed

    for rank, run in enumerate(run_distributed(_pipeline_fit, 2, timeout=180)):
        torch.testing.assert_close(run[True]["losses"], run[False]["losses"], rtol=1e-5, atol=1e-6)
        assert run[True]["blocks"] == 2 and run[True]["graphs"] == 1, (rank, run[True])  # tiny_gpt4: 2 per stage
