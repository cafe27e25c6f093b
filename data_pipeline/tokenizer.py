"""Load a local tokenizer as a transformers fast tokenizer, with `<|endoftext|>` as EOS/EOD.

Accepts a HF tokenizer directory (tokenizer.json and/or tokenizer_config.json), a GPT-2 style
directory with only vocab.json + merges.txt, or a path to a tokenizer.json file. Never downloads.
Training lives in `train_tokenizer.py`, merging in `merge_tokenizers.py`.
"""
from __future__ import annotations

import json
import os
from typing import Any

EOD_TOKEN = "<|endoftext|>"

_TRAIN_HINT = ("train one with `python -m data_pipeline train-tokenizer IN.jsonl --output DIR --vocab-size 50257`, "
               "or point at a directory holding tokenizer.json, or vocab.json + merges.txt")


def byte_level_bpe_from_files(vocab_file: str, merges_file: str):
    """A `tokenizers.Tokenizer` for a GPT-2 style vocab.json + merges.txt (byte-level BPE, no prefix space)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    backend = Tokenizer(models.BPE.from_file(vocab_file, merges_file))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if backend.token_to_id(EOD_TOKEN) is not None:
        # Registered as special so "<|endoftext|>" in text maps to the EOD id, as GPT-2's tokenizer does.
        backend.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    return backend


def wrap_fast(backend, **special_tokens: Any):
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer with EOD as eos/bos/unk."""
    from transformers import PreTrainedTokenizerFast

    if backend.token_to_id(EOD_TOKEN) is not None:
        for key in ("eos_token", "bos_token", "unk_token"):
            special_tokens.setdefault(key, EOD_TOKEN)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def load_tokenizer(path: str):
    """Load a local tokenizer as a transformers fast tokenizer.

    Args:
        path: a directory with tokenizer.json / tokenizer_config.json (anything
            `AutoTokenizer.from_pretrained` reads offline), a directory with GPT-2 style
            vocab.json + merges.txt, or a tokenizer.json file.

    Returns:
        A `PreTrainedTokenizerFast`-compatible tokenizer. If `<|endoftext|>` is in the vocabulary and
        the tokenizer names no EOS, EOS is set to it; `eod_id(tok)` gives the id used between documents.

    Raises:
        ValueError naming `path` when it is missing, holds no tokenizer files, or fails to load.

    Example:
        >>> tok = load_tokenizer("runs/tokenizer")           # doctest: +SKIP
        >>> tok("hello")["input_ids"], eod_id(tok)            # doctest: +SKIP
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".json"):
        from tokenizers import Tokenizer
        try:
            return _with_eos(wrap_fast(Tokenizer.from_file(path)))
        except Exception as e:  # tokenizers raises its own Exception type for bad files
            raise ValueError(f"tokenizer file {path} does not load: {e}; {_TRAIN_HINT}") from e
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path} does not exist; {_TRAIN_HINT}")
    files = set(os.listdir(path))
    try:
        if "tokenizer.json" in files or "tokenizer_config.json" in files:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            if not getattr(tok, "is_fast", False):
                raise ValueError(f"tokenizer in {path} has no fast (Rust) backend; save it with tokenizer.json")
            return _with_eos(tok)
        if {"vocab.json", "merges.txt"} <= files:
            backend = byte_level_bpe_from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
            return _with_eos(wrap_fast(backend))
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"tokenizer directory {path} does not load: {e}; {_TRAIN_HINT}") from e
    except Exception as e:  # AutoTokenizer raises OSError, json errors, tokenizers' Exception...
        raise ValueError(f"tokenizer directory {path} does not load: {type(e).__name__}: {e}; {_TRAIN_HINT}") from e
    raise ValueError(f"tokenizer directory {path} holds no tokenizer files (found {sorted(files)[:10]}; need "
                     f"tokenizer.json, or vocab.json + merges.txt); {_TRAIN_HINT}")


def load_backend(path: str, require_eod: bool = True):
    """The Rust `tokenizers.Tokenizer` of a tokenizer dir/file, without importing transformers (fast start).

    Reads tokenizer.json or vocab.json + merges.txt directly and falls back to `load_tokenizer` for
    anything else. Returns (backend, eod_id, vocab_size); eod_id is None only with require_eod=False.
    Raises ValueError naming `path` like `load_tokenizer`.
    """
    from tokenizers import Tokenizer

    path = os.fspath(path)
    json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    backend = None
    try:
        if os.path.isfile(json_file):
            backend = Tokenizer.from_file(json_file)
        elif os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")):
            backend = byte_level_bpe_from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"tokenizer {path} does not load: {type(e).__name__}: {e}; {_TRAIN_HINT}") from e
    eod = None if backend is None else backend.token_to_id(EOD_TOKEN)
    if backend is not None and eod is None and not require_eod:  # e.g. cleanup's length count: no EOD needed
        return backend, None, int(backend.get_vocab_size(with_added_tokens=True))
    if eod is None:  # not a plain tokenizer.json, or no <|endoftext|>: let transformers resolve eos
        tok = load_tokenizer(path)
        backend, vocab = tok.backend_tokenizer, vocab_size(tok)
        if not require_eod and tok.eos_token_id is None and EOD_TOKEN not in tok.get_vocab():
            return backend, None, vocab
        return backend, eod_id(tok), vocab
    return backend, int(eod), int(backend.get_vocab_size(with_added_tokens=True))


def _with_eos(tok):
    """Default EOS to `<|endoftext|>` when the vocabulary has it and no EOS was configured."""
    if tok.eos_token is None and tok.convert_tokens_to_ids(EOD_TOKEN) not in (None, tok.unk_token_id):
        tok.eos_token = EOD_TOKEN
    return tok


def eod_id(tok) -> int:
    """The document separator id: `<|endoftext|>` if present, else the tokenizer's EOS.

    Raises ValueError when the tokenizer has neither, since packed samples need a separator.
    """
    vocab = tok.get_vocab()
    if EOD_TOKEN in vocab:
        return int(vocab[EOD_TOKEN])
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r} has no {EOD_TOKEN} and no eos_token; "
                     f"documents need a separator: add {EOD_TOKEN} as a special token or {_TRAIN_HINT}")


def vocab_size(tok) -> int:
    """Number of ids the tokenizer can emit (base vocab plus added tokens): the size an embedding needs."""
    return len(tok)


def backend_json(tok) -> str:
    """The Rust tokenizer serialized as JSON: how the tokenizer is shipped to worker processes."""
    return tok.backend_tokenizer.to_str()


def save_tokenizer_dir(backend, out_dir: str) -> list[str]:
    """Save a byte-level BPE `tokenizers.Tokenizer` as a directory AutoTokenizer loads offline, atomically.

    Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json (for transformers 4.x),
    and GPT-2 style vocab.json + merges.txt (for tools that read those) into a temporary directory
    that then replaces `out_dir`. Returns the file names.
    """
    import shutil

    out_dir = os.path.abspath(os.fspath(out_dir).rstrip("/"))
    tmp_dir, old_dir = f"{out_dir}.tmp-{os.getpid()}", f"{out_dir}.old-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        tok = wrap_fast(backend)
        tok.save_pretrained(tmp_dir)
        config_path = os.path.join(tmp_dir, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        # A class name every transformers version resolves to "use tokenizer.json as is".
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.pop("backend", None)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        specials = {k: config[k] for k in ("bos_token", "eos_token", "unk_token") if config.get(k)}
        with open(os.path.join(tmp_dir, "special_tokens_map.json"), "w") as f:
            json.dump(specials, f, indent=2)
        backend.model.save(tmp_dir)
        files = sorted(os.listdir(tmp_dir))
        if os.path.isdir(out_dir):
            os.replace(out_dir, old_dir)
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(old_dir, ignore_errors=True)
    return files
