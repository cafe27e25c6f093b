"""Fused Adam(W) for fp32 master parameters on the host (CPUAdam) and on any device (HybridAdam).

Owns the kernel choice -- DeepSpeed's vectorised `cpu_adam` op (JIT-built once with ninja, cached in
~/.cache/torch_extensions: at install, else at first use, which says so) or torch's fused Adam as fallback -- and
the per-param state ("step", "exp_avg", "exp_avg_sq"). It does not own where that state lives: the engine may
pre-allocate the state tensors (pinned, or memory-mapped for disk offload) and the step updates them in place.
"""
from __future__ import annotations

import itertools
import logging
import os
import warnings
from typing import Any, Callable, Iterable

import torch

from zerogpt.optim.host_adam import HOST_ADAM_DTYPES, host_adam_step, load_host_adam
from zerogpt.optim.op_build import DEEPSPEED_ADAM, announced_build

__all__ = ["CPUAdam", "HybridAdam", "cpu_adam_backend"]

_log = logging.getLogger("zerogpt.optim")

ENV_VAR = "ZEROGPT_CPU_ADAM"
_BACKEND_CHOICES = ("auto", "deepspeed", "torch")
BACKEND_DEEPSPEED = "deepspeed"
BACKEND_TORCH = "torch-fused"

# The compiled op is a process-wide resource (like any loaded extension), so it is cached here:
# None = not tried yet; otherwise (module or None, error message or None).
_ds_op_cache: tuple[Any, str | None] | None = None
_announced: set[str] = set()
_optimizer_ids = itertools.count()


def _load_deepspeed_op() -> tuple[Any, str | None]:
    """Build/load DeepSpeed's cpu_adam op once per process; returns (op or None, failure reason)."""
    global _ds_op_cache
    if _ds_op_cache is None:
        try:
            builder = _deepspeed_builder()
            if _prebuilt(builder):  # installed with DS_BUILD_CPU_ADAM=1: imported, nothing to build
                _ds_op_cache = (builder.load(verbose=False), None)
            else:
                sources = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.sources()]
                with announced_build(DEEPSPEED_ADAM, builder.name, sources):
                    _ds_op_cache = (builder.load(verbose=False), None)
        except Exception as e:  # ImportError, compiler missing, ninja missing, ...
            _ds_op_cache = (None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _ds_op_cache


def deepspeed_op_error() -> str | None:
    """Why DeepSpeed's cpu_adam op cannot be loaded here (None: it loads; built now if it was not yet)."""
    return _load_deepspeed_op()[1]


def _deepspeed_builder() -> Any:
    """DeepSpeed's CPUAdamBuilder, imported telling DeepSpeed the accelerator where this process has no CUDA.

    DeepSpeed's import picks an accelerator, and where it finds none it warns "Setting accelerator to CPU. If you
    have GPU or other accelerator, we were unable to detect it." on every rank: its DS_ACCELERATOR override says
    the same without the warning. Set only around the import, and only where the user set none.
    """
    import torch

    override = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    if override:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder  # heavy, optional
    finally:
        if override:
            del os.environ["DS_ACCELERATOR"]
    return CPUAdamBuilder()


def _prebuilt(builder: Any) -> bool:
    """Whether DeepSpeed was installed with this op compiled in (its load then imports it, no JIT build)."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(builder.name, False))


def _resolve_backend(prefer: str | None) -> str:
    """Pick the CPU kernel: explicit `prefer`, else $ZEROGPT_CPU_ADAM, else auto (DeepSpeed if it builds)."""
    source = "backend argument"
    if prefer is None:
        prefer, source = os.environ.get(ENV_VAR, "auto") or "auto", f"${ENV_VAR}"
    prefer = prefer.lower()
    if prefer in ("torch-fused", "fused"):
        prefer = "torch"
    if prefer not in _BACKEND_CHOICES:
        raise ValueError(f"{source}={prefer!r} is not a CPU Adam backend; valid: {', '.join(_BACKEND_CHOICES)} "
                         f"(e.g. {ENV_VAR}=torch to force torch's fused Adam)")
    if prefer == "torch":
        _announce(BACKEND_TORCH, f"zerogpt CPU Adam: using torch fused Adam (requested by {source})")
        return BACKEND_TORCH
    op, err = _load_deepspeed_op()
    if op is not None:
        _announce(BACKEND_DEEPSPEED, "zerogpt CPU Adam: using DeepSpeed's cpu_adam op")
        return BACKEND_DEEPSPEED
    if prefer == "deepspeed":
        raise RuntimeError(f"{source} asks for the DeepSpeed CPU Adam op but it failed to build/load ({err}); "
                           f"install deepspeed + ninja and a C++ compiler, or set {ENV_VAR}=torch")
    if "fallback" not in _announced:  # warn once per process, training goes on with the fallback
        _announced.add("fallback")
        warnings.warn(f"zerogpt CPU Adam: DeepSpeed cpu_adam op unavailable ({err}); falling back to torch's "
                      f"fused Adam on CPU (same math, usually slower). Set {ENV_VAR}=torch to silence this.",
                      RuntimeWarning, stacklevel=3)
    return BACKEND_TORCH


def _takes_fused_step(p: torch.Tensor, state: dict, copy_to: dict[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether a host param steps through zerogpt's fused op: its moments are bf16 (only that op takes them), or
    its new value must also be written into a compute copy of a dtype the op writes (fp32, bf16), the op builds
    here and the kernel was left to "auto" (else the update runs as before and a second pass copies)."""
    if state["exp_avg"].dtype == torch.bfloat16:
        return True
    out = (copy_to or {}).get(p)
    if out is None or out.dtype not in HOST_ADAM_DTYPES or out.device.type != "cpu" or not out.is_contiguous():
        return False
    return p.grad.dtype in HOST_ADAM_DTYPES and p.is_contiguous() and p.grad.is_contiguous() \
        and load_host_adam()[0] is not None


def decay_slices(param: torch.Tensor, grad: torch.Tensor, ranges: list[tuple[int, int]], *, lr: float,
                 weight_decay: float, decoupled: bool, found_inf: torch.Tensor | None = None) -> None:
    """Weight decay of the given ranges of a flat param, as a pass before an update that runs without decay.

    Decoupled (AdamW): param *= 1 - lr * wd, left alone when `found_inf` is set (a tensor op, no branch on it:
    the update skips on the flag, so must this). L2 (Adam): grad += wd * param.
    """
    if not weight_decay or not ranges:
        return
    param, grad = param.view(-1), grad.view(-1)
    if decoupled:
        keep = 1.0 - lr * weight_decay
        if found_inf is not None:
            keep = torch.where(found_inf.to(param.device) > 0, 1.0, keep)
        torch._foreach_mul_([param[a:b] for a, b in ranges], keep)
    else:
        torch._foreach_add_([grad[a:b] for a, b in ranges], [param[a:b] for a, b in ranges], alpha=weight_decay)


def _announce(key: str, msg: str) -> None:
    if key not in _announced:
        _announced.add(key)
        _log.info(msg)


def cpu_adam_backend(prefer: str | None = None) -> str:
    """Which kernel CPUAdam uses for host-resident params: "deepspeed" or "torch-fused".

    Builds the DeepSpeed op on first call (about a minute, then cached on disk).
    Args: prefer: "auto" | "deepspeed" | "torch"; None reads $ZEROGPT_CPU_ADAM (default auto).
    Example: >>> zerogpt.optim.cpu_adam_backend() in ("deepspeed", "torch-fused")  # True
    """
    return _resolve_backend(prefer)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over fp32 params on the CPU with a fused vectorised kernel.

    Same math as torch.optim.AdamW (adamw_mode=True, decoupled weight decay) or torch.optim.Adam
    (adamw_mode=False, L2 added to the gradient). Grads may be fp32, bf16 or fp16 (set
    `p.grad_dtype = None` to attach a low-precision grad to an fp32 master); they are read as fp32.
    State tensors already present in `self.state[p]` (e.g. memory-mapped by the engine for disk offload)
    are updated in place and never reallocated, by `step` and by `load_state_dict` alike.

    A param group may name `decay_ranges`: the sorted (start, end) ranges of each flattened param that take
    weight_decay, the rest none (the engine's chunk shards mix weights with biases and norms). The fused op
    takes the decay into its one pass, one call per param (the ranges go into the op); the other kernels get a
    decay pass first.

    Args:
        params: iterable of tensors or param-group dicts (fp32, on CPU; HybridAdam also takes CUDA).
        lr, betas, eps, weight_decay: as torch.optim.AdamW.
        bias_correction: divide by (1 - beta^t) as in the Adam paper (torch always does).
        adamw_mode: True = AdamW (decoupled decay), False = Adam (L2 penalty).
        amsgrad: must be False (not supported by the fused kernels).
        backend: "auto" | "deepspeed" | "torch"; None reads $ZEROGPT_CPU_ADAM.

    Example:
        >>> model = torch.nn.Linear(4, 4); opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(2, 4)).sum().backward(); opt.step()
    """

    _allow_device_params = False  # HybridAdam flips this

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, amsgrad: bool = False,
                 backend: str | None = None) -> None:
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"{name}(amsgrad=True) is not supported: the fused CPU kernels implement plain "
                             f"Adam/AdamW; use torch.optim.AdamW(amsgrad=True) or pass amsgrad=False")
        if not 0.0 <= lr:
            raise ValueError(f"{name}: invalid lr={lr}; must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"{name}: invalid eps={eps}; must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{name}: invalid betas={betas}; each must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{name}: invalid weight_decay={weight_decay}; must be >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, adamw_mode=adamw_mode, amsgrad=False)
        super().__init__(params, defaults)
        self.backend = _resolve_backend(backend)
        # "auto" lets a step that also writes a compute copy use zerogpt's fused op; a named kernel is kept
        self.fuses_copies = (backend or os.environ.get(ENV_VAR, "auto") or "auto").lower() == "auto"
        self._ds_ids: dict[bool, int] = {}  # adamw_mode -> id of the op-side optimizer object

    # -- torch.optim.Optimizer plumbing -------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        name = type(self).__name__
        if param_group.get("amsgrad", False):
            raise ValueError(f"{name}: param group with amsgrad=True is not supported; set amsgrad=False")
        for p in (param_group["params"] if not isinstance(param_group["params"], torch.Tensor)
                  else [param_group["params"]]):
            if p.dtype != torch.float32:
                raise TypeError(f"{name} steps fp32 master params; got a {p.dtype} param of shape "
                                f"{tuple(p.shape)}. Keep fp32 masters (the engine does) or use torch.optim.AdamW")
            if p.device.type != "cpu" and not self._allow_device_params:
                raise ValueError(f"{name} needs params on the CPU; got one on {p.device} with shape "
                                 f"{tuple(p.shape)}. Use zerogpt.optim.HybridAdam for device-resident params")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_ds_ids", {})
        self.__dict__.setdefault("backend", _resolve_backend(None))
        self.__dict__.setdefault("fuses_copies", True)

    def __del__(self) -> None:
        # The op keeps one C++ object per id in a global map; free ours (pytest runs many optimizers).
        op = _ds_op_cache[0] if _ds_op_cache else None
        for opt_id in getattr(self, "_ds_ids", {}).values():
            try:
                op.destroy_adam(opt_id)
            except Exception:
                pass

    def load_state_dict(self, state_dict: dict) -> None:
        """Standard torch loading, but copies into state tensors that already exist (in place)."""
        keep = {p: {k: self.state[p][k] for k in ("exp_avg", "exp_avg_sq") if k in self.state.get(p, {})}
                for g in self.param_groups for p in g["params"] if p in self.state}
        super().load_state_dict(state_dict)
        for p, old in keep.items():
            for k, buf in old.items():
                new = self.state[p].get(k)
                if new is not None and new is not buf and new.shape == buf.shape:
                    buf.copy_(new)
                    self.state[p][k] = buf

    # -- the step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             params: Iterable[torch.Tensor] | None = None, found_inf: torch.Tensor | None = None,
             grad_scale: float = 1.0, copy_to: dict[torch.Tensor, torch.Tensor] | None = None,
             unscale: torch.Tensor | None = None) -> Any:
        """One Adam(W) update of every param with a grad (or only of `params`, a subset).

        `params` lets the engine step chunk by chunk as each chunk's grads arrive on the host,
        overlapping the CPU step with the copies of the next chunk. `found_inf` (a 0-dim tensor, 1.0 when the
        gradients are not finite) makes the step change nothing: params, moments and step count stay bit for bit
        (torch's fused kernel takes the flag on the device; DeepSpeed's host kernel reads it on the host, where
        the gradients it steps on already are). `grad_scale` multiplies each gradient as it is read (the engine's
        unscale and clip), and `copy_to[p]` receives p's new value in its own dtype (the engine's compute copy):
        on the host, zerogpt's fused op does both in the update's one pass (zerogpt/optim/host_adam.py), and it
        steps bf16 moments, which only it takes. `unscale` (a 0-dim tensor) divides each gradient too: on the
        device inside torch's fused kernel (its `grad_scale`), so the engine's clip there needs no pass of its own
        and no host read; a host param reads it once, as a float.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        only = None
        if params is not None:
            only = {id(p) for p in params}
            known = {id(p) for g in self.param_groups for p in g["params"]}  # O(params); fine per chunk
            if not only <= known:
                raise ValueError(f"{type(self).__name__}.step(params=...): {len(only - known)} tensor(s) are not "
                                 f"in this optimizer's param groups; pass the same tensors given at construction")
        host_scale = grad_scale if unscale is None else None  # with unscale: read at the first host param only
        for group in self.param_groups:
            host, dev = [], []
            for p in group["params"]:
                if p.grad is None or (only is not None and id(p) not in only):
                    continue
                if p.grad.is_sparse:
                    raise TypeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._init_state(p)
                on_host = p.device.type == "cpu"
                if on_host and host_scale is None:  # a device `unscale` read here would make the host wait for it
                    host_scale = grad_scale / float(unscale)
                if on_host and _takes_fused_step(p, state, copy_to if self.fuses_copies else None):
                    self._step_fused(group, p, state, found_inf, host_scale, (copy_to or {}).get(p))
                    continue
                grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                scale = host_scale if on_host else grad_scale
                if scale != 1.0:
                    grad = grad * scale
                (host if on_host else dev).append((p, grad, state))
            if group.get("decay_ranges") is not None and (host or dev):  # the kernels decay all or nothing
                for p, grad, _ in host + dev:
                    decay_slices(p, grad, group["decay_ranges"], lr=group["lr"], weight_decay=group["weight_decay"],
                                 decoupled=bool(group["adamw_mode"]), found_inf=found_inf)
                group = {**group, "weight_decay": 0.0}
            if host:
                if self.backend == BACKEND_DEEPSPEED:
                    if found_inf is None or not found_inf.item():
                        self._step_deepspeed(group, host)
                else:
                    self._step_torch(group, host, found_inf)
            if dev:
                self._step_torch(group, dev, found_inf, unscale)
            for p, _, _ in host + dev:
                if copy_to and p in copy_to:
                    copy_to[p].copy_(p, non_blocking=True)
        return loss

    def _init_state(self, p: torch.Tensor) -> dict:
        """Create missing state lazily; validate (never replace) state the engine pre-allocated."""
        state = self.state[p]
        step = state.get("step")
        if step is None:
            step = torch.zeros((), dtype=torch.float32)
        elif not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float32)
        # fused device kernels read the step on the param's device; the CPU path keeps it on the CPU
        state["step"] = step.to(device=p.device, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            buf = state.get(key)
            if buf is None:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            elif buf.shape != p.shape or buf.dtype not in HOST_ADAM_DTYPES or buf.device != p.device \
                    or (buf.dtype != torch.float32 and p.device.type != "cpu"):
                raise RuntimeError(f"pre-allocated state[{key!r}] must be fp32 (bf16 on the host) {tuple(p.shape)} "
                                   f"on {p.device}; got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
        return state

    def _step_fused(self, group: dict, p: torch.Tensor, state: dict, found_inf: torch.Tensor | None,
                    grad_scale: float, out: torch.Tensor | None) -> None:
        """One host param through zerogpt's fused op: scaled gradient in, Adam, master and `out` written."""
        if found_inf is not None and found_inf.item():  # the flag is on the host, beside the gradients
            if out is not None:  # skipped: `out` still receives p's (unchanged) value, as copy_to promises
                out.copy_(p)
            return
        state["step"] += 1
        # the decay folded into the update: one op call for the whole shard, its biases and norms undecayed
        host_adam_step(*(t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])),
                       step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                       weight_decay=group["weight_decay"], adamw=bool(group["adamw_mode"]),
                       bias_correction=bool(group["bias_correction"]), grad_scale=grad_scale,
                       out=None if out is None else out.view(-1), seed=group.get("rounding_seed", 0),
                       decay_ranges=group.get("decay_ranges"))

    @torch.no_grad()
    def step_into(self, p: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad_scale: float,
                  out: torch.Tensor | None) -> None:
        """p's step by zerogpt's fused op, written into `into` (master, exp_avg, exp_avg_sq of p's shapes) and
        `out`, while p, its moments and its step count stay as they are: the same bits `step()` would leave, for a
        step taken before it is known to stand (zerogpt/zero/host_step.py). `commit_into` makes it p's own."""
        group, state = self.param_groups[0], self._init_state(p)
        host_adam_step(*(t.view(-1) for t in (into[0], p.grad, into[1], into[2])),
                       step=int(state["step"].item()) + 1, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                       weight_decay=group["weight_decay"], adamw=bool(group["adamw_mode"]),
                       bias_correction=bool(group["bias_correction"]), grad_scale=grad_scale,
                       out=None if out is None else out.view(-1), seed=group.get("rounding_seed", 0),
                       decay_ranges=group.get("decay_ranges"),
                       start=(p.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)))

    @torch.no_grad()
    def commit_into(self, p: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Make a `step_into` p's step: p takes `into[0]`'s storage and its state the moments, the step counts one
        more, and `into` receives what they held (the spare set of the next speculative step). No byte is copied."""
        state = self.state[p]
        before = p.detach()  # the same storage, another tensor: p's old values, kept as the spare master
        p.set_(into[0])
        into[0].set_(before)
        for key, spare in zip(("exp_avg", "exp_avg_sq"), into[1:]):
            held = state[key].detach()
            state[key] = spare.detach()
            spare.set_(held)
        state["step"] += 1

    def _ds_id(self, op: Any, group: dict) -> int:
        adamw = bool(group["adamw_mode"])
        if adamw not in self._ds_ids:
            opt_id = next(_optimizer_ids)
            beta1, beta2 = group["betas"]
            op.create_adam(opt_id, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], adamw, False)
            self._ds_ids[adamw] = opt_id
        return self._ds_ids[adamw]

    def _step_deepspeed(self, group: dict, items: list) -> None:
        op = _load_deepspeed_op()[0]
        opt_id = self._ds_id(op, group)
        beta1, beta2 = group["betas"]
        for p, grad, state in items:
            state["step"] += 1
            tensors = [p, grad, state["exp_avg"], state["exp_avg_sq"]]
            # the op writes through data pointers of contiguous tensors; stage strided ones and copy back
            work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
            op.adam_update(opt_id, int(state["step"].item()), float(group["lr"]), beta1, beta2, group["eps"],
                           group["weight_decay"], group["bias_correction"], *work)
            for t, w in zip(tensors, work):
                if w is not t and t is not grad:
                    t.copy_(w)

    def _step_torch(self, group: dict, items: list, found_inf: torch.Tensor | None = None,
                    unscale: torch.Tensor | None = None) -> None:
        """torch's fused Adam(W) kernel over `items` ((param, grad, state)), each gradient divided by `unscale` as the
        kernel reads it (GradScaler's `grad_scale`), the step skipped where `found_inf` is set."""
        ps, gs, ms, vs, steps = ([it[0] for it in items], [it[1] for it in items],
                                 [it[2]["exp_avg"] for it in items], [it[2]["exp_avg_sq"] for it in items],
                                 [it[2]["step"] for it in items])
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            from torch.optim.adam import adam as torch_adam  # functional form of torch.optim.Adam/AdamW

            torch_adam(ps, gs, ms, vs, [], steps, fused=True, amsgrad=False, beta1=beta1,
                       beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                       maximize=False, decoupled_weight_decay=bool(group["adamw_mode"]), found_inf=found_inf,
                       grad_scale=unscale)
            return
        if found_inf is not None and found_inf.item():  # this rare mode has no kernel to hand the flag to
            return
        if unscale is not None:
            gs = torch._foreach_div(gs, unscale)
        # torch's kernels always bias-correct; this rare mode runs as plain foreach ops instead
        torch._foreach_add_(steps, 1)
        lr, wd = group["lr"], group["weight_decay"]
        if wd and group["adamw_mode"]:
            torch._foreach_mul_(ps, 1 - lr * wd)
        elif wd:
            gs = torch._foreach_add(gs, ps, alpha=wd)
        torch._foreach_lerp_(ms, gs, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
        denom = torch._foreach_add(torch._foreach_sqrt(vs), group["eps"])
        torch._foreach_addcdiv_(ps, ms, denom, value=-lr)


class HybridAdam(CPUAdam):
    """CPUAdam that also accepts device-resident params: host params go through the CPU kernel,
    CUDA params through torch's fused Adam(W) (the fastest device path), in the same step.

    Example:
        >>> opt = HybridAdam(model.parameters(), lr=1.5e-4, weight_decay=1e-2)  # params on CPU or CUDA
    """

    _allow_device_params = True
