"""Reading a zerogpt checkpoint (the format checkpoint.py writes): unsharded tensors by name, or the element range
of any rank's local tensor, from pieces saved at any (T, P, D).

Owns the format's constants and the checks a reader makes (complete, not truncated, a known version); knows
nothing of engines. Used by `load_engine` (each rank reads its ranges) and by export/generate (whole tensors).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from zerogpt.parallel.layout import ParamLayout, global_runs, overlaps

FORMAT = "zerogpt-checkpoint"
VERSION = 2  # 2: pieces record their layout, meta records (T, P, D); 1 is still read
READABLE_VERSIONS = (1, 2)
META = "meta.json"
BUFFERS = "buffers.safetensors"
_OPEN_FILES = 4  # shard files a reader keeps open at once


# ------------------------------------------------------------------------------------------------
# read


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or of another model."""


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory (via checkpoints/latest) or a checkpoint directory."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = os.path.join(path, "checkpoints", f.read().strip())
        if restore_set_aside(ckpt) or os.path.isfile(os.path.join(ckpt, META)):
            return ckpt
        raise CheckpointError(f"{latest} names {ckpt}, which is not a complete checkpoint (no {META})")
    raise CheckpointError(f"{path} is neither a checkpoint directory (no {META}) nor a run directory "
                          f"(no checkpoints/latest); pass e.g. runs/x or runs/x/checkpoints/step_1000")


def restore_set_aside(directory: str) -> bool:
    """Put back the checkpoint a re-save of the same step set aside (`.step_N.old`) and was killed before the new
    one took its place; True when it did. The set-aside copy is complete: it was a checkpoint before the re-save."""
    parent, name = os.path.split(os.path.abspath(directory))
    aside = os.path.join(parent, f".{name}.old")
    if os.path.exists(directory) or not os.path.isfile(os.path.join(aside, META)):
        return False
    try:
        os.replace(aside, directory)
    except FileNotFoundError:  # another rank put it back first
        pass
    return os.path.isfile(os.path.join(directory, META))


class CheckpointReader:
    """Reads tensors, or element ranges of a rank's local tensor of them, from a checkpoint of any (T, P, D)
    without loading it whole.

    Example:
        >>> r = CheckpointReader(resolve_checkpoint("runs/demo_cpu"))
        >>> r.tensor("transformer.wte.weight").shape          # unsharded, whatever layout saved it
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        meta_path = os.path.join(directory, META)
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{directory} is not a complete checkpoint: {META} is missing (a save that was "
                                  f"interrupted leaves no {META}); use the previous checkpoint")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{meta_path} is corrupt ({e}); use another checkpoint") from None
        if self.meta.get("format") != FORMAT or self.meta.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{meta_path}: format {self.meta.get('format')!r} version "
                                  f"{self.meta.get('version')!r}, expected {FORMAT!r} version "
                                  f"{' or '.join(map(str, READABLE_VERSIONS))}")
        self._check_files()
        self.tied: dict[str, str] = self.meta.get("tied", {})
        # {(kind, name): [(start, end, file, key, layout of the saving rank's local tensor)]}
        self._pieces: dict[tuple[str, str], list[tuple[int, int, str, str, ParamLayout]]] = {}
        for fname, entry in self.meta["files"].items():
            layouts = entry.get("layouts", {})  # version 1: every piece is of a whole parameter
            for kind, name, start, end, key in entry["pieces"]:
                layout = (ParamLayout.from_json(layouts[name]) if name in layouts
                          else ParamLayout.whole(self.meta["params"][name]["shape"]))
                self._pieces.setdefault((kind, name), []).append((start, end, fname, key, layout))
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: (p[0], p[2]))
        self._runs: dict[tuple[str, str], list] = {}  # a piece's global runs, computed once
        self._open: dict[str, Any] = {}

    @property
    def parallel(self) -> dict:
        """{"tp": T, "pp": P, "dp": D} of the run that saved it (version 1: T = P = 1)."""
        return self.meta.get("parallel", {"tp": 1, "pp": 1, "dp": self.meta["world_size"]})

    def _check_files(self) -> None:
        for fname, entry in self.meta["files"].items():
            path = os.path.join(self.directory, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint shard {path} is truncated or corrupt: {size} bytes, "
                                      f"expected {entry['bytes']}")
        for fname in sorted(set(self._buffer_files().values())):
            path = os.path.join(self.directory, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")

    def _buffer_files(self) -> dict[str, str]:
        """{buffer name: the file holding it} (version 1 and single-stage saves: all in BUFFERS)."""
        return {name: self.meta.get("buffer_files", {}).get(name, BUFFERS) for name in self.meta["buffers"]}

    @property
    def config_path(self) -> str | None:
        path = os.path.join(self.directory, "config.py")
        return path if os.path.isfile(path) else None

    def names(self) -> list[str]:
        """Parameter names (unique; tied aliases not repeated), then persistent buffer names, in model order."""
        return list(self.meta["params"]) + list(self.meta["buffers"])

    def canonical(self, name: str) -> str:
        """The saved name of `name`: itself, or the parameter a tied alias or copy shares its values with."""
        return self.tied.get(name, name) if name not in self.meta["params"] else name

    def kinds(self, name: str) -> list[str]:
        name = self.canonical(name)
        return sorted({kind for kind, n in self._pieces if n == name})

    def shape(self, name: str) -> list[int]:
        """The global (unsharded) shape of parameter `name`."""
        name = self.canonical(name)
        if name not in self.meta["params"]:
            raise KeyError(f"{name!r} is not in checkpoint {self.directory}")
        return self.meta["params"][name]["shape"]

    def _file(self, fname: str) -> Any:
        """An open (memory-mapped) shard file. Only the few most recently used stay open: a mapping keeps its
        pages counted in RSS, and a reader that kept every file open would look like a second copy of the model."""
        handle = self._open.pop(fname, None)
        if handle is None:
            from safetensors import safe_open

            path = os.path.join(self.directory, fname)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:
                raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt): {e}") from None
        self._open[fname] = handle  # most recent last
        while len(self._open) > _OPEN_FILES:
            self._open.pop(next(iter(self._open)))
        return handle

    def _piece_runs(self, fname: str, key: str, layout: ParamLayout, start: int, end: int) -> list:
        runs = self._runs.get((fname, key))
        if runs is None:  # offsets relative to the piece
            runs = self._runs[(fname, key)] = [(g, loc - start, n) for g, loc, n in global_runs(layout, start, end)]
        return runs

    def _slice(self, fname: str, key: str, lo: int, hi: int) -> torch.Tensor:
        try:
            return self._file(fname).get_slice(key)[lo:hi]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint file {os.path.join(self.directory, fname)}: cannot read "
                                  f"{key!r} ({e})") from None

    def read(self, kind: str, name: str, layout: ParamLayout, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened local tensor that `layout` cuts from parameter `name`'s
        `kind` ("master", "exp_avg", "param", ...), read from the pieces that overlap them, whatever layout
        saved those. fp32, 1-dim. Memory: the result and one piece's overlapping span at a time."""
        name = self.canonical(name)
        if list(layout.global_shape) != self.shape(name):
            raise CheckpointError(f"{self.directory}: {name!r} is {self.shape(name)} in the checkpoint, the "
                                  f"layout asks for {list(layout.global_shape)}")
        out = torch.empty(end - start, dtype=torch.float32)
        want = [(g, loc - start, n) for g, loc, n in global_runs(layout, start, end)]
        covered = 0
        for p_start, p_end, fname, key, p_layout in self._pieces.get((kind, name), ()):
            copies = overlaps(want, self._piece_runs(fname, key, p_layout, p_start, p_end))
            if not copies:
                continue
            lo = min(h for h, _, _ in copies)
            piece = self._slice(fname, key, lo, max(h + n for h, _, n in copies))
            for h, w, n in copies:
                out[w: w + n] = piece[h - lo: h - lo + n]
                covered += n
        if covered != end - start:
            raise CheckpointError(f"{self.directory}: {kind} of {name!r} elements [{start}, {end}) of a local "
                                  f"tensor {list(layout.local_shape)} are not all in the checkpoint ({covered} "
                                  f"found); the checkpoint is incomplete")
        return out

    def read_range(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened unsharded `kind` tensor of parameter `name`."""
        return self.read(kind, name, ParamLayout.whole(self.shape(name)), start, end)

    def tensor(self, name: str, kind: str | None = None) -> torch.Tensor:
        """The full fp32 tensor of a parameter (its master or frozen value, or `kind`) or buffer, unsharded."""
        if name in self.meta["buffers"]:
            from safetensors import safe_open

            path = os.path.join(self.directory, self._buffer_files()[name])
            try:
                with safe_open(path, framework="pt") as f:
                    return f.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt): {e}") from None
        shape = self.shape(name)
        kind = kind or ("master" if self.meta["params"][self.canonical(name)]["trainable"] else "param")
        return self.read_range(kind, name, 0, math.prod(shape)).view(shape)

    def rng_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s saved RNG states; CheckpointError naming the file when it is missing or unreadable."""
        from safetensors.torch import load_file

        path = os.path.join(self.directory, f"rng_r{rank:05d}.safetensors")
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
        try:
            return load_file(path)
        except Exception as e:
            raise CheckpointError(f"checkpoint file {path} is unreadable (truncated or corrupt): {e}") from None
