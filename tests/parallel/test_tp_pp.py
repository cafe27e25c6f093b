"""Tensor and pipeline parallelism together (zerogpt/parallel/plan.py), TP2 x PP2 on 4 gloo CPU ranks, fp32.

The model goes through `parallelize` (the TP plan, then the stage split), `initialize` and `attach`, the path
train_gpt takes, and is trained by the Trainer; one process training the same 4-layer tiny GPT on the same
global batch is the reference (tests/parallel/test_pipeline.py's data and settings).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.parallel.test_pipeline import (ACCUM, RTOL, STEPS, Record, _config, _trainer_data, _whole_batches,
                                          criterion, tiny_gpt4)
from tests.zero.reference import adamw, cpu_ctx, single_thread
from zerogpt.trainer import Trainer


def build(tp: int, pp: int, stage: int):
    """(engine, parallel model) for this rank of a (pp, dp, tp) mesh over every rank."""
    import zerogpt
    from zerogpt.parallel import ParallelDims
    from zerogpt.parallel.plan import parallelize

    torch.set_num_threads(1)
    dims = ParallelDims(tp=tp, pp=pp, dp=torch.distributed.get_world_size() // (tp * pp))
    parallel = parallelize(tiny_gpt4(), dims.build_mesh("cpu"))
    engine, *_ = zerogpt.initialize(parallel.module, adamw(parallel.module), criterion=criterion,
                                    config=_config(stage), ctx=parallel.context(torch.device("cpu")))
    parallel.attach(engine)
    return engine, parallel


def _fit(rank: int, world: int, tp: int, pp: int, stage: int) -> dict:
    engine, parallel = build(tp, pp, stage)
    dp, dp_rank = parallel.mesh["dp"].size(), parallel.mesh["dp"].get_local_rank()
    train_data, eval_data = _trainer_data(dp)
    record = Record()
    trainer = Trainer(engine, hooks=[record])
    state = trainer.fit([b[dp_rank] for b in train_data], max_steps=STEPS)
    evaluation = trainer.evaluate([b[dp_rank] for b in eval_data])
    engine.close()
    return {"losses": record.losses, "norms": record.norms, "eval": evaluation["loss"], "steps": state.step,
            "local_names": sorted(n for n, _ in engine.module.named_parameters())}


def reference(dp: int) -> dict:
    """One process, the data-parallel ranks' micro-batches side by side, through the same Trainer."""
    import zerogpt

    with single_thread():
        model = tiny_gpt4()
        engine, *_ = zerogpt.initialize(model, adamw(model), criterion=criterion, config=_config(1), ctx=cpu_ctx())
        train_data, eval_data = (_whole_batches(b) for b in _trainer_data(dp))
        record = Record()
        trainer = Trainer(engine, hooks=[record])
        trainer.fit(train_data, max_steps=STEPS)
        out = {"losses": record.losses, "norms": record.norms, "eval": trainer.evaluate(eval_data)["loss"]}
        engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_tp2_pp2_matches_one_process(stage):
    runs = run_distributed(_fit, 4, 2, 2, stage, timeout=280)
    ref = reference(dp=1)
    for r, run in enumerate(runs):
        assert run["steps"] == STEPS
        for key in ("losses", "norms", "eval"):
            torch.testing.assert_close(run[key], ref[key], rtol=RTOL, atol=0, msg=lambda m: f"rank {r} {key}: {m}")
    # ranks 0, 1 (pp 0) hold the embeddings and blocks 0-1; ranks 2, 3 (pp 1) blocks 2-3 and the head
    assert "transformer.wte.weight" in runs[1]["local_names"] and "lm_head.weight" in runs[3]["local_names"]
    assert "transformer.h.2.mlp.c_fc.weight" not in runs[0]["local_names"]
