"""Models' own HF tokenizers in the pipeline and at train time: Llama-3 / Qwen2 tokenizer.json and Llama-2
sentencepiece dirs tokenize to the tokenizer's own ids with its EOS (never BOS) between documents, the recorded
vocabulary is len(tokenizer), bad dirs and EOS-less tokenizers are one line, and train_gpt's vocabulary check
takes the embedding's rows. The directories come from tests/hf_tokenizers.py."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from data_pipeline.__main__ import main
from data_pipeline.indexed import IndexedDataset
from data_pipeline.tokenize_stage import tokenize_file
from data_pipeline.tokenizer import load_backend, load_tokenizer
from tests.hf_tokenizers import (LLAMA3_BOS, LLAMA3_EOS, llama2_tokenizer_dir, llama3_tokenizer_dir,
                                 qwen2_tokenizer_dir, sample_texts)

pytestmark = pytest.mark.timeout(120)

# (builder, its EOS): Qwen2-Instruct names <|im_end|> although <|endoftext|> is in its vocabulary too
STYLES = {"llama3": (llama3_tokenizer_dir, LLAMA3_EOS), "qwen2": (qwen2_tokenizer_dir, "<|im_end|>"),
          "llama2": (llama2_tokenizer_dir, "</s>")}
DOCS = ["Hello world, step 12345: loss 10.3 after 100 steps.",  # digits: Qwen2Tokenizer splits them one by one
        "Ünïcode café, naïve 東京.\nSecond line  with  spaces.", "a",
        f"Text that spells {LLAMA3_EOS} and <|endoftext|> and </s> as plain words."] + sample_texts(20)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tok")
    lines = [json.dumps({"text": d}) for d in DOCS]
    lines.insert(2, json.dumps({"text": "   "}))  # empty: skipped, no lone EOS
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("style", list(STYLES))
def test_tokenize_gives_the_tokenizers_own_ids_and_its_eos(corpus, tmp_path, style):
    from transformers import AutoTokenizer

    build, eos = STYLES[style]
    tok_dir = build(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tok_dir)
    eos_id = hf.convert_tokens_to_ids(eos)
    assert hf.eos_token == eos and eos_id == hf.eos_token_id
    stats = tokenize_file(str(corpus / "docs.jsonl"), tok_dir, str(tmp_path / "serial"), workers=1)
    tokenize_file(str(corpus / "docs.jsonl"), tok_dir, str(tmp_path / "par"), workers=2, block_bytes=64)
    ds = IndexedDataset(str(tmp_path / "serial"))
    assert len(ds) == len(DOCS)
    for i, text in enumerate(DOCS):
        own = hf(text, add_special_tokens=False)["input_ids"]
        assert ds[i].tolist() == own + [eos_id], (style, i)  # no BOS, one EOS, nothing else
    if hf.bos_token_id is not None:  # Llama: the tokenizer would prepend BOS; the documents do not get it
        assert hf(DOCS[0])["input_ids"][0] == hf.bos_token_id
        assert all(ds[i][0] != hf.bos_token_id for i in range(len(ds)))
    assert stats["eod_id"] == eos_id and stats["vocab_size"] == len(hf) == len(load_tokenizer(tok_dir))
    assert stats["counts"]["empty"] == 1 and ds.dtype == np.uint16
    for ext in (".bin", ".idx"):  # the worker pool's tokenizer (shipped as tokenizer.json) encodes the same
        assert (tmp_path / f"par{ext}").read_bytes() == (tmp_path / f"serial{ext}").read_bytes()


def test_base_model_eos_and_the_backends_size(tmp_path):
    from transformers import AutoTokenizer

    base = qwen2_tokenizer_dir(tmp_path / "qwen_base", eos_token="<|endoftext|>")
    assert load_backend(base)[1] == AutoTokenizer.from_pretrained(base).convert_tokens_to_ids("<|endoftext|>")
    llama3 = llama3_tokenizer_dir(tmp_path / "llama3", vocab_size=512)
    backend, eod, vocab = load_backend(llama3)
    assert (eod, vocab) == (backend.token_to_id(LLAMA3_EOS), 512) and backend.token_to_id(LLAMA3_BOS) == 510


def test_sentencepiece_backend_survives_the_json_round_trip(tmp_path):
    from tokenizers import Tokenizer

    tok = load_tokenizer(llama2_tokenizer_dir(tmp_path / "tok"))
    copy = Tokenizer.from_str(tok.backend_tokenizer.to_str())  # what tokenize_stage ships to its workers
    texts = sample_texts(40) + DOCS
    assert [e.ids for e in copy.encode_batch(texts, add_special_tokens=False)] == \
        tok(texts, add_special_tokens=False)["input_ids"]


def test_dir_without_tokenizer_files_and_tokenizer_without_eos_are_one_line(tmp_path, corpus, capsys):
    model_dir = tmp_path / "model_only"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert main(["tokenize", str(corpus / "docs.jsonl"), "--tokenizer", str(model_dir),
                 "--output-prefix", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{model_dir} holds no tokenizer files" in err
    assert "tokenizer.json" in err and "tokenizer.model" in err and "vocab.json + merges.txt" in err

    from tokenizers import Tokenizer, models, pre_tokenizers

    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    backend.save(str(no_eos / "tokenizer.json"))
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert main(["tokenize", str(corpus / "docs.jsonl"), "--tokenizer", str(no_eos),
                 "--output-prefix", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no_eos" in err and "no eos_token" in err
    assert not list(tmp_path.glob("[ab].*"))


def _check(tok_dir, model, max_id=10):
    """train_gpt.check_run_vocab on a train split that records len(tokenizer) tokens."""
    from train_gpt import check_run_vocab

    recorded = len(load_tokenizer(tok_dir))
    dataset = types.SimpleNamespace(prefix="d", meta_file={"vocab_size": recorded}, max_token_id=max_id)
    check_run_vocab(dataset, types.SimpleNamespace(mock=False, tokenizer=tok_dir, vocab_size=None), model)


def test_vocab_check_takes_the_embedding_rows(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_zoo import gpt2_tiny
    from zerogpt.preflight import PreflightError

    tok_dir = llama3_tokenizer_dir(tmp_path / "tok")  # 398 base tokens + 2 added specials = 400 ids

    def llama(rows):  # on the meta device: the embedding's shape, no weights
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(vocab_size=rows, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))

    with pytest.raises(PreflightError) as e:
        _check(tok_dir, llama(398))
    message = str(e.value)
    assert "\n" not in message and (
        f"398 (rows of the model's input embedding) is smaller than the 400 (data.tokenizer={tok_dir}: "
        f"398 + 2 added tokens)") in message
    _check(tok_dir, llama(400))
    _check(tok_dir, llama(448))  # padded rows are fine
    with torch.device("meta"):  # GPT pads wte to 448 rows but its vocabulary is config.vocab_size
        with pytest.raises(PreflightError, match=r"398 \(the model's vocab_size\) is smaller than the 400"):
            _check(tok_dir, gpt2_tiny(vocab_size=398))
        _check(tok_dir, gpt2_tiny(vocab_size=400))


def test_vocab_check_on_the_native_llama_bounds_by_its_real_vocab(tmp_path):
    import torch

    from zerogpt.preflight import PreflightError

    llama = pytest.importorskip("model_zoo.llama")
    tok_dir = llama3_tokenizer_dir(tmp_path / "tok")
    with torch.device("meta"):
        padded = llama.llama_tiny(vocab_size=398)  # 448 embedding rows, logits sliced to 398
        assert padded.get_input_embeddings().num_embeddings == 448
        with pytest.raises(PreflightError, match=r"398 \(the model's vocab_size\) is smaller than the 400"):
            _check(tok_dir, padded)
        _check(tok_dir, llama.llama_tiny(vocab_size=400))
