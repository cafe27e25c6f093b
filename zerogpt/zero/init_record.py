"""The record of a ZeroInitContext: per meta storage, the ops that made and changed it, and their replay.

`_Recording` holds, for each meta storage built inside the context, its root op and every later op that wrote
to it, with the generator state before each random op. `value()` replays a storage at a recorded version on
the CPU, which is how `initialize()` fills one rank's shard without building the rest.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_map


def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views, detached aliases and Parameters of one storage share it).

    torch keeps one Python object per storage for as long as the storage lives (`t.untyped_storage()` returns the
    same object each time), and each recorded storage's object is held by its `_Root`, so no id is reused.
    """
    return id(t.untyped_storage())


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
    func: Callable[..., Any]  # an aten op overload (torch.ops.aten.<op>.<overload>)
    args: Any  # (args, kwargs) with tensors encoded as _Ref / _Real
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state just before a random op
    out_index: int | None = None  # set on a storage's first op: which flat output it is
    out_geometry: tuple | None = None  # (size, stride, offset) that output had on meta


@dataclass
class _Root:
    storage: torch.UntypedStorage  # the meta storage, held so its id (_key) is never reused for another
    log: list[_Op]
    parents: tuple[int, ...] = ()  # storages the creating op read, to describe an unregistered tensor
    label: str | None = None  # "Linear.weight (4, 3)" once registered on a module, for error messages


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _Recording:
    """Everything one ZeroInitContext recorded; replays any storage at any version on the CPU."""

    def __init__(self) -> None:
        self.roots: dict[int, _Root] = {}
        # While replaying inside rng_preserved: id -> (generator, its state before the replay touched it). Saved
        # lazily, so a model that seeds a generator per block (model_zoo GPT) costs only the ones a replay uses.
        self._rng_saved: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None
        self.exit_versions: dict[int, int] = {}  # id(param or buffer) -> tensor._version when the context exited

    def __deepcopy__(self, memo: dict) -> "_Recording":
        # A deep copy of a model shares its modules' record (init_ctx.RECORDING_ATTR) instead of copying the
        # generators and storages in it: the copy's meta tensors have new storages, which it does not know.
        return self

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
        outer, self._rng_saved = self._rng_saved, {}
        self._save_rng(torch.default_generator)
        try:
            yield
        finally:
            for g, state in self._rng_saved.values():
                g.set_state(state)
            self._rng_saved = outer

    def _save_rng(self, gen: torch.Generator) -> None:
        if self._rng_saved is not None and id(gen) not in self._rng_saved:
            self._rng_saved[id(gen)] = (gen, gen.get_state())

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
                self._save_rng(op.rng[0])
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
