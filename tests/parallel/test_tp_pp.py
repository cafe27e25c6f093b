"""Tensor and pipeline parallelism together (zerogpt/parallel/plan.py), TP2 x PP2 on 4 gloo CPU ranks, fp32.

The model goes through `parallelize` (the TP plan, then the stage split) and `initialize`, the path train_gpt
takes, and is trained by the Trainer; one process training the same 4-layer tiny GPT on the same
global batch is the reference (tests/parallel/test_pipeline.py's data and settings).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.parallel.engines import parallel_engine
from tests.parallel.test_pipeline import (ACCUM, RTOL, STEPS, Record, _config, _trainer_data, _whole_batches,
                                          criterion, tiny_gpt4)
from tests.zero.reference import adamw, cpu_ctx, single_thread
from zerogpt.trainer import Trainer
from zerogpt.zero.chunk import to_local


def build(tp: int, pp: int, stage: int, meta: bool = False, sequence_parallel: bool = False,
          factory: Callable[..., torch.nn.Module] = tiny_gpt4, **model):
    """(engine, pipeline) for this rank of a (pp, dp, tp) mesh over every rank; `meta`: the model is built on the
    meta device, as train_gpt builds it, and `initialize` fills each rank's shards; `factory` builds the model
    (seeded alike on every rank), `model` its overrides."""
    import contextlib

    from zerogpt.parallel import ParallelDims

    torch.set_num_threads(1)
    dims = ParallelDims(tp=tp, pp=pp, dp=torch.distributed.get_world_size() // (tp * pp))
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = factory(**model)
    return parallel_engine(model, dims, _config(stage), adamw, criterion, sequence_parallel)


def _fit(rank: int, world: int, tp: int, pp: int, stage: int, meta: bool = False,
         sequence_parallel: bool = False, factory: Callable[..., torch.nn.Module] = tiny_gpt4) -> dict:
    engine, pipeline = build(tp, pp, stage, meta, sequence_parallel, factory)
    dp, dp_rank = engine.ctx.dp_size, engine.ctx.dp_rank
    train_data, eval_data = _trainer_data(dp)
    record = Record()
    trainer = Trainer(engine, hooks=[record], pipeline=pipeline)
    state = trainer.fit([b[dp_rank] for b in train_data], max_steps=STEPS)
    evaluation = trainer.evaluate([b[dp_rank] for b in eval_data])
    local_numel = sum(to_local(p).numel() for p in engine.module.parameters())
    memory = engine.memory_stats()
    engine.close()
    return {"losses": record.losses, "norms": record.norms, "eval": evaluation["loss"], "steps": state.step,
            "local_names": sorted(n for n, _ in engine.module.named_parameters()), "local_numel": local_numel,
            "memory": memory, "num_chunks": len(engine.chunks)}


def reference(dp: int, factory: Callable[..., torch.nn.Module] = tiny_gpt4) -> dict:
    """One process, the data-parallel ranks' micro-batches side by side, through the same Trainer."""
    import zerogpt

    with single_thread():
        model = factory()
        engine = zerogpt.initialize(model, adamw(model), criterion=criterion, config=_config(1), ctx=cpu_ctx())
        train_data, eval_data = (_whole_batches(b) for b in _trainer_data(dp))
        record = Record()
        trainer = Trainer(engine, hooks=[record])
        trainer.fit(train_data, max_steps=STEPS)
        out = {"losses": record.losses, "norms": record.norms, "eval": trainer.evaluate(eval_data)["loss"]}
        engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage, sequence_parallel", [(1, False), (2, True)])
def test_tp2_pp2_matches_one_process(stage, sequence_parallel):
    """With sequence parallelism the stages hand each other (B, T/2, C) sequence shards. (ZeRO-2 without it:
    test_a_meta_build_trains_bit_for_bit_as_a_whole_build.)"""
    runs = run_distributed(_fit, 4, 2, 2, stage, False, sequence_parallel, timeout=280)
    ref = reference(dp=1)
    for r, run in enumerate(runs):
        assert run["steps"] == STEPS
        for key in ("losses", "norms", "eval"):
            torch.testing.assert_close(run[key], ref[key], rtol=RTOL, atol=0, msg=lambda m: f"rank {r} {key}: {m}")
    _assert_states_are_the_zero_formula(runs, stage)
    # ranks 0, 1 (pp 0) hold the embeddings and blocks 0-1; ranks 2, 3 (pp 1) blocks 2-3 and the head
    assert "transformer.wte.weight" in runs[1]["local_names"] and "lm_head.weight" in runs[3]["local_names"]
    assert "transformer.h.2.mlp.c_fc.weight" not in runs[0]["local_names"]


def _plain_and_meta(rank: int, world: int) -> tuple[dict, dict]:
    return _fit(rank, world, 2, 2, 2), _fit(rank, world, 2, 2, 2, meta=True)


@pytest.mark.timeout(300)
def test_a_meta_build_trains_bit_for_bit_as_a_whole_build():
    """Built on the meta device, the TP x PP shards are filled per rank from GPT.init_param_range through the
    layouts (QKV blocks, vocab rows, the last stage's head copy of wte): the same run, to the bit."""
    for plain, meta in run_distributed(_plain_and_meta, 4, timeout=280):
        for key in ("losses", "norms", "eval"):
            assert meta[key] == plain[key], key


def _resume(rank: int, world: int, root: str) -> dict:
    """Three steps uninterrupted; and two, save, a fresh build loads them and takes the third."""
    from tests.parallel.test_pipeline import train

    def run(steps: range, load: str | None = None, save: str | None = None) -> dict:
        engine, pipeline = build(2, 2, 1)
        if load:
            engine.load_checkpoint(load)
        out = train(engine, pipeline, engine.ctx.dp_rank, engine.ctx.dp_size, steps)
        if save:
            engine.save_checkpoint(save)
        engine.close()
        return out

    whole = run(range(STEPS))
    run(range(STEPS - 1), save=f"{root}/step")
    torch.manual_seed(99)  # the resumed process's own RNG: the checkpoint restores it
    return {"whole": whole, "resumed": run(range(STEPS - 1, STEPS), load=f"{root}/step")}


@pytest.mark.timeout(300)
def test_tp2_pp2_resumes_exactly_and_the_checkpoint_reads_whole(tmp_path):
    """Exact resume at (T, P, D) = (2, 2, 1); the one checkpoint, read at (1, 1, 1), holds the parameters one
    process has after the same steps (the QKV rows in their standard order, the tied head equal to wte)."""
    import zerogpt
    from zerogpt.checkpoint import CheckpointReader

    for run in run_distributed(_resume, 4, str(tmp_path), timeout=280):
        assert run["resumed"]["losses"] == run["whole"]["losses"][-1:]
        assert run["resumed"]["norms"] == run["whole"]["norms"][-1:]
    with single_thread():
        model = tiny_gpt4()
        engine = zerogpt.initialize(model, adamw(model), config=_config(1), ctx=cpu_ctx())
        _one_process_steps(engine, STEPS - 1)
        ref_params = engine.state_dict_full()
        engine.close()
    reader = CheckpointReader(str(tmp_path / "step"))
    assert reader.parallel == {"tp": 2, "pp": 2, "dp": 1}
    for name, value in ref_params.items():
        torch.testing.assert_close(reader.tensor(name), value, rtol=RTOL, atol=1e-6, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(reader.tensor("lm_head.weight"), reader.tensor("transformer.wte.weight"),
                               rtol=0, atol=0)


def _one_process_steps(engine, steps: int) -> None:
    """`steps` optimizer steps of the pipeline tests' data (dp 1) in one process."""
    from tests.zero.recipes import token_batches

    data = token_batches(STEPS, 1, ACCUM)
    for step in range(steps):
        for j in range(ACCUM):
            batch = data[step, j, 0]
            engine.backward(criterion(engine(batch[:, :-1]), batch[:, 1:]))
            engine.step()
        engine.zero_grad()


def _assert_states_are_the_zero_formula(runs: list[dict], stage: int) -> None:
    """Each rank's parameters, masters and optimizer state = the ZeRO formula (zerogpt_tools.estimate) over its
    TP x PP share of the model, about a quarter of it (the last stage also holds the head's copy of wte)."""
    from zerogpt_tools.estimate import model_state_bytes

    whole = sum(p.numel() for p in tiny_gpt4().parameters())
    for rank, run in enumerate(runs):
        assert run["local_numel"] < 0.4 * whole, (rank, run["local_numel"], whole)
        plan = model_state_bytes(run["local_numel"], stage, 1, "fp32", "none")
        for category in ("params", "master", "optimizer"):
            measured = sum(run["memory"][category].values())
            expected = sum(plan[category].values())
            assert abs(measured - expected) <= run["num_chunks"] * 8, (rank, category, measured, expected)

