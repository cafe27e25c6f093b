"""Files written whole or not at all: a temporary file beside the target, flushed to disk, then renamed over it, so
a reader (a resumed run, the plan cache, a bench's results) never sees half a file, however the writer was stopped."""
from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_text_atomic", "write_json_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any, *, sort_keys: bool = False) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=sort_keys))
