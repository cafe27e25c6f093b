"""Tests for zerogpt_tools/generate.py: greedy = transformers' generate on the same (exported) model, the KV cache = a
full recompute, a checkpoint / run dir generates as its export, seeded sampling, top-k / top-p, clear errors.

Everything is local: a byte-level BPE trained on stdlib docstrings and tiny random GPT-2s.
"""
from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_pipeline.tokenizer import save_tokenizer_dir  # noqa: E402
from data_pipeline.train_tokenizer import train_byte_level_bpe  # noqa: E402
from tests.corpus import stdlib_docstrings  # noqa: E402
from tests.zerogpt_tools.hf_reference import hf_greedy  # noqa: E402
from zerogpt_tools.generate import SamplingConfig, generate_ids, generate_text, load_model, main, next_token  # noqa: E402

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Return a new", "The JSON decoder", "x"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random GPT-2 (wide init, so greedy paths vary) saved with its 300-token tokenizer, EOS id 0."""
    root = tmp_path_factory.mktemp("gen")
    save_tokenizer_dir(train_byte_level_bpe(stdlib_docstrings(), vocab_size=300), str(root / "hf"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=48, n_embd=32, n_layer=2, n_head=2,
                                     initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "hf")
    return root / "hf"


def test_greedy_matches_transformers_generate(hf_dir):
    model, tok = load_model(str(hf_dir))
    assert len(tok) == 300 and tok.eos_token_id == 0
    lengths = set()
    for prompt in PROMPTS:
        ids, new = generate_text(model, tok, prompt, max_new_tokens=30, sampling=SamplingConfig(greedy=True))
        assert new == hf_greedy(model, ids, 30), prompt
        lengths.add(len(set(new)))
    assert max(lengths) > 3  # not a degenerate one-token loop: the comparison means something


def test_kv_cache_equals_full_recompute(hf_dir):
    model, _ = load_model(str(hf_dir))
    ids = [5, 17, 42, 8]
    cached = generate_ids(model, ids, 25, SamplingConfig(greedy=True))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(25):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert cached == seq[len(ids):]


def test_cli_prints_prompt_and_greedy_continuation(hf_dir, capsys):
    assert main(["--model", str(hf_dir), "--prompt", PROMPTS[0], "--greedy", "--max-new-tokens", "12"]) == 0
    model, tok = load_model(str(hf_dir))
    ids = tok(PROMPTS[0])["input_ids"]
    expected = tok.decode(ids + hf_greedy(model, ids, 12))
    assert capsys.readouterr().out == expected + "\n"


def test_sampling_is_reproducible_for_a_seed(hf_dir):
    model, tok = load_model(str(hf_dir))
    hot = SamplingConfig(temperature=1.5)

    def sample(seed, sampling=hot):
        return generate_text(model, tok, "The", 30, sampling, seed=seed, stop_at_eos=False)[1]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = sample(None, SamplingConfig(greedy=True))
    assert sample(3, SamplingConfig(temperature=1.5, top_k=1)) == greedy
    assert sample(4, SamplingConfig(temperature=1.5, top_p=1e-6)) == greedy
    assert sample(5, SamplingConfig(temperature=0)) == greedy


def test_next_token_top_k_and_top_p_keep_only_the_head():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    top2 = {next_token(logits, SamplingConfig(top_k=2), g) for _ in range(300)}
    assert top2 == {0, 1}
    nucleus = {next_token(logits, SamplingConfig(top_p=0.7), g) for _ in range(300)}
    assert nucleus == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3: the second token is needed, the third is not
    everything = {next_token(logits, SamplingConfig(top_p=1.0), g) for _ in range(2000)}
    assert everything == {0, 1, 2, 3}
    assert next_token(logits, SamplingConfig(greedy=True)) == 0


def test_vocab_limit_never_picks_rows_past_the_tokenizer(hf_dir):
    model, _ = load_model(str(hf_dir))
    with torch.no_grad():  # final hidden state = all ones, and head rows (tied wte) past 250 win every argmax
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[250:] = 1.0
    assert min(generate_ids(model, [1, 2], 10, SamplingConfig(greedy=True))) >= 250
    assert max(generate_ids(model, [1, 2], 10, SamplingConfig(greedy=True), vocab_limit=250)) < 250


def test_errors_name_the_fix(hf_dir, tmp_path, capsys):
    bare = tmp_path / "bare"  # weights without tokenizer files
    transformers.GPT2LMHeadModel.from_pretrained(hf_dir).save_pretrained(bare)
    with pytest.raises(SystemExit, match="no tokenizer found.*--tokenizer"):
        main(["--model", str(bare), "--prompt", "hi"])
    assert main(["--model", str(bare), "--prompt", "hi", "--tokenizer", str(hf_dir), "--max-new-tokens", "2"]) == 0
    with pytest.raises(SystemExit, match="prompt is .* tokens but the model's context is 48"):
        main(["--model", str(hf_dir), "--prompt", " ".join(["word"] * 60)])
    with pytest.raises(SystemExit, match="pass --max-new-tokens .* or less"):
        main(["--model", str(hf_dir), "--prompt", "hi", "--max-new-tokens", "100"])
    with pytest.raises(SystemExit, match="--top-p must be in"):
        main(["--model", str(hf_dir), "--prompt", "hi", "--top-p", "1.5"])
    with pytest.raises(SystemExit, match="no such directory"):
        main(["--model", str(tmp_path / "missing"), "--prompt", "hi"])
    with pytest.raises(SystemExit, match="neither a checkpoint directory"):
        main(["--model", str(tmp_path), "--prompt", "hi"])


def test_empty_prompt_starts_from_eos(hf_dir):
    model, tok = load_model(str(hf_dir))
    ids, new = generate_text(model, tok, "", 5, SamplingConfig(greedy=True), stop_at_eos=False)
    assert ids == [0] and len(new) == 5


def test_corrupt_weights_and_a_larger_tokenizer_are_named(hf_dir, tmp_path):
    """A truncated model.safetensors is one line naming the file; a tokenizer the model cannot hold is refused."""
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SystemExit) as err:
        main(["--model", str(bad), "--prompt", "hi"])
    assert str(weights) in str(err.value) and "corrupt" in str(err.value) and "\n" not in str(err.value)
    from model_zoo import build_model
    with pytest.raises(ValueError, match="model.safetensors is corrupt"):      # training from an export
        build_model(dict(type="hf", path=str(bad)))
    big = tmp_path / "big"
    save_tokenizer_dir(train_byte_level_bpe(stdlib_docstrings(), vocab_size=400), str(big))
    with pytest.raises(SystemExit, match=r"vocabulary mismatch: 300 \(vocab_size of .*\) is smaller than the 400"):
        main(["--model", str(hf_dir), "--prompt", "hi", "--tokenizer", str(big)])


def test_cli_output_ends_at_eos_and_at_the_last_visible_character(hf_dir, capsys, monkeypatch):
    """Issue 31.7: a greedy run of newlines printed a screen of blank lines, and sampling printed the EOS it stopped
    at as a literal <|endoftext|>."""
    import zerogpt_tools.generate as generate

    _, tok = load_model(str(hf_dir))
    words, newline = tok("Return a new")["input_ids"], tok("\n")["input_ids"]
    for new, flags, expected in [(words + newline * 28, ["--greedy"], "x Return a new"),
                                 (words + [tok.eos_token_id], [], "x Return a new"),
                                 (words + [tok.eos_token_id] + words, ["--ignore-eos"],
                                  "x Return a new" + tok.decode([tok.eos_token_id]) + "Return a new")]:
        monkeypatch.setattr(generate, "generate_text", lambda *a, new=new, **k: (tok("x ")["input_ids"], new))
        assert main(["--model", str(hf_dir), "--prompt", "x ", *flags]) == 0
        assert capsys.readouterr().out == expected + "\n", flags


def test_a_config_json_that_does_not_fit_the_weights_is_one_line(hf_dir, tmp_path):
    """config.json edited to 3 blocks over 2 blocks' weights: generate must not decode from random blocks
    (transformers' default), nor end a mislabelled model_type in transformers' multi-paragraph error."""
    import json
    import shutil
    for name, changes, expected in [("deeper", {"n_layer": 3}, "tensors of the GPT2LMHeadModel that config.json "
                                     "describes .* are not in its weight files"),
                                    ("unknown", {"model_type": "foo"}, "model_type 'foo' .* is not a causal LM")]:
        bad = tmp_path / name
        shutil.copytree(hf_dir, bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(SystemExit, match=expected) as err:
            main(["--model", str(bad), "--prompt", "hi"])
        assert "\n" not in str(err.value)
