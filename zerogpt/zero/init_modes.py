"""The two modes a ZeroInitContext runs user code under.

`_CpuFacade` (a TorchFunctionMode) makes every tensor factory build meta tensors and shows them to Python as CPU
tensors, so init code written for the CPU runs unchanged. `_Recorder` (a TorchDispatchMode) writes each op on a
meta storage into the `_Recording`, runs random ops once on a scratch CPU tensor (the RNG stream advances
exactly as in plain construction) and answers value reads by replaying the inputs.

These rest on private torch APIs, listed with every other one zerogpt uses in zerogpt/private_torch.py;
tests/test_private_torch.py checks each one exists, so a torch upgrade that removes one fails there by name
instead of somewhere inside a model's init.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from zerogpt.zero.init_record import _META, _Op, _Real, _Recording, _Root, _geometry, _key

aten = torch.ops.aten
# Ops that change which storage a tensor uses: a storage-level recipe cannot express them.
_UNSUPPORTED = {aten.set_, aten.resize_, aten.resize_as_}
# Ops that read values out (x.item(), bool(x), x.tolist(), torch.equal): answered from a replay of the inputs.
_VALUE_READS = {aten._local_scalar_dense, aten.equal}


def _is_meta(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.is_meta


def _mutated(func: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an op writes into, from its schema (`Tensor(a!)`)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return out


def _device_type(a: Any) -> str | None:
    return a.type if isinstance(a, torch.device) else None  # the dispatcher passes devices as torch.device


def _generator(args: tuple, kwargs: dict) -> torch.Generator:
    gen = kwargs.get("generator") or next((a for a in args if isinstance(a, torch.Generator)), None)
    return gen if gen is not None else torch.default_generator


# Every tensor factory builds meta tensors inside the context. Data constructors copy their (in-memory) data to
# meta through a recorded op, since building them on meta directly would drop the data unrecorded.
_FACTORIES = {torch.empty, torch.empty_strided, torch.empty_permuted, torch.zeros, torch.ones, torch.full,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.arange, torch.linspace, torch.logspace,
              torch.range, torch.eye, torch.tril_indices, torch.triu_indices, torch.bartlett_window,
              torch.blackman_window, torch.hamming_window, torch.hann_window, torch.kaiser_window,
              torch.scalar_tensor}
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_IS_META, _IS_CPU = torch.Tensor.is_meta.__get__, torch.Tensor.is_cpu.__get__
_DEVICE, _GET_DEVICE = torch.Tensor.device.__get__, torch.Tensor.get_device


def _device_error(device: Any) -> RuntimeError:
    return RuntimeError(f"ZeroInitContext builds on the CPU (the values are replayed there, with the CPU generator), "
                        f"got device={str(device)!r}; drop the device argument - zerogpt.initialize moves each "
                        f"rank's shards to ctx.device")


# Tensor.to's three forms, as Python signatures: binding the caller's arguments to one gives Python's own errors.
def _to_device(device=None, dtype=None, non_blocking=False, copy=False, *, memory_format=None):
    return (None if device is None else torch.device(device)), dtype, non_blocking, copy, memory_format


def _to_dtype(dtype, non_blocking=False, copy=False, *, memory_format=None):
    return None, dtype, non_blocking, copy, memory_format


def _to_tensor(tensor, non_blocking=False, copy=False, *, memory_format=None):
    return tensor.device, tensor.dtype, non_blocking, copy, memory_format


def _parse_to(*args: Any, **kwargs: Any) -> tuple[torch.device | None, torch.dtype | None, bool, bool,
                                                   torch.memory_format | None]:
    """(device, dtype, non_blocking, copy, memory_format) of a `Tensor.to(*args, **kwargs)` call; None where
    not given. `to(tensor)` takes the tensor's device and dtype; the first positional argument (or `tensor=`)
    picks the form, as torch's own parser does."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) or "tensor" in kwargs:
        form = _to_tensor
    elif isinstance(first, torch.dtype):
        form = _to_dtype
    else:
        form = _to_device
    parsed = form(*args, **kwargs)
    # (a dtype goes into the facade's own .to call positionally, where a device would also be taken; the other
    # values go in by keyword, and that call checks them)
    if parsed[1] is not None and not isinstance(parsed[1], torch.dtype):
        raise TypeError(f"to() got {parsed[1]!r} where it takes a dtype; pass a torch.dtype, e.g. torch.float16")
    return parsed


class _CpuFacade(TorchFunctionMode):
    """Sends tensor factories to meta and shows meta tensors to Python code as CPU tensors.

    Why the facade: torch.nn.init's trunc_normal_, orthogonal_, sparse_ and dirac_ return early on `is_meta`
    tensors, and Hugging Face skips weight init when the current device is meta; both would silently leave the
    replayed weights uninitialised. Underneath, the dispatcher still sees meta tensors, so nothing is allocated.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES or func in _DATA_CONSTRUCTORS:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type not in ("cpu", "meta"):
                raise _device_error(device)
            if func in _FACTORIES:
                return func(*args, **{**kwargs, "device": torch.device("meta")})
            requires_grad = kwargs.pop("requires_grad", False)
            data = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return data.to("meta").requires_grad_(requires_grad)
        this = args[0] if args else None
        if not _is_meta(this):  # (this handler runs with the facade off, so is_meta tells the truth here)
            return func(*args, **kwargs)
        # (bound getters compare equal, never identical: `==`, not `is`)
        if func == _IS_META:
            return False
        if func == _IS_CPU:
            return True
        if func == _DEVICE:
            return torch.device("cpu")
        if func == _GET_DEVICE:
            return -1
        if func is torch.Tensor.cpu:
            return this
        if func is torch.Tensor.to:  # to("cpu") is a no-op on a CPU tensor: keep the alias, apply only a dtype
            device, dtype, non_blocking, copy, memory_format = _parse_to(*args[1:], **kwargs)
            if device is not None and device.type not in ("cpu", "meta"):
                raise _device_error(device)
            return this.to(dtype or this.dtype, non_blocking=non_blocking, copy=copy,
                           memory_format=memory_format or torch.preserve_format)
        if func is torch.Tensor.cuda:
            raise _device_error("cuda")
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """Records ops that touch meta tensors; real-tensor ops run untouched, exactly as in plain construction."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        meta_in = [a for a in leaves if _is_meta(a)]
        creates_meta = any(isinstance(a, torch.device) and a.type == "meta" for a in leaves)
        if not meta_in and not creates_meta:
            return func(*args, **kwargs)
        rec = self.recording
        names = ", ".join(dict.fromkeys(rec.label(t) for t in meta_in)) or "a new tensor"
        unknown = [t for t in meta_in if _key(t) not in rec.roots]
        if unknown:
            raise RuntimeError(f"ZeroInitContext: {func} got a meta tensor of shape {tuple(unknown[0].shape)} that "
                               f"was not created inside the context, so its values cannot be replayed; create it "
                               f"inside the `with` block")
        if func.overloadpacket in _UNSUPPORTED:
            raise RuntimeError(f"ZeroInitContext cannot record {func} on {names}: it swaps or resizes a tensor's "
                               f"storage; do this after zerogpt.initialize, or build this part outside the context")
        if func.overloadpacket in _VALUE_READS or (func is aten._to_copy.default and meta_in
                                                   and _device_type(kwargs.get("device")) == "cpu"):
            return self._read_values(func, args, kwargs)
        # A CPU device in an op on meta inputs (empty_like(x, device="cpu"), ...) means meta inside the context.
        kwargs = {k: torch.device("meta") if _device_type(v) == "cpu" else v for k, v in kwargs.items()}
        mutated = [] if torch.Tag.inplace_view in func.tags else _mutated(func, args, kwargs)
        if any(not _is_meta(t) for t in mutated):
            raise RuntimeError(f"ZeroInitContext cannot record {func} on {names}: it writes into a tensor created "
                               f"before the context; create it inside the context or after zerogpt.initialize")
        is_random = torch.Tag.nondeterministic_seeded in func.tags
        gen = _generator(args, kwargs) if is_random else None
        rng = (gen, gen.get_state()) if gen is not None else None
        encoded = tree_map(self._encode, (args, kwargs))  # versions before this op
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            raise RuntimeError(f"ZeroInitContext cannot record {func} on {names}: it has no shape-only (meta) "
                               f"form ({type(e).__name__}: {e}); do this after zerogpt.initialize, or build this "
                               f"part outside the context") from e
        if gen is not None:
            self._advance(func, args, kwargs, {_key(t) for t in mutated})
        for key in dict.fromkeys(_key(t) for t in mutated):
            rec.roots[key].log.append(_Op(func, encoded, rng))
        for i, t in enumerate(tree_flatten(out)[0]):
            if _is_meta(t) and _key(t) not in rec.roots:  # a new storage: this op is its first
                parents = tuple(dict.fromkeys(_key(m) for m in meta_in))
                rec.roots[_key(t)] = _Root(t.untyped_storage(), [_Op(func, encoded, rng, i, _geometry(t))], parents)
        return out

    def _read_values(self, func, args: tuple, kwargs: dict) -> Any:
        """Answer a value read from real inputs, replayed one tensor at a time (the RNG is left as it was)."""
        rec, memo = self.recording, {}

        def real(a: Any) -> Any:
            return rec.value(rec.ref(a), memo) if _is_meta(a) else a

        with rec.rng_preserved():
            return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _encode(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return self.recording.ref(a) if a.is_meta else _Real(a, a._version)
        if isinstance(a, torch.device) and a.type == "meta":
            return _META
        return a

    def _advance(self, func, args: tuple, kwargs: dict, mutated: set[int]) -> None:
        """Run a random op once on CPU inputs of the same geometry, so the generator moves exactly as it would
        in plain construction. What it writes is never read, so a written tensor is just empty scratch."""
        rec = self.recording

        def scratch(a: Any) -> Any:
            if _is_meta(a):
                if _key(a) in mutated:
                    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
                with rec.rng_preserved():  # a read input (e.g. bernoulli_'s p): its real value, for exact checks
                    return rec.value(rec.ref(a))
            return torch.device("cpu") if isinstance(a, torch.device) and a.type == "meta" else a

        func(*tree_map(scratch, args), **tree_map(scratch, kwargs))
