"""ZeroInitContext: build a model too big for one rank without ever materialising it whole.

Inside the context every tensor factory builds meta tensors (shapes, no storage), shown to Python code as CPU
tensors, and a dispatch mode records, per meta storage, the ops that create and fill it (empty -> uniform_ ->
normal_ -> a slice's zero_ ...) with the generator state before each random op. Each random op also runs once on a
scratch CPU tensor of the same geometry, so the RNG stream leaves the context exactly where plain construction
leaves it; value reads (x.item(), as in trunc_normal_'s rejection loop) are answered by replaying the inputs.
`initialize()` replays, one parameter at a time, only what overlaps this rank's shard of each chunk: the values are
bit-identical to plain CPU construction with the same seed, for any world size. Chunk layout is not decided here.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

from zerogpt.config import Config, EngineConfig, engine_config
from zerogpt.zero.chunk import ChunkPlan

__all__ = ["ZeroInitContext", "RecordedInit", "recorded_init", "give_storage"]

aten = torch.ops.aten
# Ops that change which storage a tensor uses: a storage-level recipe cannot express them.
_UNSUPPORTED = {aten.set_, aten.resize_, aten.resize_as_}
# Ops that read values out (x.item(), bool(x), x.tolist(), torch.equal): answered from a replay of the inputs.
_VALUE_READS = {aten._local_scalar_dense, aten.equal}


# ----------------------------------------------------------------------------------------------
# the record: per meta storage, the ops that made and changed it


def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views, detached aliases and Parameters of one storage share it)."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A recorded meta tensor used as an op argument: its storage, that storage's version then, its geometry."""

    key: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Real:
    """A real tensor used as an op argument, by reference; replay checks it was not modified since."""

    tensor: torch.Tensor
    version: int


class _MetaDevice:
    """Stands for device='meta' in a recorded op; replay runs it on the CPU."""


_META = _MetaDevice()


@dataclass
class _Op:
    func: torch._ops.OpOverload
    args: Any  # (args, kwargs) with tensors encoded as _Ref / _Real
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state just before a random op
    out_index: int | None = None  # set on a storage's first op: which flat output it is
    out_geometry: tuple | None = None  # (size, stride, offset) that output had on meta


@dataclass
class _Root:
    storage: torch.UntypedStorage  # the meta storage, held so its address is never reused for another
    log: list[_Op]
    parents: tuple[int, ...] = ()  # storages the creating op read, to describe an unregistered tensor
    label: str | None = None  # "Linear.weight (4, 3)" once registered on a module, for error messages


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _Recording:
    """Everything one ZeroInitContext recorded; replays any storage at any version on the CPU."""

    def __init__(self) -> None:
        self.roots: dict[int, _Root] = {}
        self.generators: list[torch.Generator] = []
        self.exit_versions: dict[int, int] = {}  # id(param or buffer) -> tensor._version when the context exited

    def ref(self, t: torch.Tensor) -> _Ref:
        return _Ref(_key(t), len(self.roots[_key(t)].log), *_geometry(t), t.dtype)

    def label(self, t: torch.Tensor) -> str:
        root = self.roots.get(_key(t))
        if root is not None and root.label:
            return root.label
        parents = [self.roots[k].label for k in (root.parents if root else ()) if self.roots[k].label]
        return f"a tensor of shape {tuple(t.shape)}" + (f" computed from {', '.join(parents)}" if parents else "")

    # -- replay -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rng_preserved(self) -> Iterable[None]:
        """Replay sets generators to recorded states; leave every one as the caller had it."""
        gens = [torch.default_generator, *self.generators]
        states = [g.get_state() for g in gens]
        try:
            yield
        finally:
            for g, s in zip(gens, states):
                g.set_state(s)

    def value(self, ref: _Ref, memo: dict | None = None) -> torch.Tensor:
        """The CPU value `ref` had when it was recorded (call inside `rng_preserved`)."""
        memo = {} if memo is None else memo
        storage = memo.get((ref.key, ref.version))
        if storage is None:
            storage = self._replay(ref.key, ref.version, memo)
            memo[(ref.key, ref.version)] = storage
        return _view(storage, ref)

    def _replay(self, key: int, version: int, memo: dict) -> torch.UntypedStorage:
        """Run the first `version` ops of storage `key` on the CPU; other storages are replayed as needed."""
        root = self.roots[key]
        storage: torch.UntypedStorage | None = None
        for i, op in enumerate(root.log[:version]):
            def resolve(a: Any) -> Any:
                if isinstance(a, _Ref):
                    if a.key == key:  # this storage as it is now, mutated in place by the ops so far
                        assert storage is not None and a.version == i, (root.label, a.version, i)
                        return _view(storage, a)
                    return self.value(a, memo)
                if isinstance(a, _Real):
                    if a.tensor._version != a.version:
                        raise RuntimeError(f"ZeroInitContext: a real tensor used to initialise "
                                           f"{root.label or 'a tensor'} was modified in place after it was used; "
                                           f"keep it unchanged until zerogpt.initialize (or clone it before use)")
                    return a.tensor
                return torch.device("cpu") if a is _META else a

            args, kwargs = tree_map(resolve, op.args)
            if op.rng is not None:
                op.rng[0].set_state(op.rng[1])
            out = op.func(*args, **kwargs)
            if op.out_index is not None:
                t = tree_flatten(out)[0][op.out_index]
                if _geometry(t) != op.out_geometry:
                    raise RuntimeError(f"ZeroInitContext: {op.func} gave geometry {_geometry(t)} on the CPU but "
                                       f"{op.out_geometry} on meta, so {root.label or 'its output'} cannot be "
                                       f"replayed; build this tensor outside the context")
                storage = t.untyped_storage()
        assert storage is not None, f"storage {root.label} has no creating op"
        return storage


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device="cpu").set_(storage, ref.offset, ref.size, ref.stride)


# ----------------------------------------------------------------------------------------------
# recording: a dispatch mode over everything that runs inside the context


def _is_meta(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.is_meta


def _mutated(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
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
            kw = dict(kwargs)
            copy = kw.pop("copy", False)
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
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
            if gen is not torch.default_generator and all(g is not gen for g in rec.generators):
                rec.generators.append(gen)
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


# ----------------------------------------------------------------------------------------------
# the context


def _recording_now() -> bool:
    return any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack())


# module -> what the context it was built in recorded. Keyed weakly: dropping the model drops the record.
_RECORDINGS: "weakref.WeakKeyDictionary[nn.Module, _Recording]" = weakref.WeakKeyDictionary()


class ZeroInitContext:
    """Build a model on every rank without materialising it: `initialize()` later fills only this rank's shards.

    Inside the context parameters and buffers are meta tensors (no storage) that report device cpu and
    is_meta=False, so init code written for CPU (nn.init, Hugging Face) runs unchanged; their initialisation is
    recorded and replayed by `zerogpt.initialize`, one parameter at a time, into this rank's shard of each chunk.
    The weights are bit-identical to plain construction on the CPU with the same seed, whatever the world size,
    and the global RNG is left exactly where plain construction leaves it. After the `with` block the tensors are
    plainly meta. All initialisation must happen inside the block: ops on meta tensors after it are not recorded
    (`initialize` raises if a parameter was changed in place). Data-dependent ops with no meta form (nonzero,
    masked_select, ...), other devices than the CPU and nesting raise errors naming the op and the parameter.
    The record is kept, weakly keyed by the modules built, until the model is garbage collected.

    Args:
        config: optional; a zerogpt.Config, dict or EngineConfig. Nothing in it changes how the model is built
            (the chunk layout is decided by `initialize`); it is validated here so a typo fails before a long
            construction.

    Example:
        >>> with zerogpt.ZeroInitContext(cfg):
        ...     model = gpt2_small()
        >>> engine, *_ = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg)
    """

    def __init__(self, config: Any = None) -> None:
        if config is not None and not isinstance(config, (Config, dict, EngineConfig)):
            raise TypeError(f"ZeroInitContext(config) takes a zerogpt.Config, a dict or None, "
                            f"got {type(config).__name__}")
        if config is not None and not isinstance(config, EngineConfig):
            engine_config(config if isinstance(config, Config) else Config(config),
                          dist.get_world_size() if dist.is_initialized() else 1)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "ZeroInitContext":
        if _recording_now():
            raise RuntimeError("ZeroInitContext cannot be nested; build the whole model inside one context")
        self._recording, self._modules = _Recording(), {}
        with contextlib.ExitStack() as stack:  # undoes what was entered if a later step fails
            stack.callback(register_module_parameter_registration_hook(self._on_register).remove)
            stack.callback(register_module_buffer_registration_hook(self._on_register).remove)
            stack.enter_context(_Recorder(self._recording))
            stack.enter_context(_CpuFacade())
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        stack.close()  # facade, recorder and hooks, in reverse order, even on an exception
        if exc_type is None:
            for module in self._modules.values():
                for t in [*module._parameters.values(), *module._buffers.values()]:
                    if _is_meta(t):
                        self._recording.exit_versions[id(t)] = t._version
                _RECORDINGS[module] = self._recording
        self._modules = {}
        return False

    def _on_register(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        self._modules[id(module)] = module
        with torch._C.DisableTorchFunction():  # past the facade: is it really meta?
            if _is_meta(tensor) and _key(tensor) in self._recording.roots:
                root = self._recording.roots[_key(tensor)]
                root.label = root.label or f"{type(module).__name__}.{name} {tuple(tensor.shape)}"


# ----------------------------------------------------------------------------------------------
# what initialize() uses


@dataclass
class RecordedInit:
    """The recorded initialisation of one model's meta parameters and buffers, by name.

    `chunk_shard` replays only the parameters overlapping one shard; `param_value` one whole parameter.
    Real (non-meta) tensors of the model are read as they are.
    """

    params: dict[str, tuple[_Recording, _Ref] | torch.Tensor]
    buffers: dict[str, tuple[_Recording, _Ref] | torch.Tensor] = field(default_factory=dict)

    def param_value(self, name: str) -> torch.Tensor:
        """The full value of parameter `name` (CPU, its own dtype), as plain construction would have made it."""
        return _value_of(self.params[name])

    def chunk_shard(self, plan: ChunkPlan, shard_index: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of a chunk (shard_numel, `dtype`, CPU; padding zero).

        Peak memory: the shard plus one parameter, since each overlapping parameter is replayed in turn.
        """
        lo, _ = plan.shard_range(shard_index)
        out = torch.zeros(plan.shard_numel, dtype=dtype)
        for slot in plan.slots:
            overlap = plan.slot_overlap(slot, shard_index)
            if overlap is None:
                continue
            start, end = overlap
            flat = self.param_value(slot.name).reshape(-1)
            out[start - lo : end - lo].copy_(flat[start - slot.offset : end - slot.offset])
        return out

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """Every meta buffer, materialised whole (buffers are small); a tied buffer is one tensor under each name."""
        done: dict[Any, torch.Tensor] = {}
        out = {}
        for name, source in self.buffers.items():
            key = id(source) if isinstance(source, torch.Tensor) else (id(source[0]), source[1])
            if key not in done:
                done[key] = _value_of(source).clone()
            out[name] = done[key]
        return out


def _value_of(source: tuple[_Recording, _Ref] | torch.Tensor) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source.detach()
    recording, ref = source
    with recording.rng_preserved():
        return recording.value(ref)


def recorded_init(model: nn.Module) -> RecordedInit | None:
    """What ZeroInitContext recorded for `model`'s meta tensors, or None when it has none.

    Raises:
        ValueError: a meta parameter/buffer was not built inside a ZeroInitContext, or changed after it exited.
        RuntimeError: called inside a ZeroInitContext.
    """
    if _recording_now():
        raise RuntimeError("zerogpt.initialize was called inside a ZeroInitContext; call it after the `with` block, "
                           "when the model's initialisation is fully recorded")
    recordings = list({id(r): r for m in model.modules() if (r := _RECORDINGS.get(m)) is not None}.values())

    def source(name: str, t: torch.Tensor, kind: str):
        if not t.is_meta:
            return t
        owner = next((r for r in recordings if _key(t) in r.roots), None)
        if owner is None:
            raise ValueError(f"{kind} {name!r} is on the meta device but was not built inside "
                             f"zerogpt.ZeroInitContext (or was converted after it, e.g. by .to()/.half()), so its "
                             f"values are unknown; build the model inside `with zerogpt.ZeroInitContext(cfg):` or "
                             f"give it real weights before zerogpt.initialize")
        if owner.exit_versions.get(id(t), t._version) != t._version:
            raise ValueError(f"{kind} {name!r} was modified in place after its ZeroInitContext exited; ops on meta "
                             f"tensors outside the context are not recorded. Move that initialisation inside the "
                             f"`with` block")
        return owner, owner.ref(t)

    params = {n: source(n, p, "parameter") for n, p in model.named_parameters()}
    buffers = {n: source(n, b, "buffer") for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    if not buffers and all(isinstance(s, torch.Tensor) for s in params.values()):
        return None
    return RecordedInit(params, buffers)


def give_storage(params: Iterable[nn.Parameter]) -> None:
    """Give each meta parameter an empty CPU tensor in place, so a chunk can bind it to its slot.

    `param.data = ...` cannot move a tensor off the meta device, so the contents are swapped: the Parameter object
    stays the same one the optimizer, tied modules and hooks hold, with its attributes and class.
    """
    for p in params:
        if p.is_meta:
            shell = nn.Parameter(torch.empty(0, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
            shell.__class__ = type(p)
            shell.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, shell)
