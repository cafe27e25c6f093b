"""Tests for zerogpt_tools/export.py: a real engine checkpoint (gpt2_tiny trained through zerogpt.initialize on 1 process
and on 2 gloo ranks at stage 3) exports to a Hugging Face directory that transformers loads with the trained
logits; generation from the checkpoint equals transformers' generate on the export; sharding, bf16, the memory
bound (one shard, no model built), HF-class checkpoints, errors, and bos/eos ids from the tokenizer (the demo's
2,048-token one: no id outside the vocabulary). The Llama family's export: test_export_llama.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from data_pipeline.tokenizer import save_tokenizer_dir  # noqa: E402
from data_pipeline.train_tokenizer import train_byte_level_bpe  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.corpus import stdlib_docstrings  # noqa: E402
from tests.zerogpt_tools.hf_reference import hf_greedy  # noqa: E402
from zerogpt_tools.export import ShardWriter, export_checkpoint, main  # noqa: E402
from zerogpt.context import DistContext

pytestmark = pytest.mark.timeout(240)

VOCAB = 300  # the tokenizer's size; gpt2_tiny pads its embedding to 320 rows, the export drops the 20
STEPS = 3


def probe_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))


def train_and_save(rank: int, world: int, run_dir: str, tok_dir: str | None, stage: int = 3):
    """Train gpt2_tiny a few steps through the engine, save <run_dir>/checkpoints/step_N (+ latest) and return
    (engine logits on probe_ids, state_dict_full) from rank 0."""
    import zerogpt
    from model_zoo import GPTLMLoss, gpt2_tiny

    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=64)
    data = dict(tokenizer=tok_dir) if tok_dir else {}
    cfg = zerogpt.Config(dict(zero=dict(stage=stage), data=data))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config=cfg,
                                ctx=DistContext.current())
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (world, 2, 33), generator=g)[rank]
        engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
        engine.zero_grad()
    engine.save_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{STEPS}"))
    if rank == 0:
        with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
            f.write(f"step_{STEPS}\n")
    engine.eval()
    with torch.no_grad():
        logits = engine(probe_ids())
    full = engine.state_dict_full()
    engine.close()
    return logits, full


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok"
    save_tokenizer_dir(train_byte_level_bpe(stdlib_docstrings(), vocab_size=VOCAB), str(path))
    return path


@pytest.fixture(scope="module")
def run1(tmp_path_factory, tok_dir):
    """A 1-process stage-3 run directory: (run_dir, engine logits, state_dict_full)."""
    run_dir = tmp_path_factory.mktemp("run1")
    logits, full = run_distributed(train_and_save, 1, str(run_dir), str(tok_dir), timeout=200)[0]
    return run_dir, logits, full


def load_hf(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs).eval()


def check_export(out, logits, full, tok_dir):
    """The export loads with transformers, holds the trained tensors exactly, and gives the trained logits."""
    from model_zoo.hf import to_hf_tensor

    hf = load_hf(out)
    assert isinstance(hf, transformers.GPT2LMHeadModel) and hf.config.vocab_size == VOCAB
    assert hf.transformer.wte.weight.shape == (VOCAB, 64)  # padded rows dropped
    assert full["transformer.wte.weight"].shape[0] == 320
    hf_state = hf.state_dict()
    for name, tensor in full.items():
        if name == "lm_head.weight":
            continue
        hf_name, expected = to_hf_tensor(name, tensor, dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64))
        assert torch.equal(hf_state[hf_name], expected), name
    with torch.no_grad():
        torch.testing.assert_close(hf(probe_ids()).logits, logits, rtol=0, atol=1e-5)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    original = transformers.AutoTokenizer.from_pretrained(tok_dir)
    text = "The JSON decoder returns Python objects.<|endoftext|>Next"
    assert tok(text)["input_ids"] == original(text)["input_ids"] and len(tok) == VOCAB
    assert hf.config.eos_token_id == tok.eos_token_id == 0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0


def test_export_one_process_stage3(run1, tmp_path, capsys, tok_dir):
    run_dir, logits, full = run1
    assert main([str(run_dir), "--out", str(tmp_path / "hf")]) == 0  # tokenizer found via the run's config.py
    assert "1 shard(s)" in capsys.readouterr().out
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(tmp_path / "hf"))
    check_export(tmp_path / "hf", logits, full, tok_dir)


def test_export_two_ranks_stage3(tmp_path, tok_dir):
    run_dir = tmp_path / "run2"
    logits, full = run_distributed(train_and_save, 2, str(run_dir), str(tok_dir), timeout=200)[0]
    ckpt = run_dir / "checkpoints" / f"step_{STEPS}"
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    assert main([str(ckpt), "--out", str(tmp_path / "hf")]) == 0  # a checkpoint dir works as well as a run dir
    check_export(tmp_path / "hf", logits, full, tok_dir)


def test_checkpoint_generates_like_its_export(run1, tmp_path):
    from zerogpt_tools.generate import SamplingConfig, generate_text, load_model

    run_dir, _, _ = run1
    export_checkpoint(str(run_dir), str(tmp_path / "hf"))
    ours, tok = load_model(str(run_dir))  # rebuilt from the recorded model class, tokenizer from the run config
    assert type(ours).__name__ == "GPT"
    hf = load_hf(tmp_path / "hf")
    for prompt in ("Return a new", "The JSON", "x = "):
        ids, new = generate_text(ours, tok, prompt, 20, SamplingConfig(greedy=True))
        assert new == hf_greedy(hf, ids, 20), prompt
        assert new == generate_text(hf, tok, prompt, 20, SamplingConfig(greedy=True))[1]
    sample = [generate_text(ours, tok, "The", 20, SamplingConfig(top_k=20), seed=7, stop_at_eos=False)[1]
              for _ in range(2)]
    assert sample[0] == sample[1]


def test_sharded_bf16_export_holds_one_shard_and_builds_no_model(run1, tmp_path, monkeypatch):
    run_dir, logits, _ = run1
    built = []
    original_init = nn.Module.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "__init__", counting_init)
    max_shard = 20_000
    stats = export_checkpoint(str(run_dir), str(tmp_path / "hf"), dtype="bf16", max_shard_bytes=max_shard)
    monkeypatch.undo()
    assert built == []  # neither our GPT nor an HF model was constructed: tensors stream straight to files

    largest = VOCAB * 64 * 2  # bf16 wte, the largest tensor
    assert stats["shards"] > 3 and stats["peak_shard_bytes"] <= max(max_shard, largest)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == stats["shards"] and index["metadata"]["total_size"] == stats["total_bytes"]
    from safetensors import safe_open

    for fname in files:
        with safe_open(str(tmp_path / "hf" / fname), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
        nbytes = sum(2 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= max_shard or len(sizes) == 1, (fname, nbytes)

    hf = load_hf(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16 and hf.config.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(hf(probe_ids()).logits.float(), logits, rtol=0, atol=0.1)


def _hf_engine_run(rank, world, run_dir):
    import zerogpt

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                config=zerogpt.Config(dict(zero=dict(stage=3))), ctx=DistContext.current())
    x = probe_ids()
    engine.backward(engine(x, labels=x).loss)
    engine.step()
    engine.zero_grad()
    engine.save_checkpoint(run_dir)
    engine.eval()
    with torch.no_grad():
        logits = engine(x).logits
    engine.close()
    return logits


def test_transformers_model_checkpoint_exports_as_is(tmp_path, tok_dir):
    logits = run_distributed(_hf_engine_run, 2, str(tmp_path / "ckpt"), timeout=200)[0]
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["model"]["class"].startswith("transformers.")
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--tokenizer", str(tok_dir)]) == 0
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(probe_ids()).logits, logits, rtol=0, atol=1e-5)


@dataclasses.dataclass
class PlainConfig:
    width: int = 8


class PlainModel(nn.Module):
    """A model whose module defines no HF conversion (no hf_config / to_hf_tensor)."""

    def __init__(self):
        super().__init__()
        self.config = PlainConfig()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


def test_errors_name_the_fix(run1, tmp_path, tok_dir):
    import zerogpt

    run_dir, _, _ = run1
    with pytest.raises(SystemExit, match="neither a checkpoint directory"):
        main([str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--tokenizer .*no such file"):
        main([str(run_dir), "--out", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "nope")])
    big = tmp_path / "big"
    save_tokenizer_dir(train_byte_level_bpe(stdlib_docstrings(), vocab_size=400), str(big))
    with pytest.raises(SystemExit, match=r"vocabulary mismatch: .*\b400\b"):
        main([str(run_dir), "--out", str(tmp_path / "x"), "--tokenizer", str(big)])
    with pytest.raises(SystemExit, match="--max-shard-size"):
        main([str(run_dir), "--out", str(tmp_path / "x"), "--max-shard-size", "lots"])
    assert not (tmp_path / "x").exists()  # nothing half-written

    from model_zoo.gpt import gpt2_tiny

    for name, model in (("plain", PlainModel()), ("untokenized", gpt2_tiny(vocab_size=VOCAB))):
        engine = zerogpt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    config=zerogpt.Config(dict(zero=dict(stage=0))),
                                    ctx=DistContext.current())  # no data.tokenizer
        engine.save_checkpoint(str(tmp_path / name))
        engine.close()
    with pytest.raises(SystemExit, match=r"PlainModel has no Hugging Face conversion.*defines no hf_config\(\)"):
        main([str(tmp_path / "plain"), "--out", str(tmp_path / "x"), "--no-tokenizer"])
    with pytest.raises(SystemExit, match="no tokenizer found.*--tokenizer DIR.*--no-tokenizer"):
        main([str(tmp_path / "untokenized"), "--out", str(tmp_path / "x")])


def test_no_tokenizer_flag_exports_weights_only(run1, tmp_path):
    run_dir, logits, _ = run1
    assert main([str(run_dir), "--out", str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(probe_ids()).logits, logits, rtol=0, atol=1e-5)


def test_shard_writer(tmp_path):
    writer = ShardWriter(str(tmp_path), max_shard_bytes=100)
    writer.add("a", torch.zeros(10))    # 40 bytes
    writer.add("b", torch.zeros(10))    # 80: same shard
    writer.add("c", torch.zeros(100))   # 400 bytes, over the limit alone: its own shard
    writer.add("d", torch.zeros(5))
    with pytest.raises(ValueError, match="written twice"):
        writer.add("a", torch.zeros(1))
    names = writer.close()
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert writer.shards == [["a", "b"], ["c"], ["d"]] and writer.peak_bytes == 400
    assert sorted(os.listdir(tmp_path)) == sorted(names)


def test_export_refuses_a_tokenizer_other_than_the_datas(run1, tmp_path, tok_dir):
    """Issue 18.1: the run's data was tokenized with another vocabulary than data.tokenizer (its stats say 320 ids,
    the tokenizer has 300): export refuses instead of pairing the model with the wrong tokenizer."""
    import shutil
    from zerogpt_tools.export import main

    run_dir, _, _ = run1
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (tmp_path / "d.stats.json").write_text(json.dumps({"vocab_size": 320}))
    ckpt = copy / "checkpoints" / f"step_{STEPS}"
    (ckpt / "config.py").write_text(f"data = dict(path={str(tmp_path / 'd')!r}, tokenizer={str(tok_dir)!r})\n")
    with pytest.raises(SystemExit, match=r"vocabulary mismatch: the data was tokenized with 320 \(.*d.stats.json\) "
                                         r"tokens but the tokenizer has 300 \(tokenizer .*tok\)"):
        main([str(copy), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


class _HFLog(logging.Handler):
    """What transformers logs (its loggers print through their own handler, not to the caplog root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def _load_and_generate(path) -> list[str]:
    """transformers' messages while loading `path` and generating from it, warnings included."""
    import warnings

    with _HFLog() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf = load_hf(path)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        hf.generate(**tok("The json module", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    return log.lines + [str(w.message) for w in caught]


def test_gpt2_export_with_the_demos_tokenizer_takes_its_special_ids(tmp_path):
    """Issue 39.3: a GPT-2 export with the demo's 2,048-token tokenizer said eos 50256, and transformers warned the
    id is outside the vocabulary. bos/eos come from the tokenizer, in config.json and generation_config.json."""
    import shutil

    import zerogpt
    from data_pipeline.__main__ import main as pipeline
    from model_zoo.gpt import gpt2_tiny
    from train_gpt import SAMPLE_CORPUS, SAMPLE_VOCAB

    tok_dir = tmp_path / "tokenizer"
    assert pipeline(["train-tokenizer", SAMPLE_CORPUS, "--output", str(tok_dir), "--vocab-size",
                     str(SAMPLE_VOCAB)]) == 0  # the demo's own: train_gpt.prepare_sample runs the same stage
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == SAMPLE_VOCAB == 2048 and tok.eos_token_id is not None and tok.eos_token_id < 2048
    model = gpt2_tiny(vocab_size=SAMPLE_VOCAB)
    engine = zerogpt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                config=zerogpt.Config(dict(zero=dict(stage=0), data=dict(tokenizer=str(tok_dir)))),
                                ctx=DistContext.current())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    out = tmp_path / "hf"
    assert main([str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == tok.eos_token_id
    assert config["bos_token_id"] == generation["bos_token_id"] == tok.bos_token_id
    assert config["vocab_size"] == 2048
    assert not [line for line in _load_and_generate(out) if "within the vocabulary" in line]

    # the check sees the warning when there is one: GPT-2's 50256 in this vocabulary
    shutil.copytree(out, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "eos_token_id": 50256}))
    assert [line for line in _load_and_generate(tmp_path / "bad") if "within the vocabulary" in line]


def test_gpt2_hf_config_guesses_50256_for_gpt2s_own_vocabulary_only():
    from model_zoo.gpt import GPTConfig
    from model_zoo.hf import hf_config

    assert hf_config(GPTConfig(vocab_size=50257)).eos_token_id == 50256
    for vocab in (2048, 50304, 128256):  # another tokenizer's ids are its own: the export takes them from it
        config = hf_config(GPTConfig(vocab_size=vocab))
        assert config.eos_token_id is None and config.bos_token_id is None, vocab
