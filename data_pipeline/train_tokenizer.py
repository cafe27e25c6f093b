"""Stage `train-tokenizer`: train a GPT-2 style byte-level BPE on a JSONL corpus with HF `tokenizers`.

Streams the texts into the Rust trainer (the corpus is never held in Python memory; the trainer keeps
word counts), puts `<|endoftext|>` at id 0 as EOS/BOS/UNK, and saves a directory that
`transformers.AutoTokenizer.from_pretrained(DIR)` and `data_pipeline.load_tokenizer(DIR)` load offline:
tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json, merges.txt.
Stats go to `DIR.stats.json`.

    python -m data_pipeline train-tokenizer webtext.jsonl --output runs/tokenizer --vocab-size 50257
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from typing import Iterable, Iterator

from data_pipeline.cli_args import add_common_args, check_input
from data_pipeline.jsonl import iter_jsonl
from data_pipeline.stats import write_stats, written_by
from data_pipeline.stats import is_complete as _is_complete
from data_pipeline.tokenizer import EOD_TOKEN, save_tokenizer_dir
from data_pipeline.workers import progress

BATCH_DOCS = 1000  # texts handed to the Rust trainer per iterator step


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                         special_tokens: list[str] | None = None):
    """Train a byte-level BPE `tokenizers.Tokenizer` (GPT-2 pre-tokenization, no prefix space).

    All 256 byte symbols are in the initial alphabet, so any text encodes without unknown tokens.
    `special_tokens` (default `[<|endoftext|>]`) take the first ids. `texts` may be any iterable of
    strings or of lists of strings.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special_tokens = special_tokens or [EOD_TOKEN]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                         f"{len(alphabet) + len(special_tokens)} (256 bytes + {len(special_tokens)} special tokens)")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                  initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def _text_batches(path: str, key: str, counts: Counter, strict: bool) -> Iterator[list[str]]:
    """Lists of non-empty texts from a JSONL file; counts docs/empty/malformed as it goes."""
    batch: list[str] = []
    with progress(desc="train-tokenizer", unit="doc") as bar:
        for _, record, _ in iter_jsonl(path, counts, strict, text_key=key):
            bar.update(1)
            text = record[key]
            if not text.strip():
                counts["empty"] += 1
                continue
            counts["docs"] += 1
            counts["chars"] += len(text)
            batch.append(text)
            if len(batch) == BATCH_DOCS:
                yield batch
                batch = []
    if batch:
        yield batch


def train_tokenizer(input_path: str, output_dir: str, vocab_size: int = 50257, min_frequency: int = 2,
                    text_key: str = "text", strict: bool = False) -> dict:
    """Train on `input_path` (JSONL) and save a loadable tokenizer directory at `output_dir`, atomically.

    Returns the stats dict (docs, chars, empty, malformed, final vocab size), also written to
    `output_dir.stats.json`. The final vocabulary can be smaller than `vocab_size` on a small corpus.

    Example:
        >>> train_tokenizer("train.jsonl", "runs/tok", vocab_size=8192)["vocab_size"]   # doctest: +SKIP
        8192
    """
    started = time.time()
    check_input(input_path)
    counts: Counter = Counter(docs=0, chars=0, empty=0, malformed=0)
    backend = train_byte_level_bpe(_text_batches(input_path, text_key, counts, strict), vocab_size, min_frequency)
    if counts["docs"] == counts["empty"] == counts["malformed"] == 0:
        raise ValueError(f"{input_path} holds no documents to train a tokenizer on{written_by(input_path)}; "
                         f"fix the stage that produced nothing and re-run it")
    if counts["docs"] == 0:
        raise ValueError(f"{input_path} has no non-empty {text_key!r} texts to train a tokenizer on "
                         f"(empty={counts['empty']}, malformed={counts['malformed']}); check --json-key")
    output_dir = os.path.abspath(output_dir.rstrip("/"))
    files = save_tokenizer_dir(backend, output_dir)
    return write_stats(output_dir, "train-tokenizer", counts, inputs=[input_path], started=started,
                       params=_params(vocab_size, min_frequency, text_key),
                       vocab_size=backend.get_vocab_size(), requested_vocab_size=vocab_size,
                       eod_token=EOD_TOKEN, eod_id=backend.token_to_id(EOD_TOKEN), files=files)


def _params(vocab_size: int, min_frequency: int, text_key: str) -> dict:
    return {"vocab_size": vocab_size, "min_frequency": min_frequency, "text_key": text_key}


def is_complete(args: argparse.Namespace) -> bool:
    """True when DIR and DIR.stats.json are whole, made with these settings from the unchanged corpus;
    `all` skips the stage then."""
    return _is_complete(os.path.abspath(args.output.rstrip("/")),
                        params=_params(args.vocab_size, args.min_frequency, args.json_key))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="JSONL with one document per line")
    p.add_argument("--output", required=True, help="tokenizer directory to write")
    p.add_argument("--vocab-size", type=int, default=50257, help="target vocabulary size incl. <|endoftext|>")
    p.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge")
    p.add_argument("--json-key", default="text", help="field holding the document text")
    add_common_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    stats = train_tokenizer(args.input, args.output, args.vocab_size, args.min_frequency, args.json_key, args.strict)
    print(f"[train-tokenizer] vocab {stats['vocab_size']} from {stats['counts']['docs']} docs -> {args.output}")
    return 0
