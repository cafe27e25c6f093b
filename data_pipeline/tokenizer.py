"""Load a local tokenizer as a transformers fast tokenizer, and the id put between documents (EOD).

Accepts a model's own HF tokenizer directory (a tokenizer.json BPE as GPT-2, Llama-3 and Qwen ship, or a
sentencepiece tokenizer.model as Llama-2 ships, which transformers converts to a fast tokenizer), a GPT-2 style
directory with only vocab.json + merges.txt, or a path to a tokenizer.json file. Never downloads.
EOD is the tokenizer's own eos_token ("<|end_of_text|>" for Llama-3, "</s>" for Llama-2); `<|endoftext|>` only
when it names none (GPT-2 and the tokenizers `train-tokenizer` writes). Documents get EOS only, never BOS
(`eod_id` has no BOS twin): the EOS already marks each boundary in a packed sequence, as in Megatron's
`preprocess_data.py --append-eod` and NeMo's pretraining data, and GPT-2 data stays as it was.
Training lives in `train_tokenizer.py`, merging in `merge_tokenizers.py`.
"""
from __future__ import annotations

import json
import os
from typing import Any

EOD_TOKEN = "<|endoftext|>"

# tokenizer_config.json classes that use tokenizer.json as it is (others may rebuild the pipeline from its vocab)
_AS_IS_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_EXPECTED = ("need tokenizer.json (GPT-2, Llama-3, Qwen), tokenizer.model (sentencepiece, Llama-2) with "
             "tokenizer_config.json, or vocab.json + merges.txt")
_TRAIN_HINT = ("train one with `python -m data_pipeline train-tokenizer IN.jsonl --output DIR --vocab-size 50257`, "
               "or point at a model's tokenizer directory (tokenizer.json, tokenizer.model, or "
               "vocab.json + merges.txt)")


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
        path: a model's tokenizer directory that `AutoTokenizer.from_pretrained` reads offline, holding
            tokenizer.json (GPT-2, Llama-3, Qwen) or a sentencepiece tokenizer.model (Llama-2; converted to a
            fast tokenizer, which needs the `sentencepiece` package), a directory with GPT-2 style
            vocab.json + merges.txt, or a tokenizer.json file.

    Returns:
        A `PreTrainedTokenizerFast`-compatible tokenizer. If the tokenizer names no EOS and `<|endoftext|>`
        is in the vocabulary, EOS is set to it; `eod_id(tok)` gives the id used between documents.
        `len(tok)` counts added tokens (what an embedding must hold); `tok.vocab_size` does not.

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
            raise ValueError(f"tokenizer file {path} does not load: {_one_line(e)}; {_TRAIN_HINT}") from e
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path} does not exist; {_TRAIN_HINT}")
    files = set(os.listdir(path))
    bpe_files = {"vocab.json", "merges.txt"} <= files
    if not ({"tokenizer.json", "tokenizer.model"} & files or bpe_files):
        raise ValueError(f"tokenizer directory {path} holds no tokenizer files (found {sorted(files)[:10]}; "
                         f"{_EXPECTED}); {_TRAIN_HINT}")
    try:
        if {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"} & files:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            if not getattr(tok, "is_fast", False):
                raise ValueError(f"tokenizer in {path} has no fast (Rust) backend; save it with tokenizer.json")
            return _with_eos(tok)
        backend = byte_level_bpe_from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
        return _with_eos(wrap_fast(backend))
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"tokenizer directory {path} does not load: {_one_line(e)}; {_TRAIN_HINT}") from e
    except Exception as e:  # AutoTokenizer raises OSError, ImportError, json errors, tokenizers' Exception...
        hint = ("; converting a sentencepiece tokenizer.model needs `pip install sentencepiece protobuf`"
                if "tokenizer.model" in files and "tokenizer.json" not in files else "")
        raise ValueError(f"tokenizer directory {path} does not load: {type(e).__name__}: {_one_line(e)}{hint}; "
                         f"{_TRAIN_HINT}") from e


def tokenizer_inputs(path: str | None) -> list[str]:
    """What a stage that uses tokenizer `path` records as its inputs (stats.is_complete): the file, or the directory
    and its tokenizer files (.json, .txt, .model); a file edited in place leaves the directory's mtime as it was.
    None (a stage run without one): nothing."""
    if not path:
        return []
    if not os.path.isdir(path):
        return [path]
    return [path] + [os.path.join(path, n) for n in sorted(os.listdir(path))
                     if n.endswith((".json", ".txt", ".model")) and os.path.isfile(os.path.join(path, n))]


def load_backend(path: str, require_eod: bool = True):
    """The Rust `tokenizers.Tokenizer` of a tokenizer dir/file, without importing transformers when it can (fast start).

    Reads tokenizer.json (when its tokenizer_config.json, if any, uses it as it is and names only tokens it holds)
    or vocab.json + merges.txt directly, and goes through `load_tokenizer` for anything else (a sentencepiece
    tokenizer.model, a model-specific class, special tokens transformers would add), so the ids, the EOD and the
    size are always those of `load_tokenizer(path)`. Returns (backend, eod_id, vocab_size): eod_id as `eod_id`
    gives it, None only with require_eod=False; vocab_size counts added tokens (len(tokenizer)).
    Raises ValueError naming `path` like `load_tokenizer`.
    """
    from tokenizers import Tokenizer

    path = os.fspath(path)
    is_file = os.path.isfile(path)
    json_file = path if is_file else os.path.join(path, "tokenizer.json")
    config = {} if is_file else _read_config(path)
    backend = None
    try:
        if os.path.isfile(json_file):
            if config is not None and _uses_json_as_is(path, config):
                backend = Tokenizer.from_file(json_file)
        elif os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")) \
                and not os.path.isfile(os.path.join(path, "tokenizer.model")):
            backend = byte_level_bpe_from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"tokenizer {path} does not load: {type(e).__name__}: {_one_line(e)}; {_TRAIN_HINT}") from e
    if backend is not None and config is not None and _holds_special_tokens(backend, config):
        eos = _token_content(config.get("eos_token"))
        eod = backend.token_to_id(eos or EOD_TOKEN)
        vocab = int(backend.get_vocab_size(with_added_tokens=True))
        if eod is not None:
            return backend, int(eod), vocab
        if not require_eod and eos is None:  # e.g. cleanup's length count: no EOD needed
            return backend, None, vocab
    # transformers resolves the class, its added tokens and eos (and raises the one-line errors)
    tok = load_tokenizer(path)
    backend, vocab = tok.backend_tokenizer, vocab_size(tok)
    if not require_eod and tok.eos_token_id is None and EOD_TOKEN not in tok.get_vocab():
        return backend, None, vocab
    return backend, eod_id(tok), vocab


def _read_config(path: str) -> dict | None:
    """tokenizer_config.json of directory `path`: {} when there is none, None when unreadable (transformers says)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _uses_json_as_is(path: str, config: dict) -> bool:
    """Whether AutoTokenizer would use `path`'s tokenizer.json unchanged: a generic class, or no config at all."""
    if not config:  # no tokenizer_config.json: a model's config.json could still pick a model-specific class
        return os.path.isfile(path) or not os.path.isfile(os.path.join(path, "config.json"))
    return config.get("tokenizer_class") in _AS_IS_CLASSES


def _token_content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it (a string, or an AddedToken dict), as its text."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _holds_special_tokens(backend, config: dict) -> bool:
    """Whether every token tokenizer_config.json names is in `backend` already, at its recorded id (otherwise
    transformers adds it on load, and the ids and the size must come from there)."""
    named = [v for k, v in config.items() if k.endswith("_token")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named += list(extra.values()) if isinstance(extra, dict) else list(extra)
    if any(name is not None and backend.token_to_id(name) is None for name in map(_token_content, named)):
        return False
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.token_to_id(_token_content(token) or "") != int(token_id):
            return False
    return True


def _one_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several)."""
    return " ".join(str(e).split())


def _with_eos(tok):
    """Default EOS to `<|endoftext|>` when the vocabulary has it and no EOS was configured."""
    if tok.eos_token is None and tok.convert_tokens_to_ids(EOD_TOKEN) not in (None, tok.unk_token_id):
        tok.eos_token = EOD_TOKEN
    return tok


def eod_id(tok) -> int:
    """The document separator id: the tokenizer's eos_token, else `<|endoftext|>` (the GPT-2 default).

    Raises ValueError when the tokenizer has neither, since packed samples need a separator.
    """
    eos = tok.eos_token_id
    if eos is not None and not (eos == tok.unk_token_id and tok.eos_token != tok.unk_token):  # not a stand-in unk
        return int(eos)
    vocab = tok.get_vocab()
    if EOD_TOKEN in vocab:
        return int(vocab[EOD_TOKEN])
    raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r} has no {EOD_TOKEN} and no eos_token; "
                     f"documents need a separator: set eos_token in its tokenizer_config.json, add {EOD_TOKEN} "
                     f"as a special token, or {_TRAIN_HINT}")


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
    from data_pipeline.files import atomic_dir

    with atomic_dir(out_dir) as tmp_dir:
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
    return files
