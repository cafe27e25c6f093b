"""Tokenization throughput: zerogpt's `tokenize` stage vs a single-process HF tokenizer loop and
`datasets.map(batched=True, num_proc=2)`, on the same real-text corpus; then GPTDataset read speed.

    python bench/tokenize_throughput.py                       # ~8 MB corpus, 16k-token BPE, 3 rounds
    python bench/tokenize_throughput.py --corpus-mb 4 --rounds 2 --json /tmp/tokenize_bench.json

Corpus: real English text available offline, built deterministically from this Python installation
(docstrings of every stdlib and site-packages module, one document per module, plus .rst/.md/.txt
files), cut at --corpus-mb. Tokenizer: a byte-level BPE trained on it with our `train-tokenizer`.
Every method goes from the JSONL file on disk to token ids with EOD per document and must produce the
same number of tokens; ours also writes the .bin/.idx. Methods run round-robin (the VM is shared, so
background load hits all alike) and the best round is reported, with the median in brackets.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import ast  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from data_pipeline.files import atomic_write  # noqa: E402


def build_corpus(path: str, target_mb: float) -> dict:
    """Write a JSONL of real text from the installed Python (deterministic order) up to `target_mb`."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    docs = chars = 0
    limit = int(target_mb * 1e6)
    with open(path, "w", encoding="utf-8") as out:
        for root in roots:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    text = _document(os.path.join(dirpath, name))
                    if text and len(text) > 200:
                        out.write(json.dumps({"text": text, "url": os.path.join(dirpath, name)}) + "\n")
                        docs, chars = docs + 1, chars + len(text)
                        if chars >= limit:
                            return {"docs": docs, "chars": chars}
    return {"docs": docs, "chars": chars}


def _document(path: str) -> str | None:
    try:
        if os.path.getsize(path) > 2_000_000:
            return None
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    if path.endswith((".rst", ".md", ".txt")):
        return source
    if path.endswith(".py"):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return None
        nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                            ast.AsyncFunctionDef)))
        return "\n\n".join(d for d in (ast.get_docstring(n) for n in nodes) if d)
    return None


# ---------------------------------------------------------------- methods: JSONL on disk -> token ids
def run_ours(corpus: str, tok_dir: str, workdir: str, workers: int) -> int:
    from data_pipeline.tokenize_stage import tokenize_file

    stats = tokenize_file(corpus, tok_dir, os.path.join(workdir, "ours"), workers=workers)
    return stats["counts"]["tokens"]


def run_hf_loop(corpus: str, tok) -> int:
    eos, total, out = tok.eos_token_id, 0, []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            ids = tok(json.loads(line)["text"])["input_ids"]
            ids.append(eos)
            out.append(ids)
            total += len(ids)
    return total


def run_datasets_map(corpus: str, tok, workdir: str, num_proc: int) -> tuple[int, float]:
    """Returns (tokens, seconds spent in .map alone); load_dataset's Arrow conversion is in the total."""
    import datasets

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(dir=workdir, prefix="hf-cache-")  # fresh: never a cache hit
    ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    eos = tok.eos_token_id

    def encode(batch):
        return {"input_ids": [ids + [eos] for ids in tok(batch["text"])["input_ids"]]}

    started = time.perf_counter()
    mapped = ds.map(encode, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    map_s = time.perf_counter() - started
    total = sum(len(ids) for ids in mapped["input_ids"])
    shutil.rmtree(cache, ignore_errors=True)
    return total, map_s


# ---------------------------------------------------------------- dataloader
def bench_dataset(prefix: str, seq_len: int, max_samples: int) -> dict:
    import numpy as np
    import torch

    from data_pipeline.dataset import GPTDataset

    started = time.perf_counter()
    ds = GPTDataset(prefix, seq_len=seq_len, splits="1,0,0", cache_dir=os.path.join(os.path.dirname(prefix), "ic"))
    build_s = time.perf_counter() - started
    n = min(len(ds), max_samples)
    order = np.random.default_rng(0).permutation(len(ds))[:n]
    started = time.perf_counter()
    for i in order:
        ds[int(i)]
    getitem = n / (time.perf_counter() - started)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, order.tolist()), batch_size=8, num_workers=0)
    started = time.perf_counter()
    for _ in loader:
        pass
    loader_rate = n / (time.perf_counter() - started)
    return {"seq_len": seq_len, "samples": len(ds), "index_build_s": round(build_s, 3),
            "getitem_samples_per_s": round(getitem), "dataloader_samples_per_s": round(loader_rate),
            "dataloader_tokens_per_s": round(loader_rate * seq_len)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-mb", type=float, default=8.0, help="corpus size in MB of text")
    p.add_argument("--vocab-size", type=int, default=16384, help="BPE vocabulary trained on the corpus")
    p.add_argument("--workers", type=int, default=2, help="processes for ours and for datasets.map num_proc")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds; best and median are reported")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zerogpt-bench-tokenize"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, f"corpus-{args.corpus_mb:g}mb.jsonl")
    if not os.path.exists(corpus):
        print(f"building corpus {corpus} ...", file=sys.stderr)
        build_corpus(corpus, args.corpus_mb)
    with open(corpus, encoding="utf-8") as f:
        docs = sum(1 for _ in f)
    tok_dir = os.path.join(args.workdir, f"tok-{args.corpus_mb:g}mb-{args.vocab_size}")
    if not os.path.isdir(tok_dir):
        from data_pipeline.train_tokenizer import train_tokenizer
        train_tokenizer(corpus, tok_dir, vocab_size=args.vocab_size)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)

    methods = {
        f"zerogpt tokenize (workers={args.workers}, writes .bin/.idx)":
            lambda: (run_ours(corpus, tok_dir, args.workdir, args.workers), None),
        "HF tokenizer loop (1 process, tok(text) per doc)": lambda: (run_hf_loop(corpus, tok), None),
        f"datasets load_dataset + map (batched, num_proc={args.workers})":
            lambda: run_datasets_map(corpus, tok, args.workdir, args.workers),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    map_only: list[float] = []
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        names = list(methods)
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
            started = time.perf_counter()
            count, extra = methods[name]()
            times[name].append(time.perf_counter() - started)
            tokens[name] = count
            if extra is not None:
                map_only.append(extra)
            print(f"round {r}: {name}: {times[name][-1]:.2f}s", file=sys.stderr)
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"methods disagree on the token count: {tokens}")
    total = next(iter(tokens.values()))

    rows = []
    for name, ts in times.items():
        rows.append({"method": name, "best_s": round(min(ts), 3), "median_s": round(statistics.median(ts), 3),
                     "tokens_per_s": round(total / min(ts)), "median_tokens_per_s": round(total / statistics.median(ts))})
    if map_only:
        rows.append({"method": f"  (of which .map alone, num_proc={args.workers})", "best_s": round(min(map_only), 3),
                     "median_s": round(statistics.median(map_only), 3), "tokens_per_s": round(total / min(map_only)),
                     "median_tokens_per_s": round(total / statistics.median(map_only))})
    ours = rows[0]["tokens_per_s"]
    best_baseline = max(r["tokens_per_s"] for r in rows[1:])
    dataset = [bench_dataset(os.path.join(args.workdir, "ours"), seq_len, 4000) for seq_len in (1024, 128)]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ncorpus: {docs} docs, {os.path.getsize(corpus) / 1e6:.1f} MB JSONL, {total} tokens "
          f"(vocab {len(tok)}), {os.cpu_count()} CPUs, load average {load:.1f}\n")
    print("| method | best s (median) | tokens/s best (median) | vs ours |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['best_s']:.2f} ({r['median_s']:.2f}) | {r['tokens_per_s']:,} "
              f"({r['median_tokens_per_s']:,}) | {ours / r['tokens_per_s']:.2f}x |")
    print(f"\nours / best baseline: {ours / best_baseline:.2f}x (goal >= 1.5x)\n")
    print("| GPTDataset seq_len | samples | index build s | getitem samples/s | DataLoader(bs=8) samples/s | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for d in dataset:
        print(f"| {d['seq_len']} | {d['samples']} | {d['index_build_s']} | {d['getitem_samples_per_s']:,} | "
              f"{d['dataloader_samples_per_s']:,} | {d['dataloader_tokens_per_s']:,} |")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"docs": docs, "tokens": total, "cpus": os.cpu_count(), "load_average": load, "rows": rows,
                       "ours_over_best_baseline": round(ours / best_baseline, 3), "dataset": dataset}, f, indent=2)


if __name__ == "__main__":
    main()
