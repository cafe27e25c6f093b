"""`compile = True` (zerogpt/compile.py): each block's forward compiled, the engine's hooks outside.

World size 1 on the CPU: the stage sweep trains the tiny GPT eagerly and compiled and compares losses and
parameters in fp32; a counting backend shows the blocks share one graph compiled once (no graph break, no
recompile over the steps), at stage 3 too, where each block gathers its parameters as a whole. One test goes
through the config with the inductor backend (C++ on the CPU); one saves and resumes a compiled engine; stage 3 on
2 gloo ranks trains as single-process PyTorch, with and without activation checkpointing, compiles once, and
frees released chunks before backward; a 2-stage pipeline (2 gloo ranks) compiles each stage's blocks and trains
as eagerly.
"""
from __future__ import annotations

import logging

import pytest
import torch

import zerogpt
from model_zoo.gpt import gpt2_tiny
from model_zoo.llama import llama_tiny
from tests.zero.reference import cpu_ctx, train_losses
from zerogpt.compile import compile_blocks, find_blocks
from zerogpt.config import engine_config
from zerogpt.trainer import Hook

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
                 offload_param: bool = False, config_compile: bool = False, logger=None, factory=gpt2_tiny):
    """The tiny GPT (or `factory`'s model) on a world-1 engine; `compile_with` a backend compiles its blocks as
    initialize does."""
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(0)
    model = factory(vocab_size=VOCAB, max_position_embeddings=SEQ, checkpoint=checkpoint)
    zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(device=offload), offload_param=dict(device="cpu" if offload_param else "none"))
    cfg = zerogpt.Config(dict(zero=zero, precision="fp32", compile=config_compile))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                                config=cfg, ctx=cpu_ctx(logger=logger))
    if compile_with is not None:
        compile_blocks(engine.module, backend=compile_with, gather_hooks=engine.gather_hooks)
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


def test_find_blocks_is_the_llama_layers():
    model = llama_tiny(qk_norm=True)
    assert find_blocks(model) == list(model.model.layers)
    assert compile_blocks(model, backend="aot_eager") == 2
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_llama_same_losses_as_eager_and_one_graph(stage):
    """The Llama family (tiny: GQA, Llama-3 RoPE scaling) with Qwen3's qk-norm: its layers share one graph."""
    def qwen3_like(**kwargs):
        return llama_tiny(qk_norm=True, **kwargs)

    eager = build_engine(stage, factory=qwen3_like)
    expected = train_losses(eager, batches())
    eager.close()
    backend = CountingBackend()
    compiled = build_engine(stage, compile_with=backend, factory=qwen3_like)
    torch.testing.assert_close(train_losses(compiled, batches()), expected, rtol=1e-5, atol=1e-6)
    assert backend.graphs == 1 and "graph_break" not in torch._dynamo.utils.counters
    compiled.close()


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
    # both blocks, every step: one graph, so no graph break and no recompile (stage 3: chunks gathered and
    # released around each block, the compiled forward sees full-size parameters every time)
    assert backend.graphs == 1
    assert "graph_break" not in torch._dynamo.utils.counters
    compiled.close()


def test_stage3_hooks_move_to_the_blocks():
    """Compiling at stage 3 leaves one gather hook pair per block and none inside; the embeddings, ln_f and the
    head keep their own."""
    engine = build_engine(3)
    hooks, model = engine.gather_hooks, engine.module
    inside = {id(m) for block in model.transformer.h for m in block.modules()}
    assert inside & set(hooks.module_chunks)  # eager: each Linear and LayerNorm gathers its own
    compile_blocks(model, backend="aot_eager", gather_hooks=hooks)
    hooked = set(hooks.module_chunks)
    blocks = {id(block) for block in model.transformer.h}
    assert hooked & inside == blocks
    assert {id(model.transformer.wte), id(model.transformer.ln_f), id(model.lm_head)} <= hooked
    for block in model.transformer.h:
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in block.modules() if m is not block)
    engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpointing_and_offload_compile_once(stage):
    """Recomputation in backward runs the compiled forward again (stage 3: gathered again by the block's hook);
    stage 3 offloads the parameters too."""
    setting = dict(checkpoint=True, offload="cpu", offload_param=stage == 3)
    eager = build_engine(stage, **setting)
    expected = train_losses(eager, batches())
    eager.close()
    backend = CountingBackend()
    compiled = build_engine(stage, compile_with=backend, **setting)
    torch.testing.assert_close(train_losses(compiled, batches()), expected, rtol=1e-5, atol=1e-6)
    assert backend.graphs == 1
    compiled.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_inductor_through_the_config_logs_the_first_step(caplog, stage):
    eager = build_engine(stage)
    expected = train_losses(eager, batches())
    eager.close()
    logger = logging.getLogger("test_compile")
    with caplog.at_level(logging.INFO, logger="test_compile"):
        compiled = build_engine(stage, config_compile=True, logger=logger)
        losses = train_losses(compiled, batches())
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)  # inductor fuses: fp32 rounding differs
    assert "forward" in vars(compiled.module.transformer.h[0])
    if stage == 3:  # initialize moved the gather hooks to the blocks
        assert id(compiled.module.transformer.h[0]) in compiled.gather_hooks.module_chunks
    lines = [r.getMessage() for r in caplog.records if "compiled 2 blocks" in r.getMessage()]
    assert len(lines) == 1 and "first compiled step took" in lines[0], lines
    compiled.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_of_a_compiled_engine(tmp_path, stage):
    data = batches(6)
    straight = build_engine(stage, compile_with="aot_eager")
    expected = train_losses(straight, data)
    straight.close()
    first = build_engine(stage, compile_with="aot_eager")
    head = train_losses(first, data[:3])
    first.save_checkpoint(str(tmp_path / "step_3"))
    first.close()
    resumed = build_engine(stage, compile_with="aot_eager")
    resumed.load_checkpoint(str(tmp_path / "step_3"))
    assert head + train_losses(resumed, data[3:]) == expected
    resumed.close()


def _stage3_compiled(rank: int, world: int) -> dict:
    """Stage 3 on 2 gloo ranks, blocks compiled by a counting backend: tests/zero/test_stage3.py's recipes (plain
    GPT, GPT with activation checkpointing) and its gather probe, the graphs counted after every step."""
    from tests.zero.reference import engine_run
    from tests.zero.stage3_recipes import RECIPES
    from tests.zero.test_stage3 import PREFETCH, attach_probe, inspect_step
    from zerogpt.zero import BucketTensorShardStrategy

    out = {}
    for name in ("gpt", "gpt_activation_checkpointing"):
        torch._dynamo.reset()
        backend = CountingBackend()

        def setup(engine) -> None:
            compile_blocks(engine.module, backend=backend, gather_hooks=engine.gather_hooks)
            attach_probe(engine)

        def inspect(engine, step: int) -> dict:
            return {**inspect_step(engine, step), "graphs": backend.graphs}

        # chunks of ~4K elements: some hold parameters of two blocks, or of a block and ln_f
        zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.016), prefetch=PREFETCH)
        out[name] = engine_run(rank, world, RECIPES[name], zero, setup=setup, inspect=inspect)
    return out


@pytest.mark.timeout(200)
def test_stage3_on_two_ranks_trains_as_pytorch_and_compiles_once():
    from tests.dist_utils import run_distributed
    from tests.zero.reference import assert_run_matches, reference_run
    from tests.zero.stage3_recipes import RECIPES, SEQ
    from tests.zero.stage3_recipes import VOCAB as RECIPE_VOCAB
    from tests.zero.test_stage3 import PREFETCH
    from zerogpt.memory_model import ModelShape, gather_peak

    # a block's chunks, the next PREFETCH hooked modules' and the tied embedding's (what the memory model counts
    # with the blocks gathered whole; on this 2-block GPT with 4K-element chunks that is every chunk)
    shape = ModelShape(layers=2, hidden=64, heads=2, vocab=RECIPE_VOCAB, positions=SEQ)
    bound = gather_peak(shape, "fp32", PREFETCH, 0.016, world_size=2, per_block=True)[0]
    runs = run_distributed(_stage3_compiled, 2, timeout=180)
    for name, run in runs[0].items():
        assert_run_matches(run, reference_run(RECIPES[name], 2, 1), precision="fp32", what=f"compiled {name}")
        assert run["losses"] == runs[1][name]["losses"]
        for rank, seen in enumerate(r[name]["inspect"] for r in runs):
            assert [s["graphs"] for s in seen] == [1] * len(seen), (rank, name)  # no recompile after the first step
            for step, s in enumerate(seen):
                assert s["held_between_steps"] == 0 and s["nonempty_params"] == [], (rank, name, step)
                assert s["released_but_alive_at_backward"] == [[]], (rank, name, step)  # saved views kept no buffer
                assert 0 < s["max_held"]["forward"] <= bound <= s["num_chunks"], (rank, name, step, s["max_held"])
                assert s["max_held"]["backward"] <= bound, (rank, name, step, s["max_held"])
                prefetched = [c for phase, c, async_op, cold in s["events"] if phase == "forward" and async_op and cold]
                assert step == 0 or prefetched, (rank, name, step)  # the recorded order, replayed ahead


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


def _tensor_parallel_fit(rank: int, world: int, stage: int, sequence_parallel: bool, model: dict) -> dict:
    """A model under TP2 (x DP2 on 4 ranks), trained by the Trainer as tests/parallel/test_tp_pp.py trains it:
    eager, then with its blocks compiled (stage 3 with DP2: gathered whole per block, rebound at every gather).
    `model`: test_tp_pp.build's factory and overrides. The same dropout stream on every rank; the graphs are
    counted after each step."""
    from tests.parallel.test_pipeline import STEPS, Record, _trainer_data
    from tests.parallel.test_tp_pp import build
    from zerogpt.trainer import Trainer

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        engine, _ = build(2, 1, stage, sequence_parallel=sequence_parallel, **model)
        backend = CountingBackend()
        blocks = compile_blocks(engine.module, backend=backend, gather_hooks=engine.gather_hooks) if compiled else 0
        train_data, _ = _trainer_data(engine.ctx.dp_size)
        record, graphs = Record(), GraphsPerStep(backend)
        torch.manual_seed(5)
        Trainer(engine, hooks=[record, graphs]).fit([b[engine.ctx.dp_rank] for b in train_data], max_steps=STEPS)
        engine.close()
        out[compiled] = {"losses": record.losses, "norms": record.norms, "blocks": blocks, "graphs": graphs.seen}
    return out


class GraphsPerStep(Hook):
    def __init__(self, backend: CountingBackend) -> None:
        self.backend, self.seen = backend, []

    def after_step(self, trainer) -> None:
        self.seen.append(self.backend.graphs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, stage, dropout, sequence_parallel",
                         [(2, 1, 0.0, False), (4, 3, 0.0, False), (2, 1, 0.1, False), (2, 2, 0.1, True)])
def test_tensor_parallel_blocks_compile_once_and_train_as_eager(world, stage, dropout, sequence_parallel):
    """Each block's DTensor parameters are views of chunk slots; the blocks share their graphs (fewer than the
    blocks, none compiled after the first step) and train as the eager run does. Without dropout a block is one
    graph; with it, the modules on a rank's own dropout stream run eagerly between graphs (parallel/rng.py), and
    aot_eager draws the other masks as eager does, so the runs match."""
    from tests.dist_utils import run_distributed

    runs = run_distributed(_tensor_parallel_fit, world, stage, sequence_parallel, dict(dropout=dropout, n_layer=10),
                           timeout=280)
    for rank, run in enumerate(runs):
        for key in ("losses", "norms"):
            torch.testing.assert_close(run[True][key], run[False][key], rtol=1e-5, atol=1e-6, msg=key)
        graphs = run[True]["graphs"]
        assert run[True]["blocks"] == 10 and len(set(graphs)) == 1, (rank, run[True])
        # the modules of a block on their own stream: attention's dropout, and under SP the two residual dropouts;
        # each splits the block's graph, and a split may resume in the module that called it
        own = 0 if dropout == 0 else 3 if sequence_parallel else 1
        assert graphs[0] == 1 if own == 0 else 1 < graphs[0] <= 2 * (own + 1) < 10, (rank, graphs)


@pytest.mark.timeout(200)
def test_llama_tensor_parallel_layers_compile_once_and_train_as_eager():
    """The Qwen3-like tiny Llama (2 layers) under TP2 + SP at ZeRO-1: the compiled layers hold DTensor projections,
    qk-norms on head-sharded inputs and sequence-parallel RMSNorms, share one graph, and train as eagerly. The first
    layer takes the embedding's output still in flight (compile.py, `_waited_inputs`)."""
    from tests.dist_utils import run_distributed
    from tests.parallel.test_tp_pp_llama import tiny_qwen3

    model = dict(factory=tiny_qwen3, num_hidden_layers=2)
    for rank, run in enumerate(run_distributed(_tensor_parallel_fit, 2, 1, True, model, timeout=180)):
        for key in ("losses", "norms"):
            torch.testing.assert_close(run[True][key], run[False][key], rtol=1e-5, atol=1e-6, msg=key)
        assert run[True]["blocks"] == 2 and set(run[True]["graphs"]) == {1}, (rank, run[True])
