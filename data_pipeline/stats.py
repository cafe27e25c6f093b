"""`<output>.stats.json`: what a stage writes beside its output, and how `all` reads it back.

The stats record counts, the parameters that determine the output and the inputs' signatures
(path, size, mtime). Written last, after the output is in place, so `"complete": true` means the
output is whole; `is_complete` is how `all` tells a complete, up-to-date output from a partial or
stale one. It does not know what any stage counts.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable

from data_pipeline.files import abspath, atomic_write, exists, local_path

STATS_SUFFIX = ".stats.json"
# Args that never change a stage's output (determinism does not depend on them), so `all`
# ignores them when deciding whether an existing output is still valid.
NON_SEMANTIC_ARGS = frozenset({"workers", "strict", "quiet", "stage", "func", "progress", "extract_workers",
                               "memory_limit", "force", "retry_failed", "log_interval",
                               # where a stage runs (executor.add_executor_args), not what it writes
                               "executor", "ray_address", "tasks", "shard_size", "slurm_partition",
                               "slurm_time", "workdir", "verbose"})


def file_signature(path: str) -> dict[str, Any]:
    """Path, size and mtime of a file: what `all` compares to decide an output is stale (a URL's
    modification time is what its filesystem reports, if any)."""
    local = local_path(path)
    if local is None:
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        info = fs.info(p)
        mtime = next((info[k] for k in ("mtime", "LastModified", "updated", "created") if info.get(k)), None)
        return {"path": path, "size": info["size"], "mtime": str(mtime)}
    st = os.stat(local)
    return {"path": local, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def stage_params(args: Any) -> dict[str, Any]:
    """The arguments of a stage that determine its output, as JSON-able values."""
    params = {}
    for key, value in sorted(vars(args).items()):
        if key in NON_SEMANTIC_ARGS or callable(value):
            continue
        params[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return params


def stats_path(output: str) -> str:
    return output + STATS_SUFFIX


def write_stats(output: str, stage: str, counts: dict[str, Any], args: Any = None,
                inputs: Iterable[str] = (), started: float | None = None, **extra: Any) -> dict:
    """Write `<output>.stats.json` atomically and print the stage's one-line summary.

    Written last, after the output is renamed into place, so its presence with
    `"complete": true` means the output is whole (what `all` checks).
    """
    stats: dict[str, Any] = {"stage": stage, "output": abspath(output), "complete": True,
                             "counts": dict(sorted(counts.items()))}
    if args is not None:
        stats["params"] = stage_params(args)
    stats["inputs"] = [file_signature(p) for p in inputs]
    if exists(output):
        stats["output_signature"] = file_signature(output)
    if started is not None:
        stats["seconds"] = round(time.time() - started, 3)
    stats.update(extra)
    with atomic_write(stats_path(output)) as f:
        json.dump(stats, f, indent=2, ensure_ascii=False, default=str)
        f.write("\n")
    summary = ", ".join(f"{k}={v}" for k, v in stats["counts"].items())
    print(f"[{stage}] {output}: {summary}", file=sys.stderr)
    return stats


def read_stats(output: str) -> dict | None:
    """The stats of `output`, or None when missing or unreadable (a partial run)."""
    import fsspec

    try:
        with fsspec.open(stats_path(output), "r", encoding="utf-8") as f:
            stats = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return stats if isinstance(stats, dict) else None


def written_by(path: str) -> str:
    """'; stage S wrote it (k=v, ...)' from `path`'s stats file, or '' without one: an error about
    an empty input then names the stage that produced nothing and why."""
    stats = read_stats(path)
    if not stats or not isinstance(stats.get("counts"), dict):
        return ""
    counts = ", ".join(f"{k}={v}" for k, v in stats["counts"].items() if v) or "all counts 0"
    return f"; stage {stats.get('stage', '?')} wrote it ({counts})"


def is_complete(output: str, args: Any = None, params: dict | None = None,
                outputs: list[str] | None = None) -> bool:
    """True when `output`'s stats exist and are complete, were made with these parameters, the
    outputs are unchanged since, and every input the stats recorded still has the same size and
    mtime. `all` uses this to skip stages; a partial or stale output is simply rebuilt.

    Parameters are `stage_params(args)` unless `params` gives them; the output is the file or
    directory `output` itself unless `outputs` lists the files (checked against the stats'
    `output_signatures`, as `tokenize` writes PREFIX.bin/.idx for the name PREFIX).
    """
    stats = read_stats(output)
    if not stats or not stats.get("complete"):
        return False
    if stats.get("params") != (stage_params(args) if params is None else params):
        return False
    try:
        if outputs is None:
            if stats.get("output_signature") != file_signature(output):
                return False
        elif stats.get("output_signatures") != [file_signature(p) for p in outputs]:
            return False
        return all(file_signature(rec["path"]) == rec for rec in stats.get("inputs", []))
    except (OSError, KeyError, TypeError):
        return False
