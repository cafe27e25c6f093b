"""Stage `cleanup`: repair text, normalise whitespace, filter by language, length and quality.

ftfy.fix_text -> whitespace normalisation -> minimum length (tokens of --tokenizer, else words;
the unit is written to the stats) -> langdetect (seeded: DetectorFactory.seed = 0, failures
counted as `lang_detect_failed`) -> optional Gopher quality rules (--quality, Rae et al. 2021,
"Scaling Language Models", appendix A.1). Rejected documents go to OUT.rejected.jsonl with
their reason, and so do malformed input lines (whole, as `raw`). Work is split over --workers
processes; output order is input order.

The input is the download output, or users' own data (readers.py): JSONL with any --text-key (a file, a
folder, .gz/.zst), Parquet, a Hugging Face dataset folder, or WARC/WET files, whose pages get their main
text extracted here as download extracts it. Each kept record carries the input's `id` and `url`.

    python -m data_pipeline cleanup raw.jsonl --output clean.jsonl --lang en --min-tokens 128
    python -m data_pipeline cleanup CC-MAIN-20240101-00000.warc.gz --output clean.jsonl
    python -m data_pipeline cleanup fineweb/ --input-format parquet --output clean.jsonl
"""
from __future__ import annotations

import argparse
import os
import re
import time
from collections import Counter
from typing import Any

from data_pipeline.cli_args import add_common_args, add_output_arg, check_input
from data_pipeline.files import atomic_write
from data_pipeline.jsonl import BadLineReporter, dumps, iter_line_batches, parse_jsonl_line
from data_pipeline.stats import write_stats
from data_pipeline.tokenizer import tokenizer_inputs
from data_pipeline.workers import batched, imap_bounded, progress

BATCH_LINES = 256  # lines per worker task: large enough to amortise pickling
_HSPACE_RE = re.compile(r"[^\S\n]+")  # whitespace except newline (tabs, NBSP, ideographic space...)
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_MANY_NEWLINES_RE = re.compile(r"\n{3,}")
_WORD_RE = re.compile(r"\w+", re.UNICODE)
_ALPHA_RE = re.compile(r"[^\W\d_]")
GOPHER_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "·")


def normalize_whitespace(text: str) -> str:
    """CRLF/CR -> LF, drop control chars, collapse spaces per line, at most one blank line, strip."""
    text = _CONTROL_RE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = (_HSPACE_RE.sub(" ", line).strip() for line in text.split("\n"))
    return _MANY_NEWLINES_RE.sub("\n\n", "\n".join(lines)).strip()


def gopher_quality(text: str) -> str | None:
    """The first Gopher rule `text` breaks (a reason string), or None.

    Rules and thresholds from Gopher's MassiveText filters (Rae et al. 2021, A.1.1 quality and
    A.1.2 repetition): 50..100k words, mean word length 3..10, hash/ellipsis-to-word ratio < 0.1,
    <= 90% bullet lines, <= 30% ellipsis-ended lines, >= 80% words with a letter, >= 2 stop words,
    duplicate-line fraction <= 0.3, top 2/3/4-gram character share <= 0.20/0.18/0.16.
    """
    words = text.split()
    n = len(words)
    if not 50 <= n <= 100_000:
        return "quality:word_count"
    if not 3 <= sum(len(w) for w in words) / n <= 10:
        return "quality:mean_word_length"
    if (text.count("#") + text.count("...") + text.count("…")) / n > 0.1:
        return "quality:symbol_ratio"
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if sum(ln.lstrip().startswith(BULLETS) for ln in lines) > 0.9 * len(lines):
        return "quality:bullet_lines"
    if sum(ln.rstrip().endswith(("...", "…")) for ln in lines) > 0.3 * len(lines):
        return "quality:ellipsis_lines"
    if sum(bool(_ALPHA_RE.search(w)) for w in words) < 0.8 * n:
        return "quality:alphabetic_words"
    lower = [w.lower().strip(".,;:!?\"'()") for w in words]
    if len(GOPHER_STOP_WORDS.intersection(lower)) < 2:
        return "quality:stop_words"
    if len(lines) > 1 and 1 - len(set(lines)) / len(lines) > 0.3:
        return "quality:duplicate_lines"
    total_chars = sum(len(w) for w in lower)
    for k, limit in ((2, 0.20), (3, 0.18), (4, 0.16)):
        if n >= k:
            grams = Counter(tuple(lower[i:i + k]) for i in range(n - k + 1))
            gram, count = grams.most_common(1)[0]
            if count > 1 and count * sum(len(w) for w in gram) / total_chars > limit:
                return f"quality:top_{k}gram"
    return None


_STATE: dict[str, Any] = {}


def _init_worker(tokenizer_json: str | None) -> None:
    """Seed langdetect and rebuild the length tokenizer from its JSON (no file access, cannot fail
    on a bad path: the parent already loaded it, and a raising Pool initializer would respawn forever)."""
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0  # langdetect samples features randomly; seed it in every process
    if tokenizer_json:
        from tokenizers import Tokenizer

        _STATE["tokenizer"] = Tokenizer.from_str(tokenizer_json)
    else:
        _STATE["tokenizer"] = None


def clean_record(rec: dict, lang: str, min_tokens: int, quality: bool) -> tuple[str | None, Any]:
    """(None, cleaned_record) to keep, or (reason, detail) to reject."""
    from langdetect import LangDetectException, detect

    text = normalize_whitespace(_fix_text(rec["text"]))
    if not text:
        return "empty", ""
    tok = _STATE.get("tokenizer")
    length = len(tok.encode(text, add_special_tokens=False).ids) if tok else len(text.split())
    if length < min_tokens:
        return "too_short", length
    detected = None
    if lang != "any":
        try:
            detected = detect(text)
        except LangDetectException as e:
            return "lang_detect_failed", str(e)
        if detected != lang:
            return "wrong_lang", detected
    if quality:
        reason = gopher_quality(text)
        if reason:
            return reason, ""
    out = dict(rec, text=text)
    return None, (out, length, detected)


def _fix_text(text: str) -> str:
    import ftfy

    return ftfy.fix_text(text)


def _process_batch(task: tuple[list[tuple[int, bytes]], str, int, bool, tuple[str, str, str]]) -> list[tuple]:
    """Worker: parse + clean a batch of raw lines -> [(lineno, kind, payload...)]; `keys` are the text, id
    and URL keys of the input (readers.rename_keys)."""
    from data_pipeline.readers import rename_keys

    lines, lang, min_tokens, quality, keys = task
    results = []
    for lineno, raw in lines:
        rec, err = parse_jsonl_line(raw, keys[0])
        if rec is not None:
            rec = rename_keys(rec, *keys)
        if rec is None:
            results.append((lineno, "blank" if not err else "malformed", err,
                            raw.decode("utf-8", errors="replace").rstrip("\n") if err else None))
            continue
        try:
            reason, payload = clean_record(rec, lang, min_tokens, quality)
        except Exception as e:  # a library crash on odd text: reject with the reason, keep going
            reason, payload = "error", f"{type(e).__name__}: {e}"[:300]
        results.append((lineno, "reject" if reason else "keep", reason, payload if not reason else
                        (payload, rec.get("url"), rec["text"][:200])))
    return results


def process_items(task: tuple[list[tuple], str, int, bool]) -> list[tuple]:
    """Worker: extract (a WARC page) and clean a batch of readers.py items -> results as `_process_batch`'s,
    each named by the document's id instead of a line number."""
    from data_pipeline.warc import extract_page

    items, lang, min_tokens, quality = task
    results = []
    for item in items:
        if item[0] == "skip":  # the reader found no document there: no text, or a response that is no page
            _, doc_id, reason, detail, url = item
            results.append((doc_id, "reject", reason, (detail, url, "")))
            continue
        if item[0] == "malformed":  # a JSONL line that is no document: where ("FILE:LINE"), why, the line
            _, where, reason, line = item
            results.append((where, "malformed", reason, line))
            continue
        _, rec, is_page = item
        try:
            if is_page:
                rec = extract_page(rec)
            reason, payload = ("no_text", "no main text extracted") if not rec["text"] else \
                clean_record(rec, lang, min_tokens, quality)
        except Exception as e:  # a library crash on odd text: reject with the reason, keep going
            reason, payload = "error", f"{type(e).__name__}: {e}"[:300]
        results.append((rec["id"], "reject" if reason else "keep", reason, payload if not reason else
                        (payload, rec.get("url"), rec["text"][:200])))
    return results


def add_parser(subparsers) -> argparse.ArgumentParser:
    from data_pipeline.readers import add_input_args

    p = subparsers.add_parser("cleanup", help="fix text, filter by language, length and quality",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="the download output (JSONL), or JSONL, Parquet, a Hugging Face dataset or "
                                 "WARC files of your own (a file or a folder; see --input-format)")
    add_output_arg(p, "cleaned JSONL; rejects go to OUTPUT.rejected.jsonl")
    p.add_argument("--lang", default="en", help="keep this langdetect code ('any' disables the filter)")
    p.add_argument("--min-tokens", type=int, default=128,
                   help="minimum length in tokens of --tokenizer (in whitespace words without one)")
    p.add_argument("--tokenizer", help="tokenizer directory (train-tokenizer output, any local HF tokenizer dir, "
                   "or vocab.json + merges.txt) or a tokenizer.json file")
    p.add_argument("--quality", action="store_true", help="apply Gopher quality and repetition rules")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    add_input_args(p)
    add_common_args(p)
    return p



def record_result(result: tuple, out, rej, counts: Counter, languages: Counter, report) -> int:
    """Write one of `_process_batch`'s results where it belongs (a kept document to `out`, anything else to
    the rejects file `rej`, a malformed line whole) and count it; returns the kept document's length, or 0."""
    lineno, kind, reason, payload = result
    where = {"line": lineno} if isinstance(lineno, int) else {"id": lineno}  # a line, or a reader's document
    if kind == "blank":
        counts["blank_lines"] += 1
    elif kind == "malformed":  # a line number of the input, or a reader's "FILE:LINE"
        counts["malformed"] += 1
        if report is not None:
            report(lineno, reason)
        rej.write(dumps({"line" if isinstance(lineno, int) else "where": lineno, "url": None, "reason": "malformed",
                         "detail": reason, "raw": payload}))
    elif kind == "keep":
        record, length, detected = payload
        out.write(dumps(record))
        counts["kept"] += 1
        languages[detected or "not_checked"] += 1
        return length
    else:
        detail, url, head = payload
        counts[reason] += 1
        if reason == "wrong_lang":
            languages[detail] += 1
        rej.write(dumps({**where, "url": url, "reason": reason, "detail": detail, "text_head": head}))
    return 0

def input_keys(args: argparse.Namespace) -> tuple[str, str, str]:
    """The input's text, id and URL keys (readers.add_input_args)."""
    return args.text_key, args.id_key, args.url_key


def run(args: argparse.Namespace) -> int:
    from data_pipeline.readers import Source, is_line_input

    started = time.time()
    check_input(args.input)
    tokenizer_json = None
    if args.tokenizer:  # the same loader as `tokenize`; fails with a message naming the path
        from data_pipeline.tokenizer import load_backend

        tokenizer_json = load_backend(args.tokenizer, require_eod=False)[0].to_str()
    counts: Counter = Counter(kept=0, empty=0, too_short=0, wrong_lang=0, lang_detect_failed=0, malformed=0)
    languages: Counter = Counter()
    total_length = 0
    report = BadLineReporter(args.input, args.strict, action=f"recorded in {args.output}.rejected.jsonl")
    inputs, extra = [args.input], {}
    if is_line_input(args):
        tasks = ((batch, args.lang, args.min_tokens, args.quality, input_keys(args))
                 for batch in iter_line_batches(args.input, BATCH_LINES))
        results = imap_bounded(_process_batch, tasks, args.workers, _init_worker, (tokenizer_json,))
    else:  # read through readers.py, unit after unit, in input order
        source = Source.from_args(args)
        inputs, extra = source.files(), {"input_format": source.format}
        items = (item for unit in source.units() for item in source.read(unit))
        tasks = ((batch, args.lang, args.min_tokens, args.quality) for batch in batched(items, BATCH_LINES))
        results = imap_bounded(process_items, tasks, args.workers, _init_worker, (tokenizer_json,))
    try:
        with atomic_write(args.output) as out, atomic_write(args.output + ".rejected.jsonl") as rej, \
                progress(desc="cleanup", unit="doc") as bar:
            for batch in results:
                for result in batch:
                    bar.update(1)
                    total_length += record_result(result, out, rej, counts, languages, report)
    finally:
        results.close()  # stops the worker pool even when a --strict error is raised
    unit = f"tokens ({args.tokenizer})" if args.tokenizer else "words (whitespace split; no --tokenizer)"
    # the tokenizer (a file, or a directory and its files) is an input: `all` re-runs cleanup when one changes
    write_stats(args.output, "cleanup", counts, args, inputs + tokenizer_inputs(args.tokenizer),
                started, length_unit=unit,
                kept_length_total=total_length, languages=dict(languages.most_common()), **extra)
    return 0
