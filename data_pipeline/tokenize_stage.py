"""Stage `tokenize`: JSONL -> Megatron `P.bin`/`P.idx`, batched fast tokenization over worker processes.

The tokenizer is any that `load_tokenizer` takes: the pipeline's own, GPT-2's, or a model's HF tokenizer
directory (Llama-3/Qwen tokenizer.json, Llama-2 sentencepiece tokenizer.model). Each worker parses a block of
raw lines, encodes the texts with the Rust tokenizer in one batch without special tokens (so no BOS, even
where the tokenizer's post-processor would add one), appends the EOD id (the tokenizer's eos_token, or
`<|endoftext|>` when it names none; see tokenizer.py) to every document and returns one flat token array; the
main process only reads blocks and appends results in input order, so output is deterministic and memory
stays bounded.
Empty documents and malformed lines are skipped and counted. Named tokenize_stage.py so it does not shadow
the stdlib `tokenize` module. Stats (docs, tokens, tokens/s, skipped by reason, tokenizer, eod id,
vocab size, dtype) go to `P.stats.json`, which `GPTDataset` reads to check vocab and EOD.

    python -m data_pipeline tokenize webtext.jsonl --tokenizer runs/tokenizer --output-prefix data/webtext
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter
from typing import Any, Iterator

import numpy as np

from data_pipeline.cli_args import add_common_args, check_input
from data_pipeline.indexed import IndexedDatasetWriter, best_fitting_dtype, data_file_path, index_file_path
from data_pipeline.jsonl import BadLineReporter, parse_jsonl_line
from data_pipeline.stats import file_signature, write_stats
from data_pipeline.stats import is_complete as _is_complete
from data_pipeline.workers import progress

BLOCK_BYTES = 1 << 19  # bytes of JSONL per worker task: big enough for Rust batching, small enough to balance

_worker: dict[str, Any] = {}  # per-process tokenizer state set by _init_worker


def _init_worker(tokenizer_json: str, eod: int, dtype: str, text_key: str, threads: bool = True) -> None:
    """Record the worker's settings; the tokenizer itself is built by the first task.

    Nothing here may raise: an exception in a Pool initializer makes the pool respawn workers
    forever instead of failing, whereas one inside a task reaches the parent through `.get()`.
    """
    if not threads:  # one process per core already: Rust threads on top would only oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.clear()
    _worker.update(tokenizer_json=tokenizer_json, eod=eod, dtype=dtype, key=text_key)


def _worker_tokenizer():
    """This process' Rust tokenizer, rebuilt from JSON once (cheap; no transformers import)."""
    if "tokenizer" not in _worker:
        from tokenizers import Tokenizer

        _worker["tokenizer"] = Tokenizer.from_str(_worker["tokenizer_json"])
    return _worker["tokenizer"]


def _encode_block(task: tuple[int, bytes]) -> tuple[np.ndarray, np.ndarray, Counter, list, int, int]:
    """Parse and tokenize one block of lines.

    Returns (tokens, lengths, counts, bad_lines, num_chars, num_bytes): `tokens` is every kept document's ids plus
    EOD back to back in `dtype`, `lengths` their sizes, `bad_lines` [(lineno, reason)] for malformed lines.
    """
    first_lineno, blob = task
    tok, eod, key = _worker_tokenizer(), _worker["eod"], _worker["key"]
    counts: Counter = Counter()
    bad: list[tuple[int, str]] = []
    texts: list[str] = []
    for lineno, raw in enumerate(blob.split(b"\n"), first_lineno):
        record, reason = parse_jsonl_line(raw, key)
        if record is None:
            if reason:
                bad.append((lineno, reason))
            else:
                counts["blank_lines"] += 1
            continue
        text = record[key]
        if not text.strip():
            counts["empty"] += 1
            continue
        texts.append(text)
    # encode_batch_fast skips offset tracking (tokenizers >= 0.20); offsets are not needed here.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    tokens = np.empty(int(lengths.sum()), dtype=np.dtype(_worker["dtype"]))
    ends = np.cumsum(lengths)
    tokens[ends - 1] = eod
    start = 0
    for enc, end in zip(encodings, ends):
        tokens[start:end - 1] = enc.ids
        start = end
    return tokens, lengths, counts, bad, sum(map(len, texts)), len(blob) + 1


def _blocks(path: str, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(first line number, bytes of whole lines) blocks of about `block_bytes`, streamed from `path`."""
    lineno = 1
    with open(path, "rb") as f:
        while True:
            blob = f.read(block_bytes)
            if not blob:
                return
            if not blob.endswith(b"\n"):
                blob += f.readline()  # finish the last line so no record is split across blocks
            blob = blob[:-1] if blob.endswith(b"\n") else blob
            yield lineno, blob
            lineno += blob.count(b"\n") + 1


def _imap_ordered(fn, tasks: Iterator, workers: int, initargs: tuple) -> Iterator:
    """Ordered map over a process pool with a bounded number of tasks in flight (memory stays bounded).

    Forks where the OS can (Linux): workers start in milliseconds instead of re-importing numpy and
    tokenizers (~0.3 s, a third of a small corpus' run), and a user script without an
    `if __name__ == "__main__":` guard (WebtextDataset in a tutorial script) is not re-executed.
    The children only parse and encode; they touch none of the parent's threads or locks. With
    workers <= 1 it runs here, and the Rust tokenizer uses its own threads instead.
    """
    import multiprocessing
    from collections import deque

    if workers <= 1:
        _init_worker(*initargs, True)
        yield from map(fn, tasks)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (*initargs, False))
    try:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


def tokenize_file(input_path: str, tokenizer: str, output_prefix: str, workers: int = 1, text_key: str = "text",
                  strict: bool = False, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Tokenize a JSONL file into `output_prefix.bin/.idx`; returns the stats dict (also written to disk).

    Args:
        input_path: JSONL, one `{text_key: str, ...}` object per line.
        tokenizer: a directory or tokenizer.json that `load_tokenizer` accepts.
        output_prefix: writes `{prefix}.bin`, `{prefix}.idx` (atomically) and `{prefix}.stats.json`.
        workers: processes tokenizing in parallel (1 = in this process).

    Example:
        >>> tokenize_file("train.jsonl", "runs/tok", "data/train", workers=2)["counts"]   # doctest: +SKIP
        {'docs': 1000, 'empty': 3, 'malformed': 0, 'tokens': 512345}
    """
    from data_pipeline.tokenizer import load_backend

    started = time.time()
    check_input(input_path)
    backend, eod, vocab = load_backend(tokenizer)
    dtype = np.dtype(best_fitting_dtype(vocab))
    counts: Counter = Counter(docs=0, tokens=0, empty=0, malformed=0, blank_lines=0)
    report = BadLineReporter(input_path, strict)
    num_chars = 0
    results = _imap_ordered(_encode_block, _blocks(input_path, block_bytes), workers,
                            (backend.to_str(), eod, dtype.str, text_key))
    # closing(): a failure (e.g. --strict on a bad line) shuts the worker pool down at once.
    with contextlib.closing(results), IndexedDatasetWriter(output_prefix, dtype) as writer, \
            progress(total=os.path.getsize(input_path), desc="tokenize", unit="B") as bar:
        for tokens, lengths, block_counts, bad, chars, nbytes in results:
            for lineno, reason in bad:
                counts["malformed"] += 1
                report(lineno, reason)
            counts.update(block_counts)
            writer.add_documents(tokens, lengths)
            counts["docs"] += int(lengths.size)
            counts["tokens"] += int(tokens.size)
            num_chars += chars
            bar.update(nbytes)
    if counts["docs"] == 0:
        print(f"warning: {input_path} produced no documents (empty={counts['empty']}, "
              f"malformed={counts['malformed']}); {output_prefix}.bin is empty", file=sys.stderr)
    return write_tokenize_stats(input_path, tokenizer, output_prefix, text_key, counts, started, vocab, eod, dtype,
                                num_chars, workers=workers)


def write_tokenize_stats(input_path: str, tokenizer: str, output_prefix: str, text_key: str, counts: Counter,
                         started: float, vocab: int, eod: int, dtype, chars: int, **extra: Any) -> dict[str, Any]:
    """Write `PREFIX.stats.json`, the same for the in-process stage and the sharded tasks' merge (dist_stages.py):
    GPTDataset and train_gpt.py read `vocab_size`, `dtype` and `eod_id` from it."""
    seconds = time.time() - started
    # The tokenizer is an input too, and the .bin/.idx signatures are recorded, so `all` can tell a
    # complete output (same corpus, tokenizer and key; files untouched) from a stale one (is_complete).
    from data_pipeline.tokenizer import tokenizer_inputs

    return write_stats(output_prefix, "tokenize", counts, inputs=[input_path, *tokenizer_inputs(tokenizer)],
                       started=started,
                       params=_params(tokenizer, text_key), **extra,
                       output_signatures=[file_signature(p) for p in _outputs(output_prefix)],
                       tokenizer=os.path.abspath(tokenizer), vocab_size=vocab, eod_id=eod, dtype=np.dtype(dtype).name,
                       chars=chars, tokens_per_s=round(counts["tokens"] / max(seconds, 1e-9), 1),
                       skipped={"empty": counts["empty"], "malformed": counts["malformed"]})


def _params(tokenizer: str, text_key: str) -> dict[str, Any]:
    """What determines the tokens (workers and block size do not: the output is the same bytes)."""
    return {"tokenizer": os.path.abspath(tokenizer), "text_key": text_key}


def refuse_no_documents(counts: Counter, input_path: str, output_prefix: str, text_key: str) -> None:
    """A corpus whose every line is malformed (a .bin, a CSV, another key: the wrong file) is a mistake, not an
    empty dataset to train on: its outputs are removed (so `all` does not take them as complete) and the stage fails
    in one line. Empty documents alone stay a warning."""
    if counts["docs"] or not counts["malformed"]:
        return
    for path in (*_outputs(output_prefix), f"{output_prefix}.stats.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    raise ValueError(f"{input_path}: none of its lines is a document ({counts['malformed']} malformed, the first "
                     f"reported above), so no dataset was written; tokenize reads JSONL, one {{\"{text_key}\": "
                     f"\"...\"}} per line (--json-key names another field)")


def _outputs(prefix: str) -> list[str]:
    return [data_file_path(prefix), index_file_path(prefix)]


def is_complete(args: argparse.Namespace) -> bool:
    """True when PREFIX.bin/.idx and their stats are whole and were made from the same input, tokenizer
    (path and files) and key; `all` skips the stage then."""
    return _is_complete(args.output_prefix, params=_params(args.tokenizer, args.json_key),
                        outputs=_outputs(args.output_prefix))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tokenize", help="tokenize JSONL into Megatron .bin/.idx",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="JSONL with one document per line")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer directory (tokenizer.json, a sentencepiece tokenizer.model, or vocab.json + "
                        "merges.txt), e.g. the HF model's own directory, or a tokenizer.json file")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.stats.json")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: cores)")
    p.add_argument("--json-key", default="text", help="field holding the document text")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    stats = tokenize_file(args.input, args.tokenizer, args.output_prefix, workers=args.workers,
                          text_key=args.json_key, strict=args.strict)
    refuse_no_documents(stats["counts"], args.input, args.output_prefix, args.json_key)
    print(f"[tokenize] {stats['counts']['docs']} docs, {stats['counts']['tokens']} tokens, "
          f"{stats['tokens_per_s']:.0f} tokens/s -> {args.output_prefix}.bin/.idx ({stats['dtype']})")
    return 0
