"""Shared by the ZeRO tests: one training recipe, run as plain single-process PyTorch or on the engine.

A `Recipe` names module-level functions (so spawned ranks can unpickle it): how to build the model
(seeded, identical on every rank), which optimizer, the data (one global batch per step, split into
`accum` micro-batches per rank) and the loss of one micro-batch. `reference_run` trains the whole
global batch in one process; `engine_run` trains this rank's micro-batches on the engine. Equal
micro-batch sizes make the mean of micro-batch losses the global mean, so both minimise the same loss.

Semantics pinned here: a trainable parameter that gets no gradient on a step is stepped with a zero
gradient (weight decay and Adam moments still advance), because a chunk's fp32 master shard is one
tensor that the optimizer steps as a whole - DeepSpeed's flat partitions behave the same way. The
reference therefore fills missing grads with zeros (`zero_fill=True`) before its optimizer step.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from zerogpt.context import DistContext

LR = 3e-3
# eps=1e-6, not 1e-8: GPT-2's key bias has a mathematically zero gradient (softmax is shift invariant), so
# its computed gradient is rounding noise whose sign depends on summation order; with a tiny eps Adam scales
# that noise up to lr-sized steps and two correct runs drift apart by ~1e-5. A larger eps keeps noise as noise.
EPS = 1e-6
WEIGHT_DECAY = 0.1


def cpu_ctx(rank: int = 0, world: int = 1, logger: Any = None) -> DistContext:
    """The context these tests run under: gloo ranks on the CPU, even on a machine with a GPU
    (DistContext.current() would pick cuda:LOCAL_RANK while the tests feed CPU tensors)."""
    return DistContext(rank, world, torch.device("cpu"), local_rank=rank, logger=logger)


def train_losses(engine: Any, batches: torch.Tensor) -> list[float]:
    """One optimizer step per (B, T+1) batch of token ids through `engine`; this rank's loss of each step."""
    from model_zoo.gpt import GPTLMLoss

    losses = []
    for batch in batches:
        loss = GPTLMLoss(shift=False)(engine(batch[:, :-1]), batch[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def step_stats(engine: Any, grad_norm: torch.Tensor | None) -> dict | None:
    """engine.step()'s norm with the step's other facts, as plain numbers; None before the boundary."""
    if grad_norm is None:
        return None
    return dict(grad_norm=grad_norm.item(), skipped=engine.last_step_skipped, loss_scale=engine.loss_scale,
                lr=engine.lr)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)


@dataclass(frozen=True)
class Recipe:
    """What to train: model, optimizer, data and loss, as importable functions."""

    build: Callable[[], torch.nn.Module]
    data: Callable[[int, int, int], torch.Tensor]  # (steps, world, accum) -> (steps, accum, world, ...)
    loss: Callable[[Any, torch.Tensor, int], torch.Tensor]  # (model or engine, micro-batch, step) -> scalar
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = adamw
    steps: int = 10


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread: tiny ops on a shared 2-core box are 100x slower with more (spin-waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=64)
def reference_run(recipe: Recipe, world: int, accum: int, clip: float | None = None,
                  zero_fill: bool = True) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch on the whole global batch. Returns (loss per step, final state_dict, grad norm per step).

    The grad norm is what torch.nn.utils.clip_grad_norm_ returns (tied parameters counted once, since
    model.parameters() lists them once); with clip=None it is measured with an infinite max norm.
    """
    with single_thread():
        model = recipe.build()
        opt = recipe.optimizer(model)
        losses, norms = [], []
        data = recipe.data(recipe.steps, world, accum)
        for step in range(recipe.steps):
            micro = [data[step, j, r] for j in range(accum) for r in range(world)]
            total = sum(recipe.loss(model, m, step) for m in micro) / len(micro)
            total.backward()
            if zero_fill:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
            params = [p for p in model.parameters() if p.grad is not None]
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip or float("inf")).item())
            opt.step()
            opt.zero_grad()
            losses.append(total.item())
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, norms


def engine_run(rank: int, world: int, recipe: Recipe, zero: dict, precision: str = "fp32", accum: int = 1,
               clip: float | None = None, setup: Callable | None = None,
               inspect: Callable | None = None, device: str = "cpu") -> dict[str, Any]:
    """Train `recipe` on the engine (call on every rank). Returns losses (global mean per step), the
    consolidated params (`state_dict_full`), the step() stats per optimizer step, and inspect's results.

    `setup(engine)` runs once after initialize (to attach probes); `inspect(engine, step)` runs after
    each optimizer step (for invariants the caller checks on the returned values). `device="cuda"`
    trains on this rank's GPU (the process group must then be NCCL); the data is built on the CPU and
    moved, so it is the same as the reference's.
    """
    import zerogpt

    torch.set_num_threads(1)
    model = recipe.build()
    cfg = zerogpt.Config(dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=accum, clip_grad_norm=clip))
    ctx = cpu_ctx(rank, world)
    if device == "cuda":
        ctx.device = torch.device("cuda", torch.cuda.current_device())
    engine = zerogpt.initialize(model, recipe.optimizer(model), config=cfg, ctx=ctx)
    if setup is not None:
        setup(engine)
    data = recipe.data(recipe.steps, world, accum)
    losses, stats, seen = [], [], []
    for step in range(recipe.steps):
        step_loss = torch.zeros((), device=ctx.device)
        for j in range(accum):
            loss = recipe.loss(engine, data[step, j, rank].to(ctx.device), step)
            engine.backward(loss)
            out = step_stats(engine, engine.step())
            engine.zero_grad()
            step_loss += loss.detach().float() / accum
            if out:
                stats.append(out)
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        if inspect is not None:
            seen.append(inspect(engine, step))
    params = engine.state_dict_full()
    engine.close()
    return {"losses": losses, "params": params, "stats": stats, "inspect": seen}


def run_under(engine: Any, method: str, mode: Any) -> None:
    """engine.<method> made to run inside `mode` (a TorchDispatchMode that counts what it sees): an engine_run setup
    hook, whose inspect hook reads the mode's counts."""
    original = getattr(engine, method)

    def wrapped(*args, **kwargs):
        with mode:
            return original(*args, **kwargs)

    setattr(engine, method, wrapped)


def assert_params_close(params: dict, ref_params: dict, rtol: float, bound: float, what: str) -> None:
    """Whole-model relative L2 error <= rtol, and every element within `bound` (absolute).

    Compared over the parameters of `params` (state_dict_full lists a tied parameter once); buffers
    in the reference's state_dict that are not model parameters are skipped.
    """
    names = [n for n in params if n in ref_params and params[n].is_floating_point()]
    assert names, f"{what}: no common parameters between the engine and the reference"
    diff = torch.cat([(params[n].float() - ref_params[n].float()).reshape(-1) for n in names])
    ref = torch.cat([ref_params[n].float().reshape(-1) for n in names])
    err = (diff.norm() / ref.norm()).item()
    assert err <= rtol, f"{what}: relative parameter error {err:.2e} > {rtol:.0e}"
    worst = max(names, key=lambda n: (params[n].float() - ref_params[n].float()).abs().max().item())
    assert diff.abs().max() <= bound, f"{what}: {worst} differs by {diff.abs().max():.2e} > {bound}"


def assert_run_matches(run: dict, ref: tuple, *, precision: str, what: str, check_norms: bool = True) -> None:
    """Losses per step, final params and (optionally) grad norms per step against a reference run."""
    ref_losses, ref_params, ref_norms = ref
    tol = 1e-5 if precision == "fp32" else 3e-2
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: losses: {m}")
    assert_params_close(run["params"], ref_params, tol if precision == "fp32" else 3e-2,
                        1e-4 if precision == "fp32" else 0.1, what)
    if check_norms:
        norms = [s["grad_norm"] for s in run["stats"]]
        norm_tol = 1e-5 if precision == "fp32" else 5e-2
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=norm_tol, atol=1e-6,
                                   msg=lambda m: f"{what}: grad_norm vs clip_grad_norm_: {m}")
