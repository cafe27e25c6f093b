"""The language-model loss: next-token cross-entropy in fp32, for our GPT's logits or any output with `.logits`.

GPT.forward(labels=...) uses it with shift=False; training scripts use it directly. Knows nothing of the model.
`chunked_cross_entropy` is the same loss from the hidden states and the head's weight, a chunk of tokens at a
time, so the logits of the whole batch never exist (GPTConfig.chunked_loss); `loss_backends_side_by_side` runs
each of its backends on the same inputs, for the GPU slices.
"""
from __future__ import annotations

import importlib.util
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTLMLoss", "chunked_cross_entropy", "LOSS_BACKENDS", "available_loss_backends", "resolve_loss_backend",
           "chunk_tokens", "loss_backends_side_by_side"]

LOSS_BACKENDS = ("auto", "torch", "cce", "liger")
"""The chunked loss's backends (GPTConfig/LlamaConfig.loss_backend): "torch" is this module's own (any device);
"cce" is Apple's Cut Cross-Entropy (`pip install cut-cross-entropy`), "liger" Liger-Kernel's fused linear
cross-entropy (`pip install liger-kernel`), both Triton kernels, so CUDA only. "auto": the first of
AUTO_LIBRARY_ORDER that is installed when the hidden states are on CUDA, else "torch"."""

LIBRARY_BACKENDS = ("cce", "liger")
AUTO_LIBRARY_ORDER: tuple[str, ...] = ()
"""Which library "auto" takes before our own kernel: none until a GPU has run them side by side
(bench/gpu_slices/compute.py's "chunked loss cce/liger" rows, loss_backends_side_by_side). A library that was never
measured here is not taken by default; put a name here when its row beats "chunked loss" at 50k and 128k."""

MIN_CHUNKS = 8
"""The chunked loss splits the tokens into at least this many chunks, so one chunk's logits are at most 1/8 of the
batch's (issue 46.3's memory bound), whatever loss_chunk_size allows."""

_LIBRARY_MODULES = dict(cce="cut_cross_entropy", liger="liger_kernel")


class GPTLMLoss(nn.Module):
    """Next-token cross-entropy, mean over targets != ignore_index, computed in fp32.

    shift=True (default, the Colossal-AI tutorial form): `loss(logits, input_ids)` predicts input_ids[t+1]
    from position t. shift=False: `loss(logits, labels)` with labels already aligned (labels[t] = next token
    of input_ids[t]), as zerogpt's datasets yield them. `logits` may also be any output object with `.logits`
    (GPTOutput, Hugging Face CausalLMOutput).

    Example:
        >>> logits, ids = torch.randn(2, 8, 100), torch.randint(0, 100, (2, 8))
        >>> GPTLMLoss()(logits, ids).shape
        torch.Size([])
    """

    def __init__(self, ignore_index: int = -100, shift: bool = True):
        super().__init__()
        self.ignore_index, self.shift = ignore_index, shift

    def forward(self, logits: Any, labels: torch.Tensor) -> torch.Tensor:
        """logits (B, T, V) or an object with `.logits`; labels (B, T) int64. Returns a scalar fp32 tensor."""
        logits = getattr(logits, "logits", logits)
        if self.shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                               ignore_index=self.ignore_index)


def available_loss_backends(device: torch.device | str) -> list[str]:
    """The concrete backends that can run on `device`: "torch" always; "cce" and "liger" on CUDA where installed
    (they are Triton kernels, and Triton needs a GPU)."""
    names = ["torch"]
    if torch.device(device).type == "cuda":
        names += [n for n in LIBRARY_BACKENDS if importlib.util.find_spec(_LIBRARY_MODULES[n]) is not None]
    return names


def resolve_loss_backend(backend: str, device: torch.device | str) -> str:
    """"auto" -> the first available of AUTO_LIBRARY_ORDER, else "torch"; a forced backend that cannot run on
    `device` raises ValueError in one line naming the key."""
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"loss_backend={backend!r} is not one of {', '.join(LOSS_BACKENDS)}")
    available = available_loss_backends(device)
    if backend == "auto":
        return next((n for n in AUTO_LIBRARY_ORDER if n in available), "torch")
    if backend not in available:
        package = _LIBRARY_MODULES[backend].replace("_", "-")
        raise ValueError(f"loss_backend={backend!r} needs CUDA and `pip install {package}` (this run: "
                         f"{torch.device(device).type}; available: {', '.join(available)}); set "
                         f"model.loss_backend='auto' or 'torch'")
    return backend


def chunk_tokens(n_tokens: int, chunk_size: int) -> int:
    """Tokens per chunk: at most `chunk_size`, and at most 1/MIN_CHUNKS of the tokens (so at least MIN_CHUNKS
    chunks when there are that many tokens)."""
    return max(1, min(chunk_size, math.ceil(n_tokens / MIN_CHUNKS)))


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          vocab_size: int | None = None, chunk_size: int = 1024, ignore_index: int = -100,
                          backend: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight[:vocab_size].T` against `labels`, without the batch's logits.

    The plain path holds (B*T, V) logits in the compute dtype, their fp32 copy and its softmax for backward:
    with GPT-2's 50k vocabulary and 8k tokens that is several GiB. The "torch" backend (_FusedLinearCrossEntropy)
    computes a chunk of tokens' logits at a time (chunk_tokens), and in the same pass their gradient, into the
    gradients of `hidden` and `weight`; backward only scales those by the incoming gradient. Nothing is recomputed
    and the weight is not read in backward (ZeRO-3 need not gather it again for this op). The loss is
    GPTLMLoss(shift=False)'s up to fp32 summation order; the gradients are its, chunk by chunk (the weight's summed
    over chunks in its own dtype). "cce"/"liger" hand the same inputs to a library kernel (LOSS_BACKENDS).

    Args:
        hidden: (..., C) final hidden states in the compute dtype.
        weight: (V_padded, C) the head's weight (GPT-2: the tied embedding).
        labels: (...) int64 aligned targets; ignore_index is not counted.
        vocab_size: the real vocabulary (rows past it are padding, never a class); None = all rows.
        chunk_size: the most tokens per chunk (the "torch" backend; fewer when the batch has under 8 chunks' worth).
        backend: one of LOSS_BACKENDS.
    Example:
        >>> h, w, y = torch.randn(2, 8, 16), torch.randn(100, 16), torch.randint(0, 90, (2, 8))
        >>> chunked_cross_entropy(h, w, y, vocab_size=90, chunk_size=5).shape
        torch.Size([])
    """
    hidden, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    vocab_size = vocab_size or weight.size(0)
    name = resolve_loss_backend(backend, hidden.device)
    if name != "torch":
        return _LIBRARY_LOSSES[name](hidden, weight[:vocab_size], labels, ignore_index)
    chunk = chunk_tokens(hidden.size(0), chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(hidden, weight, labels, vocab_size, chunk, ignore_index)
    return _loss_and_grads(hidden, weight, labels, vocab_size, chunk, ignore_index, False, False)[0]


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss and, in the same chunked pass, its gradients wrt hidden and weight (Liger's and Cut
    Cross-Entropy's scheme, in plain PyTorch ops): the forward saves only the two gradients, which the backward
    scales in place (so it runs once: not under retain_graph=True)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                chunk: int, ignore_index: int) -> torch.Tensor:
        loss, grad_hidden, grad_weight = _loss_and_grads(hidden, weight, labels, vocab_size, chunk, ignore_index,
                                                         ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # in place, as Liger does: a copy beside them would double what the loss holds at its backward (at
        # Llama-3-8B's head in bf16, 1 GiB more). A retained graph's second backward then meets autograd's own
        # error for a saved tensor modified in place. fp16's gradients were kept in fp32 and meet the loss scale
        # (grad_loss) before their cast, as the plain path's do.
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)).to(dtype)
                  for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return scaled[0], scaled[1], None, None, None, None


def _loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, chunk: int,
                    ignore_index: int, want_hidden: bool, want_weight: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss over counted targets and d(loss)/d(hidden), d(loss)/d(weight) (None where not wanted).

    Per chunk: logits in the compute dtype (the head's matmul, as the plain path rounds them), upcast once to fp32;
    then, in that one fp32 buffer, less the row's max, exponentiated (the logsumexp and the target's logit read on
    the way), normalized to the softmax, minus one_hot, scaled by 1/count (0 on ignored rows), and cast to the
    compute dtype for the two matmuls. No device sync: the count stays a tensor."""
    counted = labels != ignore_index
    inv_count = 1.0 / counted.sum().to(torch.float32)
    targets = torch.where(counted, labels, 0)
    # fp16 (no exponent range for an unscaled gradient): the logits' gradient goes to the matmuls without the
    # 1/count, which is applied to their fp32 results, kept in fp32 until backward brings the loss scale
    half = hidden.dtype == torch.float16
    grad_hidden = torch.empty_like(hidden, dtype=torch.float32 if half else None) if want_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32 if half else None) if want_weight else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.size(0), chunk):
        part = slice(start, start + chunk)
        row_scale = counted[part] if half else counted[part] * inv_count
        loss_sum, grad_logits = _chunk_loss(hidden[part], weight, vocab_size, targets[part, None], counted[part],
                                            row_scale, want_hidden or want_weight)
        total = total + loss_sum
        if grad_hidden is not None:
            if half:
                grad_hidden[part] = (grad_logits @ weight).float() * inv_count
            else:  # written into its rows of the gradient, no (chunk, C) temporary and copy
                torch.mm(grad_logits, weight, out=grad_hidden[part])
        if grad_weight is not None and half:
            grad_weight.add_((grad_logits.t() @ hidden[part]).float() * inv_count)
        elif grad_weight is not None:
            grad_weight.addmm_(grad_logits.t(), hidden[part])
        del grad_logits  # before the next chunk's logits exist: one chunk's buffers at a time
    return total * inv_count, grad_hidden, grad_weight


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, targets: torch.Tensor,
                counted: torch.Tensor, row_scale: torch.Tensor, want_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss over counted targets, and (softmax - one_hot) x row_scale in the compute dtype (None
    unless `want_grad`), both over every row of `weight`: the classes past `vocab_size` (padding) get a logit of
    -inf, so their softmax and their gradient are exactly 0. A function of its own so that its fp32 buffer is freed
    on return."""
    # the padded width (GPT-2: 50304 = 64 x 786, not 50257) keeps the head's three matmuls on aligned leading
    # dimensions, as the plain path's lm_head is; cuBLAS's tensor-core kernels want multiples of 8
    logits = F.linear(hidden, weight).float()
    if vocab_size < weight.size(0):
        logits[:, vocab_size:] = float("-inf")
    shifted = logits.sub_(logits.amax(dim=-1, keepdim=True))  # in place: one fp32 (chunk, V) buffer throughout
    target = shifted.gather(1, targets).squeeze(1)
    sums = shifted.exp_().sum(dim=-1)
    loss_sum = ((sums.log() - target) * counted).sum()  # logsumexp - target logit, both less the row's max
    if not want_grad:
        return loss_sum, None
    # (softmax - one_hot) x row_scale: the softmax's 1/sum and the row's scale in one pass over the buffer
    scale = row_scale.to(torch.float32)
    grad = shifted.mul_((scale / sums)[:, None])
    grad.scatter_add_(1, targets, -scale[:, None])
    return loss_sum, grad.to(hidden.dtype)


def _cut_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       ignore_index: int) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index).float()


def _liger_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index).float()


_LIBRARY_LOSSES: dict[str, Callable[..., torch.Tensor]] = dict(cce=_cut_cross_entropy, liger=_liger_cross_entropy)


def loss_backends_side_by_side(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               vocab_size: int | None = None, chunk_size: int = 1024, steps: int = 5,
                               backends: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Each backend's forward + backward on the same inputs, beside the plain loss ("plain": F.linear then
    GPTLMLoss), for the GPU slices: one row per backend with its mean seconds over `steps` (after one warm-up),
    its peak memory above the inputs (CUDA only; None elsewhere), and its loss's and gradients' largest difference
    from the plain loss's. A backend that fails gives its row an `error` instead. `backends`: default the plain
    loss and every available one (available_loss_backends)."""
    names = backends or ("plain", *available_loss_backends(hidden.device))
    vocab_size = vocab_size or weight.size(0)
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        n: (lambda n=n: chunked_cross_entropy(hidden, weight, labels, vocab_size=vocab_size, chunk_size=chunk_size,
                                              backend=n)) for n in names if n != "plain"}
    runs["plain"] = lambda: GPTLMLoss(shift=False)(F.linear(hidden, weight)[..., :vocab_size], labels)
    rows, reference = [], None
    for name in names:
        try:
            seconds, peak, (loss, grads) = _timed(runs[name], (hidden, weight), steps)
        except Exception as e:  # a library kernel that does not run here: its row says why
            rows.append(dict(backend=name, error=f"{type(e).__name__}: {e}".splitlines()[0]))
            continue
        reference = reference or (loss, grads)
        rows.append(dict(backend=name, seconds=seconds, peak_bytes=peak, loss=loss.item(),
                         loss_diff=(loss - reference[0]).abs().item(),
                         grad_diff=max((g.float() - r.float()).abs().max().item()
                                       for g, r in zip(grads, reference[1]))))
    return rows


def _timed(run: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...], steps: int
           ) -> tuple[float, int | None, tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    cuda = inputs[0].device.type == "cuda"
    loss = run()
    grads = torch.autograd.grad(loss, inputs)  # warm-up (and the result compared)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(steps):
        torch.autograd.grad(run(), inputs)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return (time.perf_counter() - start) / steps, peak, (loss.detach(), grads)
