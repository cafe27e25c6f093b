"""A rank's own dropout stream (zerogpt/parallel/rng.py), alone and inside a tensor-parallel GPT with dropout on."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from zerogpt.parallel.rng import own_stream, rank_stream

SEQ, VOCAB = 16, 128


def _mask(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropout mask drawn on `rank`'s stream from the global state seeded 0, and the global state after."""
    torch.manual_seed(0)
    with rank_stream(rank, torch.device("cpu")):
        mask = torch.rand(64) < 0.5
    return mask, torch.get_rng_state()


def test_each_rank_draws_its_own_masks_and_the_shared_stream_stays_in_step():
    (mask0, after0), (mask1, after1), (again0, _) = _mask(0), _mask(1), _mask(0)
    assert not torch.equal(mask0, mask1)            # rank 1's heads do not get rank 0's masks
    assert torch.equal(mask0, again0)               # the same state and rank: the same masks (recomputation)
    torch.manual_seed(0)
    torch.randint(0, 2**62, ())
    assert torch.equal(after0, after1) and torch.equal(after0, torch.get_rng_state())  # one shared draw


def test_eval_mode_and_p_zero_draw_nothing():
    drop = nn.Dropout(0.1)
    own_stream(drop, rank=1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    drop.eval()(torch.ones(8))
    nn.Dropout(0.0)(torch.ones(8))
    assert torch.equal(torch.get_rng_state(), state)


def test_the_stream_is_left_even_when_the_forward_raises():
    class Boom(nn.Dropout):
        def forward(self, x):
            raise RuntimeError("boom")

    boom = Boom(0.5)
    own_stream(boom, rank=1)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom"):
        boom(torch.ones(4))
    expected = torch.Generator().manual_seed(0)
    torch.randint(0, 2**62, (), generator=expected)  # the one shared draw, then back on the global stream
    assert torch.equal(torch.get_rng_state(), expected.get_state())


def _record_rng_inside(module: nn.Module, states: list) -> None:
    forward = module.forward

    def recording_forward(*args, **kwargs):
        states.append(torch.get_rng_state())
        return forward(*args, **kwargs)

    module.forward = recording_forward


def _tp_dropout(rank: int, world: int, sequence_parallel: bool, compiled: bool) -> dict:
    """TP2 with dropout 0.1, activation checkpointing off and on, the blocks eager or compiled by inductor: the
    residual stream each block hands on, the loss and the gradients of the replicated LayerNorm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from zerogpt.compile import compile_blocks
    from zerogpt.parallel.tensor import apply_tensor_parallel

    torch.set_num_threads(1)
    out = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = gpt2_tiny(vocab_size=VOCAB, dropout=0.1, max_position_embeddings=SEQ, checkpoint=checkpoint)
        residual, attend_rng, embed_rng = [], [], []
        # the RNG state each dropout draws from: read inside the forward that the plan wraps in a rank's stream
        _record_rng_inside(model.transformer.h[0].attn.attend, attend_rng)
        _record_rng_inside(model.transformer.drop, embed_rng)
        apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), sequence_parallel)
        model.transformer.h[0].register_forward_hook(lambda m, i, o: residual.append(o[0].detach().clone()))
        if compiled:
            torch._dynamo.reset()
            compile_blocks(model)
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)  # the dropout stream: the same on every rank
        with loss_parallel():
            loss = GPTLMLoss(shift=False)(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
        ln = model.transformer.h[0].ln_1.weight.grad
        out[checkpoint] = {"residual": residual[0], "loss": float(loss.to_local()), "attend_rng": attend_rng[0],
                           "embed_rng": embed_rng[0],
                           "ln_grad": (ln.full_tensor() if isinstance(ln, DTensor) else ln).clone()}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel, compiled", [(False, False), (True, False), (False, True), (True, True)])
def test_tensor_parallel_dropout_keeps_the_replicated_stream_replicated(sequence_parallel, compiled):
    """With dropout on, the tensor-parallel ranks still agree on what they all hold (the residual stream without
    SP, the loss, the LayerNorm's gradient), and recomputation under activation checkpointing redraws exactly
    the masks of the forward. Compiled by inductor too: its own random numbers, seeded from the shared stream,
    are alike on every rank, and the modules on a rank's stream run eagerly between its graphs."""
    rank0, rank1 = run_distributed(_tp_dropout, 2, sequence_parallel, compiled, timeout=280)
    # each rank's heads draw from their own stream; the embedding dropout too under SP (its own positions)
    assert not torch.equal(rank0[False]["attend_rng"], rank1[False]["attend_rng"])
    assert torch.equal(rank0[False]["embed_rng"], rank1[False]["embed_rng"]) != sequence_parallel
    for checkpoint in (False, True):
        if not sequence_parallel:  # (under SP each rank holds its own half of the positions)
            assert torch.equal(rank0[checkpoint]["residual"], rank1[checkpoint]["residual"])
        assert rank0[checkpoint]["loss"] == rank1[checkpoint]["loss"]
        assert torch.equal(rank0[checkpoint]["ln_grad"], rank1[checkpoint]["ln_grad"])
    for rank in (rank0, rank1):  # checkpointing changes nothing: the same masks in forward and recomputation
        assert rank[True]["loss"] == rank[False]["loss"]
        torch.testing.assert_close(rank[True]["ln_grad"], rank[False]["ln_grad"], rtol=1e-6, atol=1e-7)
    if compiled and sequence_parallel:  # every dropout in a block is on a rank's stream: the eager run's numbers
        eager, _ = run_distributed(_tp_dropout, 2, sequence_parallel, False, timeout=280)
        for checkpoint in (False, True):  # (the second compiled run loads the first's graphs from inductor's caches)
            assert rank0[checkpoint]["loss"] == pytest.approx(eager[checkpoint]["loss"], rel=1e-6)
            torch.testing.assert_close(rank0[checkpoint]["ln_grad"], eager[checkpoint]["ln_grad"], rtol=1e-4,
                                       atol=1e-7)
