"""Checkpoints written by an earlier zerogpt, kept in tests/assets/checkpoints/, and the runs that wrote them.

The format is a promise to users: a checkpoint saved by one commit resumes under the next. These fixtures were
written by the commit named in tests/assets/checkpoints/expected.json, each after two steps of a tiny GPT, with
the losses of two more steps recorded beside them. tests/test_checkpoint_fixture.py loads them with today's code,
saves them again (the same files must come out) and takes the two steps (the same losses, bit for bit).

The three cases cover what a checkpoint records: data-parallel shards of stage 3 with fp16's loss scale, a frozen
parameter, dropout's RNG and two param groups; tensor-parallel pieces with their layouts; pipeline stages with the
last stage's copy of the tied head.

Regenerate (only when the format changes on purpose, with a new format version):
    python -m tests.checkpoint_fixture
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Callable

import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny

ROOT = os.path.join(os.path.dirname(__file__), "assets", "checkpoints")
EXPECTED = os.path.join(ROOT, "expected.json")
CASES = ("dp2_zero3_fp16", "tp2_zero1_bf16", "pp2_zero2")
VOCAB, SEQ, BATCH, SAVED_AT, MORE = 64, 8, 4, 2, 2


def tiny_model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_embd=16, n_head=2, n_layer=2,
                     dropout=dropout)


def batches(dp_rank: int) -> torch.Tensor:
    """(SAVED_AT + MORE, BATCH, SEQ + 1) token ids of a data-parallel rank, whatever the global RNG holds."""
    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, VOCAB, (SAVED_AT + MORE, BATCH, SEQ + 1), generator=g)


def adamw_two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Weight decay on matrices only: two param groups, as the shipped configs have."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)


def _config(stage: int, precision: str, accumulation: int = 1) -> Any:
    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    return zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.01)),
                               precision=precision, GRADIENT_ACCUMULATION=accumulation))


def criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return GPTLMLoss(shift=False)(logits, labels)


def build(case: str) -> tuple[Any, Callable[[torch.Tensor], float]]:
    """(engine, one_step) for this rank of `case`; one_step(batch) trains one step and returns this rank's loss."""
    import zerogpt
    from zerogpt.context import DistContext
    from zerogpt.parallel import ParallelDims
    from zerogpt.parallel.pipeline import Pipeline
    from zerogpt.parallel.plan import parallelize

    if case == "dp2_zero3_fp16":
        model = tiny_model(dropout=0.1)
        model.transformer.wpe.weight.requires_grad_(False)
        engine = zerogpt.initialize(model, adamw_two_groups(model), criterion, config=_config(3, "fp16"),
                                    ctx=DistContext.current("cpu"))
        return engine, lambda batch: _plain_step(engine, batch)
    dims = ParallelDims(tp=2) if case == "tp2_zero1_bf16" else ParallelDims(pp=2)
    ctx = DistContext.current("cpu").with_mesh(dims.build_mesh("cpu"))
    parallel = parallelize(tiny_model(dropout=0.0), ctx.mesh, False)
    config = _config(1, "bf16") if case == "tp2_zero1_bf16" else _config(2, "fp32", accumulation=2)
    engine = zerogpt.initialize(parallel, adamw_two_groups(parallel.module), criterion, config=config, ctx=ctx)
    if case == "tp2_zero1_bf16":
        return engine, lambda batch: _plain_step(engine, batch)
    pipeline = Pipeline(engine)
    return engine, lambda batch: _pipeline_step(engine, pipeline, batch)


def _plain_step(engine: Any, batch: torch.Tensor) -> float:
    with engine.loss_context():
        loss = engine.criterion(engine(batch[:, :-1]), batch[:, 1:])
        engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.item()


def _pipeline_step(engine: Any, pipeline: Any, batch: torch.Tensor) -> float:
    loss = pipeline.train_step([(b[:, :-1], b[:, 1:]) for b in batch.split(BATCH // 2)])
    engine.step()
    engine.zero_grad()
    return pipeline.from_last_stage(loss).item()


def write_rank(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """Train SAVED_AT steps, save, train MORE: {case: this rank's losses of the MORE steps}."""
    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        torch.manual_seed(100 + rank)
        engine, one_step = build(case)
        data = batches(engine.ctx.dp_rank)
        for batch in data[:SAVED_AT]:
            one_step(batch)
        engine.save_checkpoint(os.path.join(root, case), extra_state={"case": case})
        out[case] = [one_step(batch) for batch in data[SAVED_AT:]]
        engine.close()
    return out


def resume_rank(rank: int, world: int, root: str, again: str) -> dict[str, list[float]]:
    """Load each fixture, save it again under `again`, train MORE steps: {case: this rank's losses}."""
    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        torch.manual_seed(7 + rank)  # not the writer's seed: the checkpoint restores the RNG
        engine, one_step = build(case)
        assert engine.load_checkpoint(os.path.join(root, case)) == {"case": case}
        engine.save_checkpoint(os.path.join(again, case), extra_state={"case": case})
        out[case] = [one_step(batch) for batch in batches(engine.ctx.dp_rank)[SAVED_AT:]]
        engine.close()
    return out


def main() -> None:
    from tests.dist_utils import run_distributed

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    shutil.rmtree(ROOT, ignore_errors=True)
    os.makedirs(ROOT)
    losses = run_distributed(write_rank, 2, ROOT, timeout=300)
    with open(EXPECTED, "w") as f:
        json.dump({"written_by": commit, "torch": torch.__version__,
                   "losses": {case: [rank[case] for rank in losses] for case in CASES}}, f, indent=1)
        f.write("\n")
    print(f"wrote {ROOT} at {commit}")


if __name__ == "__main__":
    main()
