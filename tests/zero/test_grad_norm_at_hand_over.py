"""The clip norm of an offloaded step is taken from each gradient shard where it was reduced, before it crosses
to the host (GradPath.deliver), so the host step reads the host gradients once, in the update, and
not a second time for the norm (issue 29 point 3). On a GPU that is a device-bandwidth pass on the copy stream;
on this CPU the same code runs. Checked: the step reads no host gradient for the norm whenever each chunk's
gradient arrived whole (accumulation 1, or summed on the device), the norm and the trained params equal the
norm read from the host gradients, and a gradient summed on the host over micro-steps falls back to reading it.
"""
from __future__ import annotations

import pytest
import torch

from tests.zero.test_offload_traffic import build, max_param_diff, run_steps
from zerogpt.zero.chunk_state import ChunkState
from zerogpt.zero.grad_path import GradPath


def count_norm_reads(monkeypatch) -> list[int]:
    """Patch ChunkState.sumsq to count the calls made from the step (those that read a host gradient)."""
    calls = [0]
    sumsq = ChunkState.sumsq

    def counted(self, grad):
        calls[0] += grad is self.grad  # the step's fallback reads the accumulated grad shard itself
        return sumsq(self, grad)

    monkeypatch.setattr(ChunkState, "sumsq", counted)
    return calls


def norms(engine, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation):
            x = torch.randint(0, 128, (2, 17), generator=g)
            logits = engine(x[:, :-1])
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
            norm = engine.step()
            engine.zero_grad()
        out.append(norm.item())
    return out


@pytest.mark.parametrize("stage, accum", [(2, 1), (3, 1), (2, 4), (3, 4)])
def test_the_norm_of_a_whole_gradient_is_taken_at_hand_over(stage, accum, monkeypatch):
    reads = count_norm_reads(monkeypatch)
    engine = build(stage, accum=accum)
    assert accum == 1 or engine.accumulate_on_device
    got = norms(engine)
    assert reads[0] == 0
    engine.close()
    read_from_host(monkeypatch)
    expect = norms(build(stage, accum=accum))
    assert got == pytest.approx(expect, rel=1e-6)


def read_from_host(mp) -> None:
    """The reference: every gradient added into a host shard (none kept as it crossed) and its norm read there."""
    mp.setattr(GradPath, "keeps_as_crossed", lambda self, state: False)


def test_the_trained_params_are_those_of_the_norm_read_from_the_host():
    run = run_steps(build(3, accum=2), 3)
    with pytest.MonkeyPatch.context() as mp:
        read_from_host(mp)
        ref = run_steps(build(3, accum=2), 3)
    assert run["losses"] == ref["losses"]
    assert max_param_diff(run["params"], ref["params"]) == 0.0


def test_a_gradient_summed_on_the_host_has_its_norm_read_there(monkeypatch):
    """Without accumulation on the device each micro-step's shard is added on the host: no shard is the whole
    gradient, so the step reads the sum."""
    import zerogpt.build_engine as build_engine

    monkeypatch.setattr(build_engine, "_device_free_bytes", lambda device: 1024)  # no room to sum on the device
    reads = count_norm_reads(monkeypatch)
    engine = build(3, accum=2)
    assert not engine.accumulate_on_device
    norms(engine, steps=2)
    assert reads[0] > 0
    engine.close()
