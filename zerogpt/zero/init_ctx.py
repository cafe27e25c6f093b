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
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from zerogpt.zero.init_modes import _CpuFacade, _is_meta, _Recorder
from zerogpt.zero.init_record import _key, _Recording, _Ref

__all__ = ["ZeroInitContext", "RecordedInit", "recorded_init", "built_in_context", "swap_meta_for_empty"]

RECORDING_ATTR = "_zerogpt_recording"
"""The attribute under which each module that registered a parameter or buffer inside a ZeroInitContext keeps
that context's record: the record travels with the model (`recorded_init(model)` reads it from
`model.modules()`) and is dropped with it."""


def _recording_now() -> bool:
    return any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack())


def _recording_of(module: nn.Module) -> _Recording | None:
    return vars(module).get(RECORDING_ATTR)


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
    The record travels with the model: each module that registered a tensor inside the block keeps it (under
    `RECORDING_ATTR`) until the module is garbage collected.

    Args:
        config: accepted and not read, so `ZeroInitContext(cfg)` call sites keep working. Nothing in a config
            changes how the model is built (the chunk layout is decided by `initialize`, which checks the config).

    Example:
        >>> with zerogpt.ZeroInitContext():
        ...     model = gpt2_small()
        >>> engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=cfg, ctx=ctx)
    """

    def __init__(self, config: Any = None) -> None:
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
                for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    if _is_meta(t):
                        self._recording.exit_versions[id(t)] = t._version
                vars(module)[RECORDING_ATTR] = self._recording
        self._modules = {}
        return False

    def _on_register(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        self._modules[id(module)] = module
        # Under the facade every tensor reports is_meta=False, but only meta storages are recorded: a recorded
        # storage is the test (of a strided tensor: a sparse one has no storage to ask for)
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            root = self._recording.roots.get(_key(tensor))
            if root is not None:
                root.label = root.label or f"{type(module).__name__}.{name} {tuple(tensor.shape)}"


# ----------------------------------------------------------------------------------------------
# what initialize() uses


@dataclass
class RecordedInit:
    """The recorded initialisation of one model's meta parameters and buffers, by name.

    `range_values` replays the one parameter a range is of; `param_value` gives it whole.
    Real (non-meta) tensors of the model are read as they are.
    """

    params: dict[str, tuple[_Recording, _Ref] | torch.Tensor]
    buffers: dict[str, tuple[_Recording, _Ref] | torch.Tensor] = field(default_factory=dict)

    def param_value(self, name: str) -> torch.Tensor:
        """The full value of parameter `name` (CPU, its own dtype), as plain construction would have made it."""
        return _value_of(self.params[name])

    def range_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened parameter `name`. Peak memory: that one parameter, replayed."""
        return self.param_value(name).reshape(-1)[start:end]

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


def built_in_context(model: nn.Module) -> bool:
    """Whether any module of `model` was built inside a ZeroInitContext (its record is kept)."""
    return any(_recording_of(m) is not None for m in model.modules())


def recorded_init(model: nn.Module) -> RecordedInit | None:
    """What ZeroInitContext recorded for `model`'s meta tensors, or None when it has none.

    Raises:
        ValueError: a meta parameter/buffer was not built inside a ZeroInitContext, or changed after it exited.
        RuntimeError: called inside a ZeroInitContext.
    """
    if _recording_now():
        raise RuntimeError("zerogpt.initialize was called inside a ZeroInitContext; call it after the `with` block, "
                           "when the model's initialisation is fully recorded")
    recordings = list({id(r): r for m in model.modules() if (r := _recording_of(m)) is not None}.values())

    def source(name: str, t: torch.Tensor, kind: str):
        if not t.is_meta:
            return t
        owner = next((r for r in recordings if _key(t) in r.roots), None)
        if owner is None:
            raise ValueError(f"{kind} {name!r} is on the meta device but was not built inside "
                             f"zerogpt.ZeroInitContext (or was converted after it, e.g. by .to()/.half()), and "
                             f"{type(model).__name__} has no init_param_range(name, start, end), so its values "
                             f"are unknown; build the model inside `with zerogpt.ZeroInitContext():`, give it "
                             f"init_param_range (as model_zoo's GPT has) or give it real weights before "
                             f"zerogpt.initialize")
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


def swap_meta_for_empty(params: Iterable[nn.Parameter]) -> None:
    """Give each meta parameter an empty CPU tensor in place, so a chunk can bind it to its slot.

    `param.data = ...` cannot move a tensor off the meta device, so the contents are swapped: the Parameter object
    stays the same one the optimizer, tied modules and hooks hold, with its attributes and class.
    """
    for p in params:
        if not p.is_meta:
            continue
        if isinstance(p, DTensor):  # a tensor-parallel shard: a CPU DTensor of the same spec, its local set later
            local = torch.empty(0, dtype=p.dtype, device="cpu")
            shell = nn.Parameter(DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride()), requires_grad=p.requires_grad)
        else:
            shell = nn.Parameter(torch.empty(0, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
            shell.__class__ = type(p)
        shell.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, shell)
