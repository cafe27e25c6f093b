"""Stage `merge-tokenizers`: extend byte-level BPE tokenizer A with the vocabulary and merges of B.

A's ids and merge order are kept exactly (a model trained with A keeps its embeddings); B's tokens that
A lacks get new ids after A's largest id, in B's id order, and B's merges that A lacks are appended after
A's (so they apply only where A's merges leave pieces B knows how to join). The output directory loads
with `transformers.AutoTokenizer.from_pretrained(DIR)`; grow the model's embedding to the new size.

    python -m data_pipeline merge-tokenizers runs/tok_web runs/tok_code --out runs/tok_web_code
"""
from __future__ import annotations

import argparse
import json
import os
import time

from data_pipeline.stats import write_stats
from data_pipeline.tokenizer import load_backend, save_tokenizer_dir


def _bpe_json(path: str) -> dict:
    """tokenizer.json of `path` as a dict; ValueError unless it is a byte-level BPE."""
    backend, _, _ = load_backend(path, require_eod=False)
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer {path} is a {model.get('type')} model; merge-tokenizers merges byte-level "
                         "BPE tokenizers (GPT-2 style) only")
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ValueError(f"tokenizer {path} has no ByteLevel pre-tokenizer ({spec.get('pre_tokenizer')}); "
                         "merge-tokenizers merges byte-level BPE tokenizers (GPT-2 style) only")
    return spec


def _pairs(merges: list) -> list[tuple[str, str]]:
    """Merges as (left, right) pairs; tokenizer.json stores either "a b" strings or [a, b] lists."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]


def merge_specs(spec_a: dict, spec_b: dict) -> tuple[dict, dict]:
    """Merge two byte-level BPE tokenizer.json dicts (A's ids first). Returns (merged spec, counts)."""
    vocab_a: dict[str, int] = spec_a["model"]["vocab"]
    vocab_b: dict[str, int] = spec_b["model"]["vocab"]
    added_a = {t["content"]: t["id"] for t in spec_a.get("added_tokens", [])}
    vocab = dict(vocab_a)
    next_id = max([*vocab_a.values(), *added_a.values(), -1]) + 1
    new_tokens = 0
    for token, _ in sorted(vocab_b.items(), key=lambda kv: kv[1]):
        if token not in vocab and token not in added_a:
            vocab[token] = next_id
            next_id += 1
            new_tokens += 1

    merges = _pairs(spec_a["model"]["merges"])
    known = set(merges)
    new_merges = 0
    for pair in _pairs(spec_b["model"]["merges"]):
        if pair not in known:
            # B's vocab holds both pieces and their join, and all of B's vocab is now in `vocab`.
            assert pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab, pair
            merges.append(pair)
            known.add(pair)
            new_merges += 1

    added = [dict(t) for t in spec_a.get("added_tokens", [])]
    for t in spec_b.get("added_tokens", []):
        if t["content"] in added_a:
            continue
        token_id = vocab.get(t["content"])
        if token_id is None:  # an added token outside B's model vocab: give it the next free id
            token_id, next_id = next_id, next_id + 1
        added.append({**t, "id": token_id})
        new_tokens += t["content"] not in vocab

    merged = json.loads(json.dumps(spec_a))
    merged["model"]["vocab"] = vocab
    merged["model"]["merges"] = [list(p) for p in merges]
    merged["added_tokens"] = sorted(added, key=lambda t: t["id"])
    counts = {"vocab_a": len(vocab_a), "vocab_b": len(vocab_b), "new_tokens": new_tokens,
              "new_merges": new_merges, "vocab": next_id}
    return merged, counts


def merge_tokenizers(a: str, b: str, out_dir: str) -> dict:
    """Merge tokenizer dir `b` into `a`, save at `out_dir` (atomically); returns stats (also `out_dir.stats.json`).

    Example:
        >>> merge_tokenizers("runs/tok_web", "runs/tok_code", "runs/tok_both")["counts"]["vocab"]   # doctest: +SKIP
        58112
    """
    from tokenizers import Tokenizer

    started = time.time()
    merged, counts = merge_specs(_bpe_json(a), _bpe_json(b))
    backend = Tokenizer.from_str(json.dumps(merged))
    out_dir = os.path.abspath(out_dir.rstrip("/"))
    save_tokenizer_dir(backend, out_dir)
    return write_stats(out_dir, "merge-tokenizers", counts, started=started,
                       tokenizers=[os.path.abspath(a), os.path.abspath(b)],
                       vocab_size=backend.get_vocab_size(with_added_tokens=True))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("merge-tokenizers", help="merge tokenizer vocabularies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="base tokenizer directory: its ids stay unchanged")
    p.add_argument("b", help="tokenizer directory whose new tokens and merges are appended")
    p.add_argument("--out", required=True, help="merged tokenizer directory to write")
    return p


def run(args: argparse.Namespace) -> int:
    stats = merge_tokenizers(args.a, args.b, args.out)
    c = stats["counts"]
    print(f"[merge-tokenizers] {c['vocab_a']} + {c['new_tokens']} new tokens, +{c['new_merges']} merges "
          f"-> vocab {stats['vocab_size']} at {args.out}")
    return 0
