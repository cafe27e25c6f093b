"""Small corpora with known near-duplicates, for the dedup tests (single-process and sharded)."""
from __future__ import annotations

import json
import random


def real_docs(n: int, words: int = 120) -> list[str]:
    """n distinct chunks of real English prose (the stdlib's language-reference topics)."""
    import pydoc_data.topics

    text = " ".join(v for _, v in sorted(pydoc_data.topics.topics.items()))
    tokens = text.split()
    return [" ".join(tokens[i * words:(i + 1) * words]) for i in range(n)]


def edit(text: str, rate: float, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), int(rate * len(words))):
        words[i] = rng.choice(["alpha", "beta", "gamma", "delta", "omega"])
    return " ".join(words)


def write_docs(path, texts):
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "url": f"https://example.com/{i}"}) + "\n")
    return path
