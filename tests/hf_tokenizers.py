"""Tokenizer directories shaped like the ones Llama-3, Qwen2 and Llama-2 ship, built locally in well under a second.

Each helper trains a small tokenizer (HF `tokenizers` byte-level BPE, or `sentencepiece` BPE) on generated text and
writes the files the model's own Hub directory holds, so `AutoTokenizer.from_pretrained(dir)` and
`data_pipeline.load_tokenizer(dir)` load it offline. Named hf_tokenizers.py, not tokenizers.py, so that it can
never shadow the `tokenizers` package. Example, in any test:

    from tests.hf_tokenizers import llama3_tokenizer_dir
    tok_dir = llama3_tokenizer_dir(tmp_path / "tok", vocab_size=512)   # len(AutoTokenizer...(tok_dir)) == 512
"""
from __future__ import annotations

import json
import os

# Llama-3's pre-tokenizer split (its tokenizer.json), ahead of a byte-level step with no regex of its own.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_WORDS = ("the quick brown fox jumps over lazy dogs while seven wizards quietly judge boxing matches near "
          "old river banks and data flows through sharded optimizer states on every rank").split()


def sample_texts(n: int = 300) -> list[str]:
    """`n` deterministic lines of English-like text with digits, punctuation, newlines and non-ASCII letters."""
    texts = []
    for i in range(n):
        words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(6 + i % 9)]
        tail = ("Ünïcode café, naïve 東京." if i % 4 == 0 else f"step {i * 37 % 1000}: loss {i % 13}.{i % 7}")
        texts.append(" ".join(words).capitalize() + ("\n" if i % 5 == 0 else " ") + tail)
    return texts


_OTHER_WORDS = ("zebra xylophone quantum glacier harbor violin orchestra telescope galaxy nebula comet asteroid "
                "saxophone volcano").split()
NEW_WORDS = "The zebra plays a xylophone by the glacier"  # other_texts()'s words: B's tokens encode them, A's do not


def other_texts(n: int = 300) -> list[str]:
    """`n` deterministic lines on other words than `sample_texts`: train the second tokenizer of a merge on them, and
    its whole-word tokens ("Ġzebra", "▁xylophone", ...) are ones a tokenizer trained on `sample_texts` lacks."""
    return [" ".join(_OTHER_WORDS[(i * 5 + j * 2) % len(_OTHER_WORDS)] for j in range(5 + i % 7)).capitalize()
            + f" {i % 100}." for i in range(n)]


def _byte_level_bpe(texts: list[str], base_size: int, split_regex: str | None):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `base_size` ids (256 bytes + merges), no specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    if split_regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1, show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    assert backend.get_vocab_size() == base_size, (backend.get_vocab_size(), base_size, "corpus too small")
    return backend


def _write_config(out_dir: str, config: dict, specials: dict[str, int]) -> None:
    """tokenizer_config.json as the Hub's files have it: the classes, the special tokens and added_tokens_decoder."""
    config = {**config, "model_max_length": 131072, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True}
                                       for t, i in specials.items()}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    named = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(named, f, indent=2)


def llama3_tokenizer_dir(out_dir, vocab_size: int = 400, texts: list[str] | None = None) -> str:
    """A Llama-3 style directory: byte-level BPE tokenizer.json with Llama-3's split regex, `<|begin_of_text|>`
    and `<|end_of_text|>` added after the base vocabulary (as Llama-3's ids 128000/128001), BOS prepended by the
    post-processor when encoding with special tokens, class PreTrainedTokenizerFast, eos `<|end_of_text|>`, and
    no `<|endoftext|>`. len(tokenizer) == vocab_size (base vocab_size - 2 + 2 specials). Returns the path.
    """
    from tokenizers import processors

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    backend = _byte_level_bpe(texts or sample_texts(), vocab_size - 2, LLAMA3_SPLIT)
    backend.add_special_tokens([LLAMA3_BOS, LLAMA3_EOS])
    bos = backend.token_to_id(LLAMA3_BOS)
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{LLAMA3_BOS}:0 $A:0", pair=f"{LLAMA3_BOS}:0 $A:0 {LLAMA3_BOS}:1 $B:1",
                                      special_tokens=[(LLAMA3_BOS, bos)])])
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    _write_config(out_dir, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": LLAMA3_BOS,
                            "eos_token": LLAMA3_EOS},
                  {t: backend.token_to_id(t) for t in (LLAMA3_BOS, LLAMA3_EOS)})
    return out_dir


def qwen2_tokenizer_dir(out_dir, vocab_size: int = 400, eos_token: str = "<|im_end|>",
                        texts: list[str] | None = None) -> str:
    """A Qwen2/2.5 style directory: byte-level BPE tokenizer.json with `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>` added after the base vocabulary, class Qwen2Tokenizer (which transformers may rebuild from the
    vocab and merges with its own split regex), no BOS, pad `<|endoftext|>`, and eos `<|im_end|>` as the
    Instruct models ship it (pass eos_token="<|endoftext|>" for a base model). len(tokenizer) == vocab_size.
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    backend = _byte_level_bpe(texts or sample_texts(), vocab_size - len(QWEN_SPECIALS), LLAMA3_SPLIT)
    backend.add_special_tokens(list(QWEN_SPECIALS))
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    _write_config(out_dir, {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": eos_token,
                            "pad_token": "<|endoftext|>", "unk_token": None},
                  {t: backend.token_to_id(t) for t in QWEN_SPECIALS})
    return out_dir


def llama2_tokenizer_dir(out_dir, vocab_size: int = 384, texts: list[str] | None = None) -> str:
    """A Llama-2 style directory: a sentencepiece BPE tokenizer.model trained with Llama-2's options (byte
    fallback, split digits, identity normalization, dummy prefix; `<unk>`=0, `<s>`=1, `</s>`=2) and a
    LlamaTokenizer tokenizer_config.json, no tokenizer.json: transformers converts it to a fast tokenizer.
    len(tokenizer) == vocab_size, which must leave room past the 259 byte and control pieces for the corpus'
    characters (about 60 in `sample_texts`) plus merges. Returns the path.
    """
    import io

    import sentencepiece as spm

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts or sample_texts()), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, split_digits=True, character_coverage=0.9995,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    _write_config(out_dir, {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                            "unk_token": "<unk>", "pad_token": None, "add_bos_token": True, "add_eos_token": False},
                  {"<unk>": 0, "<s>": 1, "</s>": 2})
    return out_dir
