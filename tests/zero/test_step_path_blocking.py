"""No blocking call on the training thread between log steps (issue 46 point 5), in the rows gpu_check's verify slice
counts device syncs in: stages 0-3; optimizer offload to cpu, cpu with the params, disk; bf16 moments; the chunked
loss; and the models users bring (a Llama with grouped-query attention, a Qwen3 with q/k norms and a tied head,
whose vocabularies are padded as GPT-2's is). A GPU run's plan is taken on this CPU (tests/zero/gpu_plan.py): the
host step behind the next forward on its worker, gradients handed over as their reductions launch, compute copies
staged. tests/zero/blocking_ops.py says
what counts as blocking and why this sees what a Python-level count cannot.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from model_zoo.llama import llama_tiny
from tests.zero.blocking_ops import BlockingOps
from tests.zero.gpu_plan import planned
from zerogpt.context import DistContext

VOCAB, SEQ, MICRO, ACCUM, WARMUP, COUNTED = 96, 16, 2, 2, 2, 2
GPU_PLAN = dict(host_step_overlaps=True, hand_over_at_launch=True, stages_compute_copies=True)
ROWS = {f"stage {s}": dict(stage=s) for s in range(4)}
ROWS.update({f"stage {s} offload=cpu": dict(stage=s, offload="cpu") for s in range(4)})
ROWS.update({"stage 3 offload=cpu+param": dict(stage=3, offload="cpu", offload_param=True),
             "stage 3 offload=disk": dict(stage=3, offload="disk"),
             "stage 3 offload=cpu state_dtype=bf16": dict(stage=3, offload="cpu", state_dtype="bf16"),
             "stage 3 chunked loss": dict(stage=3, chunked_loss=True),
             "llama stage 3": dict(stage=3, model="llama"),
             "qwen3 stage 3 offload=cpu chunked loss": dict(stage=3, offload="cpu", chunked_loss=True, model="qwen3")})
MODELS = dict(gpt2=gpt2_tiny, llama=llama_tiny, qwen3=lambda **kw: llama_tiny(qk_norm=True, tie_word_embeddings=True,
                                                                              **kw))


def build(stage: int, offload: str | None = None, offload_param: bool = False, state_dtype: str = "fp32",
          chunked_loss: bool = False, model: str = "gpt2"):
    """The optimizer a GPU run gets: HybridAdam where offloaded, else torch's fused AdamW (what initialize makes a
    GPU run's AdamW), whose kernel skips a non-finite step on the device."""
    import zerogpt

    torch.manual_seed(0)
    extra = dict(dropout=0.0) if model == "gpt2" else {}
    model = MODELS[model](vocab_size=VOCAB, max_position_embeddings=SEQ, chunked_loss=chunked_loss, loss_chunk_size=8,
                          **extra)
    zero: dict = dict(stage=stage)
    optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.1, fused=True)
    if offload is not None:
        home = dict(device="disk", path=tempfile.mkdtemp(prefix="zerogpt-test-disk-")) if offload == "disk" \
            else dict(device="cpu")
        zero["offload_optimizer"] = dict(**home, state_dtype=state_dtype)
        optimizer = dict(type="HybridAdam", lr=1e-3, weight_decay=0.1)
    if offload_param:
        zero["offload_param"] = dict(device="cpu")
    cfg = zerogpt.Config(dict(zero=zero, precision="bf16", clip_grad_norm=1.0, GRADIENT_ACCUMULATION=ACCUM))
    with planned(**GPU_PLAN):
        return zerogpt.initialize(model, optimizer, config=cfg, ctx=DistContext.current("cpu"))


def train_step(engine, step: torch.Tensor, chunked_loss: bool) -> None:
    """One optimizer step as the Trainer runs it on steps that log nothing: nothing is read back."""
    for tokens in step:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if chunked_loss:
            loss = engine(inputs, labels=labels).loss
        else:
            loss = GPTLMLoss(shift=False)(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
    engine.zero_grad()


def blocking_sites(row: dict) -> dict[str, int]:
    """The blocking ops the training thread ran over COUNTED steps after WARMUP, by the project line behind each."""
    engine = build(**row)
    steps = torch.randint(0, VOCAB, (WARMUP + COUNTED, ACCUM, MICRO, SEQ + 1),
                          generator=torch.Generator().manual_seed(3))
    chunked = row.get("chunked_loss", False)
    try:
        for step in steps[:WARMUP]:
            train_step(engine, step, chunked)
        with BlockingOps() as seen:
            for step in steps[WARMUP:]:
                train_step(engine, step, chunked)
        assert engine.sharded_optim.host_step.overlaps == (row.get("offload") is not None)  # the worker stepped
    finally:
        engine.close()
    return dict(seen.sites)


@pytest.mark.timeout(300)
def test_no_blocking_call_on_the_training_thread_between_log_steps():
    found = {name: sites for name, row in ROWS.items() if (sites := blocking_sites(row))}
    assert found == {}


def test_the_count_sees_a_blocking_call_added_to_the_step_path(monkeypatch):
    """The count can fail: a value read added to the step (the kind of line a change could bring) and a torch
    call with a data-dependent output size are each found, named by the line that made them."""
    from zerogpt.zero.sharded_optim import ShardedOptimizer

    global_sumsq = ShardedOptimizer._global_sumsq

    def reads_back(self):
        total = global_sumsq(self)
        if total > 0:  # bool() of a device tensor: a sync
            torch.unique(torch.zeros(3, dtype=torch.long))
        return total

    monkeypatch.setattr(ShardedOptimizer, "_global_sumsq", reads_back)
    sites = blocking_sites(ROWS["stage 3 offload=cpu"])
    assert sum(n for site, n in sites.items() if site.startswith(("_local_scalar_dense", "is_nonzero"))) == COUNTED
    assert sum(n for site, n in sites.items() if site.startswith("_unique")) == COUNTED
    assert all(site.split(" from ")[1].startswith("zerogpt/zero/sharded_optim.py:") for site in sites), sites
