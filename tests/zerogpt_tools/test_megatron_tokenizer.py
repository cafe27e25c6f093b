"""The tokenizer a Megatron checkpoint names: its Hugging Face bos/eos ids survive Megatron -> zerogpt -> HF.

Megatron-LM records its tokenizer in the checkpoint's args (HuggingFaceTokenizer: tokenizer_model, a directory;
GPT2BPETokenizer: vocab_file and merge_file), and export --format megatron records the run's tokenizer the same
way. import_megatron loads that tokenizer when it is on this machine, as if given --tokenizer, so export and
generate find it in RUN/tokenizer; when it is not, a note names --tokenizer, and an HF export without any says
that eos_token_id is unset.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.hf_tokenizers import LLAMA3_BOS, LLAMA3_EOS, llama3_tokenizer_dir, sample_texts
from tests.zerogpt_tools import megatron_reference as ref
from zerogpt_tools.export import main as export_main
from zerogpt_tools.import_megatron import main as import_main

pytestmark = [pytest.mark.timeout(120)]

VOCAB, PADDED = 300, 320  # a byte-level BPE needs its 256 bytes: more than megatron_reference's 200 tokens


def _gpt2_files(directory) -> tuple[str, str]:
    """gpt2-vocab.json and gpt2-merges.txt, the files Megatron-LM's GPT2BPETokenizer reads, <|endoftext|> id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(sample_texts(), trainer=trainer)
    os.makedirs(directory)
    vocab, merges = backend.model.save(str(directory), "gpt2")
    assert len(json.load(open(vocab))) == VOCAB
    return vocab, merges


def _hf_ids(tmp_path, run: str, *flags: str) -> tuple:
    """(bos_token_id, eos_token_id) of config.json after an HF export of `run`."""
    out = tmp_path / f"hf_{os.path.basename(run)}"
    assert export_main([run, "--out", str(out), *flags]) == 0
    config = json.loads((out / "config.json").read_text())
    return config["bos_token_id"], config["eos_token_id"]


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_hf_ids_survive_megatron_and_back_without_tokenizer_flags(tmp_path, capsys, family):
    """A Megatron-LM checkpoint whose args name its tokenizer imports with it (no --tokenizer), so the HF export
    has its bos/eos ids; our own Megatron export of that run names the tokenizer again, and the round trip keeps
    them."""
    if family == "llama":
        tok = llama3_tokenizer_dir(tmp_path / "tok", vocab_size=VOCAB)
        named = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok, vocab_size=VOCAB)
        args = ref.llama_args(padded_vocab_size=PADDED, **named)
        expected = (VOCAB - 2, VOCAB - 1)  # <|begin_of_text|>, <|end_of_text|>, added after the base vocabulary
        from transformers import AutoTokenizer
        assert AutoTokenizer.from_pretrained(tok).convert_tokens_to_ids([LLAMA3_BOS, LLAMA3_EOS]) == list(expected)
    else:
        vocab, merges = _gpt2_files(tmp_path / "gpt2")
        args = ref.gpt_args(padded_vocab_size=PADDED, vocab_file=vocab, merge_file=merges)  # no vocab_size: as Megatron
        expected = (0, 0)  # <|endoftext|> is GPT-2's bos and eos
    src = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args))
    assert import_main([src, "--out", str(tmp_path / "run")]) == 0
    assert "the run's tokenizer is the one the checkpoint's args name" in capsys.readouterr().out
    assert _hf_ids(tmp_path, str(tmp_path / "run")) == expected

    assert export_main([str(tmp_path / "run"), "--format", "megatron", "--out", str(tmp_path / "mg")]) == 0
    assert import_main([str(tmp_path / "mg"), "--out", str(tmp_path / "again")]) == 0
    assert _hf_ids(tmp_path, str(tmp_path / "again")) == expected


def test_a_tokenizer_not_here_is_said_in_one_line_with_the_fix(tmp_path, capsys):
    """tokenizer_model names a directory of the machine Megatron ran on: the import says so and how to give it;
    an export without a tokenizer says eos_token_id is unset instead of writing a config.json that never stops."""
    args = ref.llama_args(tokenizer_model="/cluster/models/Llama-3-8B")
    src = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args))
    assert import_main([src, "--out", str(tmp_path / "run")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "/cluster/models/Llama-3-8B" in line]
    assert len(notes) == 1 and "--tokenizer DIR" in notes[0], notes
    assert _hf_ids(tmp_path, str(tmp_path / "run"), "--no-tokenizer") == (None, None)
    said = [line for line in capsys.readouterr().out.splitlines() if "eos_token_id" in line]
    assert len(said) == 1 and "--tokenizer" in said[0], said
