"""Shared I/O for the data-pipeline stages: JSONL streaming, atomic writes, stats files, progress.

Owns the conventions every stage follows (DESIGN §6): malformed input lines are reported as
`file:line: reason` and skipped+counted (or raise with --strict), outputs are written to a
temporary file in the same directory and renamed, and `<output>.stats.json` records counts,
parameters and input signatures so `all` can tell a complete output from a partial one.
It does not know any stage's record schema beyond "one JSON object per line".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections import Counter
from typing import IO, Any, Iterable, Iterator

# A file with thousands of bad lines should not flood the terminal; the count is in the stats.
MAX_REPORTS_PER_FILE = 20
STATS_SUFFIX = ".stats.json"
# Args that never change a stage's output (determinism does not depend on them), so `all`
# ignores them when deciding whether an existing output is still valid.
NON_SEMANTIC_ARGS = frozenset({"workers", "strict", "quiet", "stage", "func", "progress", "extract_workers",
                               "memory_limit", "force", "retry_failed", "log_interval",
                               # where a stage runs (executor.add_executor_args), not what it writes
                               "executor", "ray_address", "tasks", "shard_size", "slurm_partition",
                               "slurm_time", "workdir"})
# A JSON escape of a UTF-16 surrogate. Paired ones decode to one character; a lone one gives a str
# that cannot be encoded (UTF-8 output, the Rust tokenizer), so such records are rejected as bad lines.
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")


class BadLineReporter:
    """Prints `file:line: reason` for the first MAX_REPORTS_PER_FILE bad lines of a file, then a count."""

    def __init__(self, path: str, strict: bool = False, stream: IO[str] | None = None,
                 action: str = "skipped") -> None:
        self.path, self.strict, self.count, self.action = path, strict, 0, action
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, lineno: int, reason: str) -> None:
        if self.strict:
            raise ValueError(f"{self.path}:{lineno}: {reason} (drop --strict to skip and count bad lines)")
        self.count += 1
        if self.count <= MAX_REPORTS_PER_FILE:
            print(f"{self.path}:{lineno}: {reason}; {self.action}", file=self.stream)
        elif self.count == MAX_REPORTS_PER_FILE + 1:
            print(f"{self.path}: more bad lines; further reports suppressed (see the stats file)",
                  file=self.stream)


def parse_jsonl_line(raw_bytes: bytes, text_key: str | None = "text") -> tuple[dict | None, str]:
    """Decode one JSONL line: `(record, raw_text)` or `(None, reason)`; blank lines give `(None, "")`.

    A record is valid when it is UTF-8, valid JSON, a JSON object with no unpaired surrogate
    escape (`"\\ud800"` alone is valid JSON but not valid Unicode: it cannot be written as UTF-8 or
    tokenized) and (if `text_key` is given) has a string `text_key`. Stages that parse in worker
    processes call this directly.
    """
    try:
        raw = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
    if not raw.strip():
        return None, ""
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        # json's message for an open string already ends in "at" ("Unterminated string starting at")
        return None, f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
    if not isinstance(rec, dict):
        return None, f"expected a JSON object, got {type(rec).__name__}"
    if _SURROGATE_ESCAPE_RE.search(raw):  # rare: only then pay for a second pass over the record
        try:
            json.dumps(rec, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return None, "unpaired UTF-16 surrogate escape (e.g. \\ud800) in a string: not valid Unicode"
    if text_key is not None and not isinstance(rec.get(text_key), str):
        got = "missing" if text_key not in rec else type(rec[text_key]).__name__
        return None, f"field {text_key!r} must be a string, got {got}"
    return rec, raw


def iter_jsonl(path: str, counts: Counter | None = None, strict: bool = False,
               text_key: str | None = "text") -> Iterator[tuple[int, dict[str, Any], str]]:
    """Stream a JSONL file, yielding `(lineno, record, raw_line)` for each valid object.

    Invalid lines (see `parse_jsonl_line`) are reported with `path:lineno` and counted in
    `counts["malformed"]` (blank lines in `counts["blank_lines"]`); with `strict=True` the first
    one raises ValueError instead. Line numbers are 1-based and are the documents' identity in
    later stages (find/group/remove-duplicates refer to `file:line`).

    Example:
        >>> for lineno, rec, raw in iter_jsonl("docs.jsonl", counts): print(lineno, rec["url"])
    """
    counts = counts if counts is not None else Counter()
    report = BadLineReporter(path, strict)
    with open(path, "rb") as f:
        for lineno, raw_bytes in enumerate(f, 1):
            rec, raw = parse_jsonl_line(raw_bytes, text_key)
            if rec is not None:
                yield lineno, rec, raw
            elif raw:
                counts["malformed"] += 1
                report(lineno, raw)
            else:
                counts["blank_lines"] += 1


def iter_line_batches(path: str, size: int) -> Iterator[list[tuple[int, bytes]]]:
    """Raw lines of a file in batches of `size` `(lineno, bytes)`: the unit of work that stages
    send to worker processes, which parse with `parse_jsonl_line`."""
    with open(path, "rb") as f:
        batch = []
        for lineno, raw in enumerate(f, 1):
            batch.append((lineno, raw))
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch


def iter_text_lines(path: str) -> Iterator[tuple[int, str]]:
    """Yield `(lineno, stripped_line)` of a text file, skipping blank lines and `#` comments.

    Undecodable bytes are replaced (U+FFFD) so the caller can reject the line with its number
    instead of the whole file failing.
    """
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                yield lineno, line


def dumps(record: dict[str, Any]) -> str:
    """One JSONL line (with newline). ensure_ascii=False keeps non-English text readable."""
    return json.dumps(record, ensure_ascii=False) + "\n"


def local_path(path: str) -> str | None:
    """The absolute local path of `path` (a path or a file:// URL), or None for a remote fsspec URL."""
    if "://" not in path:
        return os.path.abspath(path)
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, p = fsspec.core.url_to_fs(path)
    return p if isinstance(fs, LocalFileSystem) else None


def abspath(path: str) -> str:
    """os.path.abspath for a local path; a URL as it is (what the stats record)."""
    return path if "://" in path else os.path.abspath(path)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    Readers never see a half-written output, and a killed stage leaves the old output (or
    none) plus a `.tmp` file that the next run ignores. On an exception the temp file is removed.
    `path` may be an fsspec URL (s3://, gs://, memory://): the temporary file is moved over it.

    Example:
        >>> with atomic_write("out.jsonl") as f: f.write(dumps({"text": "hi"}))
    """
    local = local_path(path)
    if local is None:
        with _atomic_write_url(path, mode, encoding) as f:
            yield f
        return
    directory = os.path.dirname(local)
    os.makedirs(directory, exist_ok=True)
    # Created like open() creates a file (mode 0666 less the umask), unlike mkstemp's 0600; O_EXCL and a
    # random name keep mkstemp's safety. The umask is applied by the kernel: nothing reads or sets it.
    tmp = os.path.join(directory, f".{os.path.basename(local)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        kwargs = {"encoding": encoding} if "b" not in mode else {}
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _atomic_write_url(url: str, mode: str, encoding: str | None) -> Iterator[IO]:
    """atomic_write for a remote URL: write `.NAME.RANDOM.tmp` beside it, then move it into place
    (on object stores an upload only appears once complete, so the move is the commit)."""
    import uuid

    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    directory, name = path.rsplit("/", 1) if "/" in path else ("", path)
    tmp = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp" if directory else f".{name}.{uuid.uuid4().hex}.tmp"
    if directory:
        fs.makedirs(directory, exist_ok=True)
    try:
        with fs.open(tmp, mode, **({"encoding": encoding} if "b" not in mode else {})) as f:
            yield f
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(tmp)
        raise


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


def exists(path: str) -> bool:
    """os.path.exists for a path or an fsspec URL."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def remove_tree(path: str) -> None:
    """shutil.rmtree(path, ignore_errors=True) for a path or an fsspec URL."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)


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


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "",
             unit: str = "doc"):
    """A tqdm bar on stderr; silent when stderr is not a terminal (logs, tests)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True,
                disable=None, file=sys.stderr, mininterval=0.5)


def imap_bounded(fn, tasks: Iterable, workers: int, initializer=None, initargs: tuple = (),
                 window: int | None = None, prefer_fork: bool = False) -> Iterator:
    """Ordered `map(fn, tasks)` over `workers` processes, at most `window` tasks in flight.

    Pool.imap reads its whole input ahead (a corpus would land in RAM); this keeps memory
    bounded. The pool is created at call time, before the caller starts progress bars or
    other threads. It uses spawn, or fork when `prefer_fork` and this process has a single
    thread (fork copies imported modules for free; with threads alive it could copy a held
    lock). With workers <= 1 it runs in-process (no pickling; easier to debug).
    """
    import multiprocessing
    import threading

    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        return (fn(task) for task in tasks)
    method = "fork" if (prefer_fork and threading.active_count() == 1
                        and "fork" in multiprocessing.get_all_start_methods()) else "spawn"
    pool = multiprocessing.get_context(method).Pool(workers, initializer, initargs)
    return _PoolMap(pool, fn, tasks, window or 4 * workers)


class _PoolMap:
    """Iterator of imap_bounded; `close()` stops the pool even if iteration never started."""

    def __init__(self, pool, fn, tasks: Iterable, window: int) -> None:
        self.pool = pool
        self._results = self._run(fn, tasks, window)

    def _run(self, fn, tasks: Iterable, window: int) -> Iterator:
        from collections import deque

        try:
            pending: deque = deque()
            for task in tasks:
                pending.append(self.pool.apply_async(fn, (task,)))
                if len(pending) >= window:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
        finally:
            self.close()

    def __iter__(self) -> Iterator:
        return self._results

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, name: str = "size") -> int:
    """Bytes from a size, with the one meaning every zerogpt command uses (the coreutils `dd` convention).

    SI units are powers of 1000 ("1GB" = 10**9, as Hugging Face's max_shard_size); IEC units and bare letters
    are powers of 1024 ("1GiB" = "1G" = 2**30). Case does not matter; a plain number is bytes.

    Example:
        >>> parse_size("1GB"), parse_size("1G"), parse_size("512MiB")
        (1000000000, 1073741824, 536870912)
    Raises:
        ValueError naming `name` (e.g. the flag), the text and the accepted forms (also for sizes <= 0).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size; write bytes or e.g. 500MB (10**6), 2G or 2GiB "
                         f"(2**30)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def add_common_args(parser: Any) -> None:
    """--strict, the flag every stage that reads JSONL shares."""
    parser.add_argument("--strict", action="store_true",
                        help="fail on the first malformed input line instead of skipping and counting it")


def add_output_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """`--output OUT` / `-o OUT`, or OUT as the last positional: the Megatron tools' form that the
    Colossal-AI GPT tutorial runs (`cleanup raw.json clean.json`, `shuffle dedup.json -o train.json`).

    Both land in `args.output`; giving neither or both is an argparse error. Add it after the
    stage's other positionals.
    """
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("-o", "--output", help=help)
    # SUPPRESS: when the positional is absent it must not overwrite --output with a default
    group.add_argument("output", nargs="?", metavar="OUTPUT", default=argparse.SUPPRESS,
                       help="the same as --output (the tutorial's positional form)")


def check_input(path: str, what: str = "input") -> None:
    """ValueError (not a traceback) when an input file is missing; a warning naming the stage that
    wrote it, and its counts, when it is an empty stage output (the chain is broken upstream)."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist; check the path (or run the previous stage)")
    if os.path.isfile(path) and os.path.getsize(path) == 0 and written_by(path):
        print(f"warning: {what} {path} is empty{written_by(path)}", file=sys.stderr)
