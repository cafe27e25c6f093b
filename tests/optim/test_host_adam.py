"""zerogpt's fused host Adam op (zerogpt/optim/host_adam.py): torch's Adam/AdamW math in one pass, the compute copy
written in the same pass, bf16 moments rounded stochastically (unbiased, deterministic per seed), and CPUAdam
routing through it.

The first test JIT-builds the op (about 20 s, cached in ~/.cache/torch_extensions), hence the module timeout.
"""
import pytest
import torch

from zerogpt.optim import CPUAdam
from zerogpt.optim.host_adam import host_adam_step

pytestmark = pytest.mark.timeout(600)

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("adamw, weight_decay, grad_dtype",
                         [(True, 0.1, torch.float32), (False, 0.1, torch.float32), (True, 0.0, torch.bfloat16)])
def test_matches_torch_fused_adam_and_writes_the_compute_copy(adamw, weight_decay, grad_dtype):
    g = torch.Generator().manual_seed(0)
    n = 70_001  # several parallel tasks and a scalar tail
    master = torch.randn(n, generator=g)
    ref = master.clone().requires_grad_()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls([ref], weight_decay=weight_decay, fused=True, **HYPER)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        ref.grad = grad.float() * 0.5
        ref_opt.step()
        host_adam_step(master, grad, m, v, step=step, weight_decay=weight_decay, adamw=adamw, grad_scale=0.5,
                       out=out, **HYPER)
    assert rel(master, ref.detach()) < 1e-6
    assert rel(m, ref_opt.state[ref]["exp_avg"]) < 1e-6
    assert torch.equal(out, master.to(torch.bfloat16))  # round to nearest even, as torch casts


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0, 3])
def test_the_streamed_compute_copy_equals_a_cast_at_any_alignment(out_dtype, offset):
    """The copy is written in whole cache lines with streaming stores, plainly before the first aligned line and
    after the last whole block: an offset view and a length that is no multiple of a block take every path."""
    g = torch.Generator().manual_seed(1)
    n = 3 * 65_536 + 1_001
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    buffer = torch.full((n + offset + 5,), float("nan"), dtype=out_dtype)
    out = buffer[offset:offset + n]
    host_adam_step(master, grad, torch.zeros(n), torch.zeros(n), step=1, weight_decay=0.1, adamw=True, out=out,
                   **HYPER)
    assert torch.equal(out, master.to(out_dtype))
    assert buffer[:offset].isnan().all() and buffer[offset + n:].isnan().all()  # nothing written outside


@pytest.mark.parametrize("adamw", [True, False])
def test_decay_ranges_in_one_call_decay_only_those_elements(adamw):
    """The engine steps a chunk shard of many params in one call; only its weights' ranges decay. The reference
    is torch's optimizer with the ranges as separate params in a decayed and an undecayed group."""
    g = torch.Generator().manual_seed(2)
    n, ranges = 200_000, [(0, 70_000), (70_768, 150_000), (150_000, 190_000)]  # adjacent ranges, as slots are
    master = torch.randn(n, generator=g)
    cuts = sorted({0, n, *(i for r in ranges for i in r)})
    refs = [master[a:b].clone().requires_grad_() for a, b in zip(cuts, cuts[1:])]
    decays = [any(a <= lo and hi <= b for a, b in ranges) for lo, hi in zip(cuts, cuts[1:])]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls([dict(params=[r for r, d in zip(refs, decays) if d], weight_decay=0.1),
                   dict(params=[r for r, d in zip(refs, decays) if not d], weight_decay=0.0)], fused=True, **HYPER)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 4):
        grad = torch.randn(n, generator=g)
        for r, (a, b) in zip(refs, zip(cuts, cuts[1:])):
            r.grad = grad[a:b].clone()
        ref_opt.step()
        host_adam_step(master, grad, m, v, step=step, weight_decay=0.1, adamw=adamw, out=out, decay_ranges=ranges,
                       **HYPER)
    assert rel(master, torch.cat([r.detach() for r in refs])) < 1e-6
    assert torch.equal(out, master.to(torch.bfloat16))


def test_bf16_moments_are_rounded_without_bias():
    """v's per-step change (1 - beta2 = 0.001 of it) is below bf16's half ulp: round-to-nearest would keep v
    where it is forever. Stochastic rounding decays it as fp32 does, on average."""
    n = 200_000
    master = torch.zeros(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.full((n,), 1.0, dtype=torch.bfloat16)
    zero_grad = torch.zeros(n)
    for step in range(1, 101):
        host_adam_step(master, zero_grad, m, v, step=step, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, adamw=True, seed=3)
    expected = 0.999 ** 100
    assert abs(v.float().mean().item() - expected) < 2e-3, v.float().mean()
    assert v.float().std().item() > 0  # it is noise, not round-to-nearest landing elsewhere


def test_stochastic_rounding_is_a_function_of_the_seed():
    def run(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        master, grad = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
        m, v = torch.zeros(5000, dtype=torch.bfloat16), torch.zeros(5000, dtype=torch.bfloat16)
        for step in range(1, 4):
            host_adam_step(master, grad, m, v, step=step, weight_decay=0.0, adamw=True, seed=seed, **HYPER)
        return torch.cat([master, m.float(), v.float()])

    assert torch.equal(run(1), run(1))  # a resumed run repeats the step bit for bit
    assert not torch.equal(run(1), run(2))


def test_cpu_adam_steps_bf16_moments_and_skips_on_found_inf():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(1000, generator=g)
    opt = CPUAdam([p], weight_decay=0.1, **HYPER)
    opt.state[p]["exp_avg"] = torch.zeros(1000, dtype=torch.bfloat16)  # as the engine pre-allocates them
    opt.state[p]["exp_avg_sq"] = torch.zeros(1000, dtype=torch.bfloat16)
    ref = p.clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], weight_decay=0.1, **HYPER)
    for _ in range(3):
        grad = torch.randn(1000, generator=g)
        p.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert rel(p, ref.detach()) < 1e-3  # bf16 moments: close, not equal
    before = [p.clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["step"].clone()]
    p.grad = torch.full_like(p, float("nan"))
    opt.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, [p, opt.state[p]["exp_avg"], opt.state[p]["step"]]))


def test_cpu_adam_copy_to_and_grad_scale_match_a_separate_pass():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(3000, generator=g), None
    q = p.clone()
    fused, plain = CPUAdam([p], weight_decay=0.1, **HYPER), CPUAdam([q], weight_decay=0.1, backend="torch", **HYPER)
    out = torch.empty(3000, dtype=torch.bfloat16)
    for _ in range(3):
        grad = torch.randn(3000, generator=g)
        p.grad, q.grad = grad.clone(), grad * 0.25
        fused.step(grad_scale=0.25, copy_to={p: out})
        plain.step()
    assert rel(p, q) < 1e-6
    assert torch.equal(out, p.to(torch.bfloat16))


def test_wrong_inputs_are_named():
    master, grad = torch.zeros(10), torch.zeros(9)
    with pytest.raises(RuntimeError, match="grad has 9 elements"):
        host_adam_step(master, grad, torch.zeros(10), torch.zeros(10), step=1, weight_decay=0.0, adamw=True,
                       **HYPER)
    with pytest.raises(RuntimeError, match="exp_avg_sq has dtype"):
        host_adam_step(master, torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), step=1,
                       weight_decay=0.0, adamw=True, **HYPER)
    with pytest.raises(RuntimeError, match=r"decay range \(6, 4\) is not sorted"):
        host_adam_step(master, torch.zeros(10), torch.zeros(10), torch.zeros(10), step=1, weight_decay=0.1,
                       adamw=True, decay_ranges=[(0, 2), (6, 4)], **HYPER)



def test_a_skipped_step_still_fills_copy_to():
    p = torch.randn(100)
    p.grad = torch.full_like(p, float("nan"))
    out = torch.zeros(100, dtype=torch.bfloat16)
    CPUAdam([p], **HYPER).step(found_inf=torch.tensor(1.0), copy_to={p: out})
    assert torch.equal(out, p.to(torch.bfloat16))


def test_a_named_kernel_is_kept_for_fp32_moments():
    """backend='torch' (or 'deepspeed', or $ZEROGPT_CPU_ADAM) steps with that kernel and copies in a second pass;
    'auto' fuses the copy. Both give the same numbers to float rounding."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(500, generator=g)
    q = p.clone()
    auto, named = CPUAdam([p], **HYPER), CPUAdam([q], backend="torch", **HYPER)
    assert auto.fuses_copies and not named.fuses_copies
    out_p, out_q = torch.empty(500, dtype=torch.bfloat16), torch.empty(500, dtype=torch.bfloat16)
    p.grad = q.grad = torch.randn(500, generator=g)
    auto.step(copy_to={p: out_p})
    named.step(copy_to={q: out_q})
    assert rel(p, q) < 1e-6 and torch.equal(out_q, q.to(torch.bfloat16))
