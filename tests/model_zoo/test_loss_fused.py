"""Tests for the chunked loss's own kernel (model_zoo/loss.py, backend "torch"): the plain loss's value and gradients
(fp32 and bf16, ignore_index, vocab padding, tied and untied heads), gradients made in the forward (backward
recomputes nothing), at most 1/8 of the plain loss's peak memory, and the backend choice (library kernels need
CUDA; none runs here)."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from model_zoo.gpt import GPTConfig
from model_zoo.llama import llama_tiny
from model_zoo.loss import (GPTLMLoss, available_loss_backends, chunk_tokens, chunked_cross_entropy,
                            loss_backends_side_by_side, resolve_loss_backend)
from tests.model_zoo.tiny_gpt import ids


def _inputs(dtype: torch.dtype, tokens: int = 40, width: int = 32, padded: int = 192, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(padded, width, generator=g) / width**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, 150, (tokens,), generator=g)  # 150 real classes, 42 padding rows
    labels[3:9] = -100
    return hidden, weight, labels


def _plain(hidden, weight, labels):
    return GPTLMLoss(shift=False)(F.linear(hidden, weight)[..., :150], labels)


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", [(torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1e-5, 2**-7)])
def test_loss_and_grads_equal_the_plain_loss(dtype, loss_tol, grad_tol):
    """bf16: the same bf16 logits and bf16 gradient of the logits as the plain path; only the weight's gradient
    is summed over chunks in bf16, one rounding per chunk (40 of them at one token a chunk): within 2 bf16 ulps of
    its largest entry (bf16's eps is 2**-8)."""
    hidden, weight, labels = _inputs(dtype)
    plain = _plain(hidden, weight, labels)
    want = torch.autograd.grad(plain, (hidden, weight))
    for chunk_size in (1, 7, 40, 1000):
        loss = chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=chunk_size, backend="torch")
        got = torch.autograd.grad(loss, (hidden, weight))
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, plain, rtol=loss_tol, atol=loss_tol)
        for g, w in zip(got, want):
            assert g.dtype == dtype
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=grad_tol * w.float().abs().max().item())
        assert got[1][150:].abs().max() == 0  # padding rows are never a class


def test_the_incoming_gradient_scales_and_a_second_backward_is_refused():
    """The saved gradients are scaled in place (one copy held, not two): a retained graph's second backward would
    read them scaled, and autograd refuses it."""
    hidden, weight, labels = _inputs(torch.float32)
    want = torch.autograd.grad(3 * _plain(hidden, weight, labels), (hidden, weight))
    loss = 3 * chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=8, backend="torch")
    for g, w in zip(torch.autograd.grad(loss, (hidden, weight), retain_graph=True), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (hidden, weight))


def test_without_grad_it_is_the_loss_alone():
    hidden, weight, labels = _inputs(torch.float32)
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=8, backend="torch")
    torch.testing.assert_close(loss, _plain(hidden, weight, labels).detach(), rtol=1e-6, atol=1e-6)
    assert not loss.requires_grad


@pytest.mark.parametrize("tied", [True, False])
def test_llama_tied_and_untied_heads_get_the_plain_grads(tied):
    torch.manual_seed(0)
    plain = llama_tiny(tie_word_embeddings=tied)
    torch.manual_seed(0)
    chunked = llama_tiny(tie_word_embeddings=tied, chunked_loss=True, loss_chunk_size=5, loss_backend="torch")
    x, y = ids(vocab=1024), ids(vocab=1024, seed=2)
    y[0, :4] = -100
    expected, got = plain(x, labels=y).loss, chunked(x, labels=y).loss
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    expected.backward()
    got.backward()
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tied
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


class MatmulsAndVocabTensors(TorchDispatchMode):
    """The matmuls run, the shapes of their operands and outputs, and the shapes of the tensors made with the
    vocabulary as their last dim."""

    MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm)

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.matmuls, self.shapes, self.matmul_shapes = vocab, 0, set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.MATMULS:
            self.matmuls += 1
            self.matmul_shapes |= {tuple(t.shape) for t in pytree.tree_leaves((args, kwargs, out))
                                   if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.size(-1) == self.vocab:
                self.shapes.add(tuple(t.shape))
        return out


def test_backward_recomputes_nothing():
    """The gradients are made in the forward: backward runs no matmul and makes no (tokens x vocab) tensor."""
    hidden, weight, labels = _inputs(torch.float32)
    loss = chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=8, backend="torch")
    with MatmulsAndVocabTensors(vocab=192) as backward:
        loss.backward()
    assert backward.matmuls == 0 and not backward.shapes
    with MatmulsAndVocabTensors(vocab=192) as forward:  # the probe sees the forward's chunks
        chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=8, backend="torch")
    chunk = 5  # chunk_tokens(40, 8): 40 tokens in 8 chunks
    assert forward.matmuls > 0 and (chunk, 192) in forward.shapes
    assert max(rows for rows, _ in forward.shapes - {(32, 192)}) == chunk  # (32, 192): the weight's transpose


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_heads_matmuls_run_over_the_padded_vocabulary(dtype):
    """The plain path's lm_head multiplies by the padded weight (GPT-2: 50304 rows, a multiple of 64), and so do
    the chunked loss's three matmuls: no operand or output has the real vocabulary's width (50257 there, 150 here),
    whose odd leading dimension keeps cuBLAS off its aligned tensor-core kernels (the chunked loss ran at 0.78x the
    plain loss on an H200 with it). The padding's logits are -inf: never a class, no gradient."""
    hidden, weight, labels = _inputs(dtype)
    with MatmulsAndVocabTensors(vocab=192) as probe:
        loss = chunked_cross_entropy(hidden, weight, labels, vocab_size=150, chunk_size=8, backend="torch")
        loss.backward()
    assert probe.matmuls == 8 * 3, probe.matmuls  # each chunk's logits, hidden gradient and weight gradient
    assert not any(150 in shape for shape in probe.matmul_shapes), probe.matmul_shapes
    assert weight.grad[150:].abs().max() == 0 and torch.isfinite(loss)


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops made while the mode is on and that are still referenced.

    A storage lives while any tensor on it does; each op's outputs are held by weak reference (PyTorch keeps a
    tensor's Python object while autograd still holds the tensor), grouped by storage pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[int, list[weakref.ref]]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                entry = self.storages.get(ptr)
                if entry is None or not any(r() is not None for r in entry[1]):  # new, or a freed one's address
                    entry = self.storages[ptr] = (nbytes, [])
                entry[1].append(weakref.ref(t))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        return sum(nbytes for nbytes, refs in self.storages.values() if any(r() is not None for r in refs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_is_at_most_an_eighth_of_the_plain_loss(dtype):
    """2048 tokens, width 64, vocab 8192: where the logits outweigh the hidden states and the head's weight, as in
    GPT-2's and Llama-3's heads. The peak over forward + backward of what the loss itself allocates (the weight's
    gradient included, which both paths make)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 64, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(8192, 64, generator=g) / 8).to(dtype).requires_grad_()
    labels = torch.randint(0, 8192, (2048,), generator=g)
    peaks = {}
    for name, loss_of in (("plain", lambda: GPTLMLoss(shift=False)(F.linear(hidden, weight), labels)),
                          ("chunked", lambda: chunked_cross_entropy(hidden, weight, labels, backend="torch"))):
        with LiveBytes() as probe:
            loss_of().backward()
        peaks[name] = probe.peak
        hidden.grad = weight.grad = None
    assert peaks["plain"] >= 2048 * 8192 * (dtype.itemsize + 4)  # sanity: the probe sees the batch's logits
    assert peaks["chunked"] <= peaks["plain"] / 8, peaks


def test_chunks_are_at_most_an_eighth_of_the_tokens():
    assert chunk_tokens(8192, 1024) == 1024 and chunk_tokens(4096, 1024) == 512 and chunk_tokens(3, 1024) == 1
    assert chunk_tokens(100_000, 1024) == 1024


def test_backends_on_cpu_and_their_refusals():
    assert available_loss_backends("cpu") == ["torch"]
    assert resolve_loss_backend("auto", "cpu") == "torch"
    for forced in ("cce", "liger"):
        with pytest.raises(ValueError, match="loss_backend='(cce|liger)' needs CUDA") as refused:
            resolve_loss_backend(forced, "cpu")
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="GPTConfig.loss_backend must be one of auto, torch, cce, liger"):
        GPTConfig(loss_backend="triton")


def test_side_by_side_rows_compare_each_backend_with_the_plain_loss():
    hidden, weight, labels = _inputs(torch.float32)
    rows = loss_backends_side_by_side(hidden, weight, labels, vocab_size=150, chunk_size=8, steps=1)
    assert [r["backend"] for r in rows] == ["plain", "torch"]
    assert rows[1]["loss_diff"] < 1e-6 and rows[1]["grad_diff"] < 1e-6 and rows[1]["peak_bytes"] is None
    forced = loss_backends_side_by_side(hidden, weight, labels, vocab_size=150, steps=1, backends=("plain", "cce"))
    assert "needs CUDA" in forced[1]["error"]


def test_the_torch_backend_compiles():
    """Dynamo traces the autograd.Function (its chunk loop unrolled; no data-dependent shape, no sync) in one graph."""
    hidden, weight, labels = _inputs(torch.float32)
    compiled = torch.compile(lambda h, w, y: chunked_cross_entropy(h, w, y, vocab_size=150, chunk_size=16,
                                                                   backend="torch"),
                             backend="aot_eager", fullgraph=True)
    loss = compiled(hidden, weight, labels)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(_plain(hidden, weight, labels), (hidden, weight))
    torch.testing.assert_close(loss, _plain(hidden, weight, labels), rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_fp16_gradients_meet_the_loss_scale_before_their_cast():
    """fp16 with a loss scale, as precision='fp16' runs: 4096 tokens over 2048 near-uniform classes, so
    (softmax - one_hot) / count is about 1e-7, under fp16's normal range before the scale; the plain path scales its
    fp32 gradient first, then casts, and so must the chunked one."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4096, 32, generator=g).half().requires_grad_()
    weight = (torch.randn(2048, 32, generator=g) / 100).half().requires_grad_()
    labels = torch.randint(0, 2048, (4096,), generator=g)
    scale = 2.0**14
    want = torch.autograd.grad(GPTLMLoss(shift=False)(F.linear(hidden, weight), labels) * scale, (hidden, weight))
    loss = chunked_cross_entropy(hidden, weight, labels, backend="torch")
    got = torch.autograd.grad(loss * scale, (hidden, weight))
    for gg, w in zip(got, want):
        assert gg.dtype == torch.float16
        torch.testing.assert_close(gg.float(), w.float(), rtol=0, atol=2**-9 * w.float().abs().max().item())
