"""JSON Lines: reading a stage's input one record at a time, and writing one record per line.

Owns the bad-line convention every stage follows: a malformed input line is reported
as `file:line: reason`, skipped and counted (or raises with --strict). Line numbers are 1-based
and are the documents' identity in later stages. It does not know any stage's record schema
beyond "one JSON object per line".
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import IO, Any, Iterator

# A file with thousands of bad lines should not flood the terminal; the count is in the stats.
MAX_REPORTS_PER_FILE = 20
# A JSON escape of a UTF-16 surrogate. Paired ones decode to one character; a lone one gives a str
# that cannot be encoded (UTF-8 output, the Rust tokenizer), so such records are rejected as bad lines.
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")


class BadLineReporter:
    """Prints `file:line: reason` for the first MAX_REPORTS_PER_FILE bad lines of a file, then a count."""

    def __init__(self, path: str, strict: bool = False, stream: IO[str] | None = None,
                 action: str = "skipped") -> None:
        self.path, self.strict, self.count, self.action = path, strict, 0, action
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, lineno: int | str, reason: str) -> None:
        """`lineno`: a line of `path`, or a place of its own ("FILE:LINE", a file in a folder)."""
        where = lineno if isinstance(lineno, str) else f"{self.path}:{lineno}"
        if self.strict:
            raise ValueError(f"{where}: {reason} (drop --strict to skip and count bad lines)")
        self.count += 1
        if self.count <= MAX_REPORTS_PER_FILE:
            print(f"{where}: {reason}; {self.action}", file=self.stream)
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
