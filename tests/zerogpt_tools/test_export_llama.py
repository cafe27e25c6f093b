"""zerogpt_tools/export.py on the Llama family (issue 39.3): a tiny Hugging Face checkpoint of each architecture, in
bf16 and in fp32, streamed into an engine at ZeRO stage 3 on 2 gloo ranks, saved, and exported with no training
step in between comes back bit for bit: every safetensors tensor (torch.equal, same dtype: --dtype auto keeps the
source's), config.json key for key (architecture, RoPE parameters, bos/eos), and transformers builds the same class
with the same logits. The export is sharded with its index, streams (one shard and one tensor in memory, no model
built), and bos/eos come from the tokenizer, never outside the vocabulary.
"""
from __future__ import annotations

import json
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402
from tests.model_zoo.hf_families import FAMILIES, VOCAB, make_hf_model  # noqa: E402
from tests.zero.reference import cpu_ctx  # noqa: E402
from zerogpt.checkpoint_reader import CheckpointReader  # noqa: E402
from zerogpt_tools.export import INDEX_FILE, SINGLE_FILE, export_checkpoint, main, set_special_ids  # noqa: E402

pytestmark = pytest.mark.timeout(240)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CASES = [(family, dtype) for family in sorted(FAMILIES) for dtype in DTYPES]
IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _save_checkpoints(rank: int, world: int, root: str, cases: list[tuple[str, str]]) -> None:
    """Each source checkpoint through type='hf' (native Llama, meta build, weights streamed into the shards) and
    zerogpt.initialize at stage 3, saved at once: no step, so the masters are the source's values."""
    import zerogpt
    from model_zoo import build_model
    from zerogpt.zero import BucketTensorShardStrategy

    for family, dtype in cases:
        name = f"{family}-{dtype}"
        model = build_model(dict(type="hf", path=os.path.join(root, name)))
        assert type(model).__name__ == "Llama"
        config = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=BucketTensorShardStrategy(
            bucket_mb=0.02))))  # several chunks, each cut across the two ranks
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=config,
                                    ctx=cpu_ctx(rank, world))
        engine.save_checkpoint(os.path.join(root, f"{name}.ckpt"))
        engine.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A directory of source checkpoints `<family>-<dtype>/` and their zerogpt checkpoints `<family>-<dtype>.ckpt/`."""
    root = tmp_path_factory.mktemp("families")
    for seed, (family, dtype) in enumerate(CASES):
        make_hf_model(family, root / f"{family}-{dtype}", seed=seed, dtype=DTYPES[dtype])
    run_distributed(_save_checkpoints, 2, str(root), CASES, timeout=200)
    return root


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def exported_tensors(out) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX_FILE).read_text())
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        part = load_file(out / fname)
        assert all(index["weight_map"][name] == fname for name in part), fname
        tensors.update(part)
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


@pytest.mark.parametrize("family,dtype", CASES)
def test_hf_to_zerogpt_to_hf_is_bit_exact(root, tmp_path, capsys, family, dtype):
    source, out = root / f"{family}-{dtype}", tmp_path / "hf"
    meta = json.loads((root / f"{family}-{dtype}.ckpt" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["model"]["class"] == "model_zoo.llama.Llama"
    # the default --dtype (auto) writes the source's dtype; small shards, so the index is written too
    assert main([str(root / f"{family}-{dtype}.ckpt"), "--out", str(out), "--no-tokenizer",
                 "--max-shard-size", "40KB"]) == 0
    printed = capsys.readouterr().out
    assert f" {dtype} in " in printed and not (out / SINGLE_FILE).exists()
    if dtype == "bf16":
        assert "dtype bf16: the source checkpoint's bfloat16" in printed

    src, got = load_file(source / SINGLE_FILE), exported_tensors(out)
    assert sorted(got) == sorted(src)  # a tied head is not written (as transformers saves it), padded rows dropped
    for name, tensor in src.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    want, written = (json.loads((d / "config.json").read_text()) for d in (source, out))
    if want.get("head_dim") is None:  # Qwen2Config leaves it implicit; the export names its value
        want["head_dim"] = want["hidden_size"] // want["num_attention_heads"]
    for config in (want, written):
        config.pop("transformers_version")
    assert written == want  # architectures, rope_parameters, sliding_window, bos/eos, dtype, ... key for key

    ref, hf = load_hf(source), load_hf(out)
    assert type(hf) is type(ref) and type(hf).__name__ == FAMILIES[family][1]
    assert hf.dtype == DTYPES[dtype]
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, ref(IDS).logits)


def test_dtype_fp32_of_a_bf16_source_is_the_masters_exactly(root, tmp_path):
    stats = export_checkpoint(str(root / "qwen3-bf16.ckpt"), str(tmp_path / "hf"), dtype="fp32", with_tokenizer=False)
    assert stats["dtype"] == "fp32" and stats["shards"] == 1
    assert not [note for note in stats["notes"] if note.startswith("dtype")]  # --dtype given: nothing to explain
    src, got = load_file(root / "qwen3-bf16" / SINGLE_FILE), load_file(tmp_path / "hf" / SINGLE_FILE)
    for name, tensor in src.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor.float()), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"


def test_export_streams_one_shard_and_one_tensor(root, tmp_path, monkeypatch):
    """The memory bound of a stage-3 Llama run: the tensors read from the checkpoint never overlap in memory (each
    storage is freed before the next read), the writer holds at most one shard, and no model is constructed."""
    alive, most = set(), [0]
    read = CheckpointReader.tensor

    def tracked(self, name, kind=None):
        tensor = read(self, name, kind)
        storage = tensor.untyped_storage()  # finalized when the last view of it goes, not just this tensor object
        alive.add(id(storage))
        weakref.finalize(storage, alive.discard, id(storage))
        most[0] = max(most[0], len(alive))
        return tensor

    built = []
    init = nn.Module.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "tensor", tracked)
    monkeypatch.setattr(nn.Module, "__init__", counting_init)
    max_shard = 20_000
    # fp32 masters written as bf16: the shard holds copies, so a checkpoint tensor still alive is one too many
    stats = export_checkpoint(str(root / "llama-fp32.ckpt"), str(tmp_path / "hf"), dtype="bf16",
                              max_shard_bytes=max_shard, with_tokenizer=False)
    monkeypatch.undo()
    assert built == [] and most[0] == 1
    largest = VOCAB * 64 * 2  # bf16 embedding and head, the padded rows (250 -> 256) dropped
    assert stats["shards"] > 3 and stats["peak_shard_bytes"] <= max(max_shard, largest)
    assert load_hf(tmp_path / "hf").dtype == torch.bfloat16


def _hf_config(**extra):
    from model_zoo.llama import LlamaConfig
    from model_zoo.llama_adapter import hf_config

    return hf_config(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, extra=extra))


def test_special_ids_come_from_the_tokenizer_and_stay_in_the_vocabulary():
    tok = SimpleNamespace(eos_token_id=7, bos_token_id=None)
    config = _hf_config(bos_token_id=1, eos_token_id=2)
    assert set_special_ids(config, tok) == []
    assert (config.bos_token_id, config.eos_token_id) == (7, 7)  # no bos in the tokenizer: its eos (Qwen, GPT-2)
    config = _hf_config(eos_token_id=[5, 7, 9])  # Llama-3.1-Instruct's stop ids include the tokenizer's eos: kept
    set_special_ids(config, SimpleNamespace(eos_token_id=7, bos_token_id=3))
    assert (config.bos_token_id, config.eos_token_id) == (3, [5, 7, 9])
    config = _hf_config(eos_token_id=[5, 9])
    set_special_ids(config, SimpleNamespace(eos_token_id=7, bos_token_id=3))
    assert config.eos_token_id == 7
    # no tokenizer (--no-tokenizer): the recorded ids stay, but none outside the vocabulary
    config = _hf_config(bos_token_id=50256, eos_token_id=[2, 50256], pad_token_id=3)
    notes = set_special_ids(config, None)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, [2], 3)
    assert notes == ["bos_token_id 50256 is outside the 250-token vocabulary: left unset (a --tokenizer with that "
                     "token sets it)",
                     "eos_token_id 50256 is outside the 250-token vocabulary: kept [2] (a --tokenizer with that "
                     "token sets it)"]
