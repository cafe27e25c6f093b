"""Tests for data_pipeline/merge_tokenizers.py: A's ids kept, B's tokens and merges appended, loadable, lossless;
for GPT-2, Llama-3 and Qwen tokenizer.json (added specials and A's config kept) and Llama-2 sentencepiece models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.__main__ import main
from data_pipeline.tokenizer import save_tokenizer_dir
from data_pipeline.train_tokenizer import train_byte_level_bpe
from tests.corpus import prose_and_code
from tests.hf_tokenizers import NEW_WORDS

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def tokenizers_ab(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    prose, code = prose_and_code()
    a = train_byte_level_bpe(prose, vocab_size=400)
    b = train_byte_level_bpe(code, vocab_size=500, special_tokens=["<|endoftext|>", "<|code|>"])
    save_tokenizer_dir(a, str(root / "a"))
    save_tokenizer_dir(b, str(root / "b"))
    assert main(["merge-tokenizers", str(root / "a"), str(root / "b"), "--out", str(root / "ab")]) == 0
    return root, prose, code


def test_merged_keeps_a_ids_and_appends_b(tokenizers_ab):
    from transformers import AutoTokenizer

    root, prose, code = tokenizers_ab
    a, b, ab = (AutoTokenizer.from_pretrained(str(root / n)) for n in ("a", "b", "ab"))
    va, vb, vab = a.get_vocab(), b.get_vocab(), ab.get_vocab()
    assert all(vab[token] == i for token, i in va.items())
    assert set(vb) <= set(vab)
    new = sorted(set(vb) - set(va), key=vb.get)
    assert [vab[t] for t in new] == list(range(len(va), len(va) + len(new)))  # appended in B's order
    assert len(ab) == len(va) + len(new)
    assert ab.eos_token == "<|endoftext|>" and ab.eos_token_id == 0
    merges_a = json.loads((root / "a" / "tokenizer.json").read_text())["model"]["merges"]
    merges_ab = json.loads((root / "ab" / "tokenizer.json").read_text())["model"]["merges"]
    assert merges_ab[:len(merges_a)] == merges_a and len(merges_ab) > len(merges_a)
    stats = json.loads((root / "ab.stats.json").read_text())
    assert stats["counts"]["new_tokens"] == len(new) and stats["vocab_size"] == len(ab)


def test_merged_is_lossless_and_shorter_on_b_text(tokenizers_ab):
    from transformers import AutoTokenizer

    root, prose, code = tokenizers_ab
    a, ab = AutoTokenizer.from_pretrained(str(root / "a")), AutoTokenizer.from_pretrained(str(root / "ab"))
    for text in (prose[0], code[0][:5000], "naïve café — 東京 <|code|>"):
        assert ab.decode(ab(text)["input_ids"]) == text
    n_a, n_ab = len(a(code[1])["input_ids"]), len(ab(code[1])["input_ids"])
    assert n_ab < 0.95 * n_a  # B's code merges make code cheaper to encode
    assert ab.convert_tokens_to_ids("<|code|>") in ab("x <|code|> y")["input_ids"]  # still a special token


def test_rejects_non_bpe(tokenizers_ab, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root, _, _ = tokenizers_ab
    word = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "wl").mkdir()
    word.save(str(tmp_path / "wl" / "tokenizer.json"))
    from data_pipeline.merge_tokenizers import merge_tokenizers
    with pytest.raises(ValueError, match=r"wl is a WordLevel model"):
        merge_tokenizers(str(root / "a"), str(tmp_path / "wl"), str(tmp_path / "out"))
    assert main(["merge-tokenizers", str(root / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_a_json_file_that_is_no_tokenizer_is_named_so(tokenizers_ab, tmp_path):
    """A model's config.json or a one-line JSONL given as OTHER was 'a None model'."""
    from data_pipeline.merge_tokenizers import merge_tokenizers

    root, _, _ = tokenizers_ab
    for name, body in (("config.json", {"model_type": "gpt2"}), ("one.jsonl", {"text": "hello"})):
        (tmp_path / name).write_text(json.dumps(body) + "\n")
        with pytest.raises(ValueError, match=rf"{name} is JSON but no tokenizer.json \(it has no \"model\" section\)"):
            merge_tokenizers(str(root / "a"), str(tmp_path / name), str(tmp_path / "out"))


# ------------------------------------------------------------------------------------------------
# Llama-3 / Qwen tokenizer.json with added special tokens, and Llama-2 sentencepiece tokenizer.model


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
    """{kind: (A, B, merged A+B)} for llama3, qwen2 (tokenizer.json) and llama2 (tokenizer.model) style pairs, and
    llama3+qwen2 (B brings special tokens A lacks)."""
    from tests.hf_tokenizers import llama2_tokenizer_dir, llama3_tokenizer_dir, other_texts, qwen2_tokenizer_dir

    root = tmp_path_factory.mktemp("hf_pairs")
    makers = {"llama3": llama3_tokenizer_dir, "qwen2": qwen2_tokenizer_dir, "llama2": llama2_tokenizer_dir}
    dirs = {}
    for kind, make in makers.items():
        dirs[kind] = make(root / f"{kind}_a"), make(root / f"{kind}_b", texts=other_texts())
    dirs["llama3+qwen2"] = dirs["llama3"][0], dirs["qwen2"][1]
    pairs = {}
    for kind, (a, b) in dirs.items():
        assert main(["merge-tokenizers", a, b, "--out", str(root / f"{kind}_ab")]) == 0
        pairs[kind] = a, b, str(root / f"{kind}_ab")
    return pairs


def _load(path):
    from transformers import AutoTokenizer

    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(path).get_vocab()
    return tok


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "llama3+qwen2"])
def test_bpe_with_added_specials_keeps_a_ids_and_config(hf_pairs, kind):
    from zerogpt_tools.extend_vocab import check_ids_kept

    a_dir, b_dir, ab_dir = hf_pairs[kind]
    a, b, ab = _load(a_dir), _load(b_dir), _load(ab_dir)
    check_ids_kept(a, ab)
    va, vb, vab = a.get_vocab(), b.get_vocab(), ab.get_vocab()
    assert set(vb) <= set(vab) and sorted(vab.values()) == list(range(len(ab)))  # no gaps: rows = len(tokenizer)
    new = sorted(set(vb) - set(va), key=vb.get)
    assert len(new) > 50 and min(vab[t] for t in new) == len(a)  # after A's specials (<|end_of_text|> = len(a)-1)
    assert (type(ab), ab.eos_token, ab.eos_token_id, ab.bos_token_id) == (type(a), a.eos_token, a.eos_token_id,
                                                                          a.bos_token_id)
    config_a, config_ab = _json(a_dir, "tokenizer_config.json"), _json(ab_dir, "tokenizer_config.json")
    assert config_ab.pop("added_tokens_decoder").items() >= config_a.pop("added_tokens_decoder").items()
    assert config_ab == config_a  # class, bos/eos/pad, model_max_length: A's
    merges_a, merges_ab = (_json(d, "tokenizer.json")["model"]["merges"] for d in (a_dir, ab_dir))
    assert merges_ab[:len(merges_a)] == merges_a and len(merges_ab) > len(merges_a)

    ids_a, ids = a(NEW_WORDS)["input_ids"], ab(NEW_WORDS)["input_ids"]
    assert max(ids) >= len(a) and len(ids) < len(ids_a)  # the new words take B's tokens
    assert ids[:1] == ids_a[:1] and ab.decode(ids, skip_special_tokens=True) == NEW_WORDS  # Llama-3's BOS stays
    if kind == "llama3+qwen2":  # B's specials A lacks are appended, and stay special
        im_start = ab.convert_tokens_to_ids("<|im_start|>")
        assert im_start >= len(a) and im_start in ab("x <|im_start|> y")["input_ids"]
    stats = json.loads(Path(f"{ab_dir}.stats.json").read_text())
    assert stats["vocab_size"] == len(ab) and stats["counts"]["new_tokens"] == len(ab) - len(a)


def _json(directory: str, name: str) -> dict:
    return json.loads((Path(directory) / name).read_text())


def test_sentencepiece_appends_b_pieces_as_normal_score_0(hf_pairs, tmp_path):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from zerogpt_tools.extend_vocab import check_ids_kept

    a_dir, b_dir, ab_dir = hf_pairs["llama2"]
    assert sorted(p.name for p in Path(ab_dir).iterdir()) == ["special_tokens_map.json", "tokenizer.model",
                                                                 "tokenizer_config.json"]
    protos = []
    for d in (a_dir, b_dir, ab_dir):
        protos.append(pb.ModelProto())
        protos[-1].ParseFromString((Path(d) / "tokenizer.model").read_bytes())
    pa, pb_, pab = protos
    n = len(pa.pieces)
    assert list(pab.pieces)[:n] == list(pa.pieces)  # piece, score and type of every A piece
    appended = list(pab.pieces)[n:]
    have = {p.piece for p in pa.pieces}
    assert [p.piece for p in appended] == [p.piece for p in pb_.pieces if p.piece not in have
                                           and p.type == pb.ModelProto.SentencePiece.NORMAL]
    assert len(appended) > 50 and all(p.score == 0 and p.type == pb.ModelProto.SentencePiece.NORMAL
                                      for p in appended)

    a, ab = _load(a_dir), _load(ab_dir)
    check_ids_kept(a, ab)
    assert len(ab) == len(pab.pieces) and (ab.eos_token, ab.eos_token_id, ab.bos_token_id) == ("</s>", 2, 1)
    ids = ab(NEW_WORDS)["input_ids"]
    assert ids[0] == 1 and max(ids) >= n and len(ids) < len(a(NEW_WORDS)["input_ids"])
    assert ab.decode(ids, skip_special_tokens=True) == NEW_WORDS
    # sentencepiece itself reads the merged model and uses the new pieces too
    sp = spm.SentencePieceProcessor(model_file=str(Path(ab_dir) / "tokenizer.model"))
    assert max(sp.encode(NEW_WORDS)) >= n and sp.decode(sp.encode(NEW_WORDS)) == NEW_WORDS
    # B may be a bare .model file, as spm_train writes it
    assert main(["merge-tokenizers", a_dir, str(Path(b_dir) / "tokenizer.model"), "--out", str(tmp_path / "ab")]) == 0
    assert (tmp_path / "ab" / "tokenizer.model").read_bytes() == (Path(ab_dir) / "tokenizer.model").read_bytes()


def test_refuses_what_is_not_well_defined_in_one_line(hf_pairs, tmp_path, capsys):
    import shutil

    from sentencepiece import sentencepiece_model_pb2 as pb

    from data_pipeline.merge_tokenizers import merge_tokenizers

    llama3, llama2 = hf_pairs["llama3"][0], hf_pairs["llama2"][0]
    assert main(["merge-tokenizers", llama3, llama2, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "same kind" in err and llama2 in err
    unigram = tmp_path / "unigram"  # a sentencepiece Unigram model: its scores are log-probabilities, not ranks
    unigram.mkdir()
    proto = pb.ModelProto()
    proto.ParseFromString((Path(llama2) / "tokenizer.model").read_bytes())
    proto.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    (unigram / "tokenizer.model").write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match=r"sentencepiece BPE model and .*unigram a UNIGRAM one"):
        merge_tokenizers(llama2, str(unigram), str(tmp_path / "x"))
    padded = Path(shutil.copytree(llama2, tmp_path / "padded"))  # a <pad> added past the pieces, as some Llama-2s
    config = _json(str(padded), "tokenizer_config.json")
    config["added_tokens_decoder"]["384"] = {**config["added_tokens_decoder"]["0"], "content": "<pad>"}
    (padded / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"adds tokens past its 384 sentencepiece pieces \(\[\('<pad>', 384\)\]"):
        merge_tokenizers(str(padded), hf_pairs["llama2"][1], str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
