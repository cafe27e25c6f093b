"""CPUAdam / HybridAdam: parity with torch.optim.AdamW / Adam, low-precision grads, in-place state,
the torch fallback, state_dict round trips and clear errors.

The first test that needs the DeepSpeed op JIT-builds it (about a minute, cached in
~/.cache/torch_extensions), hence the generous module-wide timeout.
"""
import copy
import warnings

import pytest
import torch

from zerogpt.optim import CPUAdam, HybridAdam, cpu_adam_backend
from zerogpt.optim import cpu_adam as cpu_adam_mod

pytestmark = pytest.mark.timeout(900)  # a cold op build took ~4 min on a loaded 2-core VM

SHAPES = [(37, 19), (1000,), (3, 5, 7), (4097,)]  # odd sizes exercise the kernels' scalar tails


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-relative difference ||a - b|| / ||b||."""
    return ((a - b).norm() / b.norm()).item()


def make_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def run_pair(opt_kwargs: dict, ref_cls, ref_kwargs: dict, grad_dtype=torch.float32, steps: int = 10,
             cls=CPUAdam):
    """Step our optimizer and a torch reference on identical params and grads; return both sides."""
    init = make_params()
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt, ref_opt = cls(ours, **opt_kwargs), ref_cls(ref, **ref_kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g).to(grad_dtype)
            p.grad_dtype = None  # let an fp32 master carry a bf16/fp16 grad, as the engine does
            p.grad = grad
            q.grad = grad.float()  # the reference sees exactly the values our kernel reads
        opt.step()
        ref_opt.step()
    return opt, ours, ref_opt, ref


@pytest.fixture(scope="module")
def default_backend() -> str:
    return cpu_adam_backend("auto")  # builds the DeepSpeed op on first use


def test_backend_is_reported(default_backend):
    assert default_backend in ("deepspeed", "torch-fused")
    assert cpu_adam_backend("torch") == "torch-fused"


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_parity_with_torch(default_backend, backend, adamw_mode, grad_dtype):
    kwargs = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt, ours, ref_opt, ref = run_pair(dict(kwargs, adamw_mode=adamw_mode, backend=backend), ref_cls, kwargs,
                                       grad_dtype)
    # DeepSpeed's kernel holds beta2 in fp32, so (1 - beta2) carries ~1e-5 relative rounding into exp_avg_sq;
    # the params it produces still match torch to < 1e-6. torch's fused kernel matches to ~1e-7 everywhere.
    v_tol = 5e-5 if opt.backend == "deepspeed" else 1e-6
    for p, q in zip(ours, ref):
        assert rel(p, q) < 1e-6
        s, t = opt.state[p], ref_opt.state[q]
        assert rel(s["exp_avg"], t["exp_avg"]) < 1e-6
        assert rel(s["exp_avg_sq"], t["exp_avg_sq"]) < v_tol
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32
        assert s["exp_avg"].shape == p.shape and int(s["step"]) == 10


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_param_groups_and_no_bias_correction(default_backend, backend):
    """Per-group lr/decay, and bias_correction=False (not in torch) against a hand-written reference."""
    init = make_params()
    ours = [p.clone().requires_grad_() for p in init]
    opt = CPUAdam([{"params": ours[:2], "lr": 1e-2}, {"params": ours[2:], "weight_decay": 0.0}],
                  lr=1e-3, weight_decay=0.05, betas=(0.9, 0.99), bias_correction=False, backend=backend)
    expect = [p.clone() for p in init]
    m = [torch.zeros_like(p) for p in init]
    v = [torch.zeros_like(p) for p in init]
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        for i, p in enumerate(ours):
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad
            lr, wd = (1e-2, 0.05) if i < 2 else (1e-3, 0.0)
            expect[i] = expect[i].double() * (1 - lr * wd)
            m[i] = 0.9 * m[i] + 0.1 * grad
            v[i] = 0.99 * v[i] + 0.01 * grad * grad
            expect[i] = (expect[i] - lr * m[i] / (v[i].sqrt() + 1e-8)).float()
        opt.step()
    for p, e in zip(ours, expect):
        assert rel(p, e) < 1e-6


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_preallocated_memmap_state_updated_in_place(default_backend, backend, tmp_path):
    """State the engine pre-allocates (here: memory-mapped files, as for disk offload) is never replaced."""
    init = make_params()
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = CPUAdam(ours, lr=1e-3, weight_decay=0.01, backend=backend)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    files = {}
    for i, p in enumerate(ours):
        for key in ("exp_avg", "exp_avg_sq"):
            path = tmp_path / f"{i}.{key}.bin"
            buf = torch.from_file(str(path), shared=True, size=p.numel(), dtype=torch.float32).view(p.shape)
            buf.zero_()
            opt.state[p][key] = buf
            files[(i, key)] = (path, buf, buf.data_ptr())
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, q in zip(ours, ref):
            q.grad = torch.randn(p.shape, generator=g)
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
    for (i, key), (path, buf, ptr) in files.items():
        assert opt.state[ours[i]][key] is buf and buf.data_ptr() == ptr
        on_disk = torch.from_file(str(path), shared=False, size=buf.numel(), dtype=torch.float32)
        assert torch.equal(on_disk.view(buf.shape), buf)
        assert rel(buf, ref_opt.state[ref[i]][key]) < 5e-5
    # loading a checkpoint copies into the same buffers as well
    sd = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(ours):
        opt.state[p]["exp_avg"].fill_(7.0)
    opt.load_state_dict(sd)
    for (i, key), (path, buf, ptr) in files.items():
        assert opt.state[ours[i]][key] is buf
        assert torch.equal(buf, sd["state"][i][key])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_state_dict_round_trip(default_backend, backend):
    """Resume from a state_dict mid-run = bit-identical to not stopping."""
    init = make_params()
    a = [p.clone().requires_grad_() for p in init]
    opt_a = CPUAdam(a, lr=1e-3, weight_decay=0.01, backend=backend)
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(6)]

    def step(params, opt, k):
        for p, gr in zip(params, grads[k]):
            p.grad = gr.clone()
        opt.step()

    for k in range(3):
        step(a, opt_a, k)
    sd = copy.deepcopy(opt_a.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = CPUAdam(b, lr=0.5, backend=backend)  # hyper-params come back from the state_dict
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 1e-3
    for k in range(3, 6):
        step(a, opt_a, k)
        step(b, opt_b, k)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert int(opt_b.state[b[0]]["step"]) == 6


def test_step_subset_of_params(default_backend):
    """step(params=...) lets the engine step chunk by chunk as grads land on the host."""
    ps = [p.requires_grad_() for p in make_params()]
    opt = CPUAdam(ps, lr=1e-2)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step(params=ps[:2])
    assert not torch.equal(ps[0], before[0]) and not torch.equal(ps[1], before[1])
    assert torch.equal(ps[2], before[2]) and ps[2] not in opt.state
    opt.step(params=ps[2:])
    assert all(int(opt.state[p]["step"]) == 1 for p in ps)
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.step(params=[torch.zeros(3)])


def test_fallback_forced_by_env(monkeypatch):
    monkeypatch.setenv("ZEROGPT_CPU_ADAM", "torch")
    assert cpu_adam_backend() == "torch-fused"
    assert CPUAdam([torch.zeros(3, requires_grad=True)]).backend == "torch-fused"
    monkeypatch.setenv("ZEROGPT_CPU_ADAM", "avx")
    with pytest.raises(ValueError, match="ZEROGPT_CPU_ADAM"):
        cpu_adam_backend()


def test_build_failure_falls_back_and_warns_once(monkeypatch):
    monkeypatch.delenv("ZEROGPT_CPU_ADAM", raising=False)
    monkeypatch.setattr(cpu_adam_mod, "_ds_op_cache", (None, "RuntimeError: simulated build failure"))
    monkeypatch.setattr(cpu_adam_mod, "_announced", set())
    with pytest.warns(RuntimeWarning, match="simulated build failure"):
        opt = CPUAdam([torch.zeros(3, requires_grad=True)])
    assert opt.backend == "torch-fused"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second one must not warn again
        p = torch.zeros(3, requires_grad=True)
        opt2 = CPUAdam([p], lr=0.1)
        p.grad = torch.ones(3)
        opt2.step()  # training goes on with the fallback
    assert torch.allclose(p, torch.full((3,), -0.1))
    with pytest.raises(RuntimeError, match="ZEROGPT_CPU_ADAM=torch"):
        CPUAdam([torch.zeros(3, requires_grad=True)], backend="deepspeed")


def test_bad_arguments():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([{"params": [p], "amsgrad": True}], backend="torch")
    with pytest.raises(TypeError, match="fp32 master"):
        CPUAdam([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], backend="torch")
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([p], betas=(0.9, 1.0), backend="torch")
    with pytest.raises(ValueError, match="lr"):
        CPUAdam([p], lr=-1.0, backend="torch")


def test_hybrid_adam_on_cpu_matches_cpu_adam(default_backend):
    _, ours, _, ref = run_pair(dict(lr=1e-3, weight_decay=0.01), torch.optim.AdamW,
                               dict(lr=1e-3, weight_decay=0.01), cls=HybridAdam)
    for p, q in zip(ours, ref):
        assert rel(p, q) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hybrid_adam_mixed_devices(default_backend):
    """CPU params through the CPU kernel, CUDA params through torch's fused kernel, in one step."""
    init = make_params()
    ours = [p.clone().to("cuda" if i % 2 else "cpu").requires_grad_() for i, p in enumerate(init)]
    ref = [p.clone().requires_grad_() for p in init]
    opt = HybridAdam(ours, lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        for p, q in zip(ours, ref):
            q.grad = torch.randn(q.shape, generator=g)
            p.grad = q.grad.to(p.device)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        assert opt.state[p]["exp_avg"].device == p.device
        assert rel(p.cpu(), q) < 1e-6
    with pytest.raises(ValueError, match="HybridAdam"):
        CPUAdam([torch.zeros(3, device="cuda", requires_grad=True)])


@pytest.mark.parametrize("backend, fused", [("auto", True), ("auto", False), ("torch", False), ("deepspeed", False)])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_decay_ranges_decay_only_those_slots_after_the_grad_scale(default_backend, backend, fused, adamw_mode):
    """`decay_ranges`: one flat param whose ranges [3, 40) and [60, 100) decay, against torch with the same
    slots as separate params in a decayed and an undecayed group. The gradient is scaled (as the engine's clip
    factor does) before the L2 term is added. `fused`: the step also writes a compute copy, which the fused op
    does in its pass (one call per run of slots); otherwise the kernel runs after a decay pass."""
    if backend == "deepspeed" and default_backend != "deepspeed":
        pytest.skip("the DeepSpeed op did not build here")
    ranges, n, scale = [(3, 40), (60, 100)], 131, 0.5
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(n, generator=g)
    cuts = [0, 3, 40, 60, 100, n]
    pieces = [flat[a:b].clone().requires_grad_() for a, b in zip(cuts, cuts[1:])]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls([{"params": pieces[1::2], "weight_decay": 0.2}, {"params": pieces[0::2], "weight_decay": 0.0}],
                  **kwargs)
    ours = flat.clone().requires_grad_()
    opt = CPUAdam([{"params": [ours], "decay_ranges": ranges}], weight_decay=0.2, adamw_mode=adamw_mode,
                  backend=backend, **kwargs)
    copy_out = torch.empty(n)
    for _ in range(4):
        grad = torch.randn(n, generator=g)
        ours.grad = grad.clone()
        for piece, a, b in zip(pieces, cuts, cuts[1:]):
            piece.grad = grad[a:b] * scale
        opt.step(grad_scale=scale, copy_to={ours: copy_out} if fused else None)
        ref.step()
    expect = torch.cat([p.detach() for p in pieces])
    assert rel(ours.detach(), expect) < 1e-6
    if fused:
        assert torch.equal(copy_out, ours.detach())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_unscale_divides_each_gradient_inside_torchs_kernel(bias_correction, device):
    """`unscale`: the device path (`_step_torch`) hands it to torch's fused kernel as its grad_scale, here that
    kernel's CPU build, the same call, and on CUDA; without bias correction the foreach ops divide first. Bit for bit
    the step on gradients divided beforehand (by 4: exact), so the engine's clip on a device master needs no pass.
    (eps 0.1: Adam is otherwise nearly blind to a gradient's scale.)"""
    init = [p.to(device) for p in make_params()]
    ours, twin = [p.clone() for p in init], [p.clone() for p in init]
    opt, ref = (HybridAdam(ps, lr=1e-2, eps=0.1, weight_decay=0.1, bias_correction=bias_correction)
                for ps in (ours, twin))
    unscale = torch.tensor(4.0, device=device)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in init]
        opt._step_torch(opt.param_groups[0], [(p, gr.clone(), opt._init_state(p)) for p, gr in zip(ours, grads)],
                        unscale=unscale)
        ref._step_torch(ref.param_groups[0], [(p, gr / 4, ref._init_state(p)) for p, gr in zip(twin, grads)])
    for p, q in zip(ours, twin):
        assert torch.equal(p, q)
