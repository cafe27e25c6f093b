"""Shared I/O for the data-pipeline stages: JSONL streaming, atomic writes, stats files, progress.

Owns the conventions every stage follows (DESIGN §6): malformed input lines are reported as
`file:line: reason` and skipped+counted (or raise with --strict), outputs are written to a
temporary file in the same directory and renamed, and `<output>.stats.json` records counts,
parameters and input signatures so `all` can tell a complete output from a partial one.
It does not know any stage's record schema beyond "one JSON object per line".
"""
from __future__ import annotations

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
                               "memory_limit"})
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
        return None, f"malformed JSON ({e.msg} at column {e.colno})"
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


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    Readers never see a half-written output, and a killed stage leaves the old output (or
    none) plus a `.tmp` file that the next run ignores. On an exception the temp file is removed.

    Example:
        >>> with atomic_write("out.jsonl") as f: f.write(dumps({"text": "hi"}))
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Created like open() creates a file (mode 0666 less the umask), unlike mkstemp's 0600; O_EXCL and a
    # random name keep mkstemp's safety. The umask is applied by the kernel: nothing reads or sets it.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        kwargs = {"encoding": encoding} if "b" not in mode else {}
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def file_signature(path: str) -> dict[str, Any]:
    """Path, size and mtime of a file: what `all` compares to decide an output is stale."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


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
    stats: dict[str, Any] = {"stage": stage, "output": os.path.abspath(output), "complete": True,
                             "counts": dict(sorted(counts.items()))}
    if args is not None:
        stats["params"] = stage_params(args)
    stats["inputs"] = [file_signature(p) for p in inputs]
    if os.path.exists(output):
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
    try:
        with open(stats_path(output), encoding="utf-8") as f:
            stats = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return stats if isinstance(stats, dict) else None


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


def parse_size(text: str) -> int:
    """'512M' / '2G' / '1000' -> bytes. Raises ValueError naming the accepted forms."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; use a number of bytes or e.g. 512M, 2G") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def add_common_args(parser: Any) -> None:
    """--strict, the flag every stage that reads JSONL shares."""
    parser.add_argument("--strict", action="store_true",
                        help="fail on the first malformed input line instead of skipping and counting it")


def check_input(path: str, what: str = "input") -> None:
    """ValueError (not a traceback) when an input file is missing."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist; check the path (or run the previous stage)")
