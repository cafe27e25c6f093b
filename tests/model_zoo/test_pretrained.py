"""model_zoo/pretrained.py: Hugging Face checkpoints of the Llama family streamed into each rank's shards.

zerogpt.initialize fills a meta-built model from the safetensors files at ZeRO stages 0-3, on 1 and 2 gloo ranks,
and its logits equal transformers' (fp32, <= 1e-5) for every family; a rank never holds a whole parameter while
loading at stage 3; bad checkpoints are one line naming the file and tensor.
"""
from __future__ import annotations

import json
import re
import os

import pytest
import torch
from torch.utils._pytree import tree_flatten

import zerogpt
from model_zoo import build_model, from_pretrained
from tests.dist_utils import run_distributed
from tests.model_zoo.hf_families import FAMILIES, VOCAB, make_hf_model
from tests.zero.init_checks import LargestAllocation
from tests.zero.reference import cpu_ctx
from zerogpt.zero import BucketTensorShardStrategy

IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def _expected_logits(root) -> dict[str, torch.Tensor]:
    out = {}
    for family in sorted(FAMILIES):
        hf = make_hf_model(family, root / family, seed=len(family))
        with torch.no_grad():
            out[family] = hf(IDS).logits
    return out


def _engine_logits(rank: int, world: int, root: str, stages: tuple[int, ...]) -> dict:
    out = {}
    for family in sorted(FAMILIES):
        for stage in stages:
            model = build_model(dict(type="hf", path=os.path.join(root, family)))
            assert all(p.is_meta for p in model.parameters())  # nothing read yet
            config = zerogpt.Config(dict(zero=dict(stage=stage, shard_strategy=BucketTensorShardStrategy(
                bucket_mb=0.02))))  # several chunks, each cut across the ranks
            engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=config,
                                        ctx=cpu_ctx(rank, world))
            engine.eval()
            with torch.no_grad():
                out[(family, stage)] = engine(IDS)
            engine.close()
    return out


@pytest.mark.timeout(200)
def test_streamed_into_every_stage_on_two_ranks_equals_transformers(tmp_path):
    expected = _expected_logits(tmp_path)
    for rank_out in run_distributed(_engine_logits, 2, str(tmp_path), (0, 1, 2, 3), timeout=180):
        for (family, stage), logits in rank_out.items():
            diff = (logits - expected[family]).abs().max().item()
            assert diff <= 1e-5, f"{family} stage {stage} on 2 ranks: max diff {diff}"


@pytest.mark.timeout(120)
def test_streamed_into_every_stage_on_one_rank_equals_transformers(tmp_path):
    expected = _expected_logits(tmp_path)
    (rank_out,) = run_distributed(_engine_logits, 1, str(tmp_path), (0, 1, 2, 3), timeout=100)
    for (family, stage), logits in rank_out.items():
        assert (logits - expected[family]).abs().max().item() <= 1e-5, (family, stage)


def _file_mapped(ptr: int) -> bool:
    """Whether address `ptr` lies in a mapping of a file (/proc/self/maps): safetensors' slices are views of the
    file's pages, of which only those read become resident, so such a storage is not memory the load holds."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) > 5 and fields[5].endswith(".safetensors")
    return False


class LargestHeldAllocation(LargestAllocation):
    """LargestAllocation, not counting views of the safetensors files' mapped pages."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes() > self.max_bytes \
                    and not _file_mapped(t.untyped_storage().data_ptr()):
                self.max_bytes = t.untyped_storage().nbytes()
        return out


def _load_watched(rank: int, world: int, path: str) -> dict:
    os.environ["ZEROGPT_SHM_COMM"] = "0"  # its staging buffer is communication, not model state
    watch = LargestHeldAllocation()
    with watch:
        model = from_pretrained(path)
        config = zerogpt.Config(dict(zero=dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=1))))
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=config,
                                    ctx=cpu_ctx(rank, world))
    out = dict(max_bytes=watch.max_bytes, largest_shard=max(c.plan.shard_numel for c in engine.chunks) * 4)
    engine.close()
    return out


@pytest.mark.timeout(120)
def test_loading_at_stage_3_never_holds_a_whole_parameter(tmp_path):
    # a wide untied vocabulary: the embedding and the head are 2 x 4096 x 256 fp32 = 4 MiB each
    make_hf_model("llama", tmp_path, vocab_size=4096, hidden_size=256, intermediate_size=512)
    whole_embedding = 4096 * 256 * 4
    for r in run_distributed(_load_watched, 2, str(tmp_path), timeout=100):
        # the largest read is a shard's worth of rows (plus the two rows its ends cut), never the embedding
        assert r["max_bytes"] <= r["largest_shard"] + 2 * 256 * 4, r
        assert r["max_bytes"] < whole_embedding, r


# ----------------------------------------------------------------------------------------------
# bad checkpoints: one line naming the file and what is wrong


def _relabel(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_a_label_that_contradicts_the_fields_loads_natively_with_a_note(tmp_path):
    """FalconForCausalLM over a Llama's config.json (model_type "llama", Llama's keys and tensors): the fields
    win, as transformers' AutoModelForCausalLM lets them, and the path taken says so (issue 48.5)."""
    hf = make_hf_model("llama", tmp_path)
    _relabel(tmp_path, architectures=["FalconForCausalLM"])
    said = []
    model = build_model(dict(type="hf", path=str(tmp_path)), log=said.append)
    assert said[0] == (f"model: {tmp_path} (LlamaForCausalLM) loads natively, streamed: model_zoo's Llama on the "
                       f"meta device, each rank reading only its own shards from the safetensors files")
    assert said[1] == (f"note: config.json's architectures says FalconForCausalLM but its model_type 'llama' and "
                       f"fields are LlamaForCausalLM's; loaded natively as LlamaForCausalLM, the class transformers' "
                       f"AutoModelForCausalLM builds for it")
    assert len(said) == 2 and model.config.architecture == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(str(tmp_path), device="cpu")(IDS), hf(IDS).logits,
                                   atol=1e-5, rtol=0)


def test_qwen_sliding_window_layers_are_refused_not_attended_in_full(tmp_path):
    """Qwen3, like Qwen2, slides its window over the layers from max_window_layers on when use_sliding_window is
    set; the native model attends in full, so it refuses in one line rather than differ past the window."""
    for family in ("qwen2", "qwen3"):
        hf = make_hf_model(family, tmp_path / family, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        assert hf.config.layer_types == ["full_attention", "sliding_attention"]
        with pytest.raises(ValueError, match=r"\{'use_sliding_window': True\} is not supported"):
            from_pretrained(str(tmp_path / family))


def test_a_qwen_window_no_layer_takes_and_swish_load_natively(tmp_path):
    """use_sliding_window with max_window_layers at or past the layer count slides no layer in transformers, and
    hidden_act "swish" is its SiLU: both were refused; they load natively with transformers' logits."""
    for family, keys in (("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
                         ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
                         ("llama", dict(hidden_act="swish"))):
        hf = make_hf_model(family, tmp_path / family, **keys)
        assert "sliding_attention" not in (getattr(hf.config, "layer_types", None) or [])
        with torch.no_grad():
            torch.testing.assert_close(from_pretrained(str(tmp_path / family), device="cpu")(IDS), hf(IDS).logits,
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope, refused", [(dict(rope_type="yarn", factor=4.0), "'rope_type': 'yarn'"),
                                           (dict(rope_type="default", partial_rotary_factor=0.5),
                                            "'partial_rotary_factor': 0.5")])
def test_rope_the_family_does_not_compute_is_refused_naming_config_json(tmp_path, rope, refused):
    """yarn RoPE and partial rotary were refused from inside LlamaConfig, naming neither the file nor the generic
    path that trains them; they are now refused with the other keys."""
    make_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_scaling=rope, rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json: \{{{refused}\}} is not supported .* generic=True"):
        from_pretrained(str(tmp_path))


def test_mistral_without_a_sliding_window_key_has_transformers_default_window(tmp_path):
    """A Mistral config.json that omits sliding_window gets MistralConfig's default, 4096, in transformers; the
    native model takes the same window (so a longer sequence is refused), not none."""
    import transformers

    make_hf_model("mistral", tmp_path, sliding_window=None)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(tmp_path).sliding_window == 4096
    assert from_pretrained(str(tmp_path)).config.sliding_window == 4096


def test_each_path_says_what_it_costs(tmp_path):
    """A native directory loads in one line and no note; any other causal LM says it takes transformers' generic
    path with the whole model on every rank, and names the four native architectures."""
    from model_zoo.pretrained import load_path

    make_hf_model("qwen3", tmp_path / "qwen3")
    native = load_path(str(tmp_path / "qwen3"))
    assert native.native and native.architecture == "Qwen3ForCausalLM" and native.note is None
    (tmp_path / "neox").mkdir()
    (tmp_path / "neox" / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"],
                                                               "model_type": "gpt_neox"}))
    generic = load_path(str(tmp_path / "neox"))
    assert not generic.native and generic.note is None
    assert generic.describe() == (
        f"model: {tmp_path / 'neox'} (GPTNeoXForCausalLM) loads through transformers' generic path "
        f"(AutoModelForCausalLM): the whole model on every rank while loading, ~9.5 bytes/param of host memory per "
        f"rank at peak; the native, streamed architectures are LlamaForCausalLM, Qwen2ForCausalLM, "
        f"Qwen3ForCausalLM, MistralForCausalLM")
    forced = load_path(str(tmp_path / "qwen3"), generic=True)
    assert not forced.native and forced.note == "generic=True in the model dict (it is native as Qwen3ForCausalLM)"


def test_unknown_architecture_names_the_native_ones_and_the_generic_path(tmp_path):
    make_hf_model("llama", tmp_path)
    _relabel(tmp_path, architectures=["FooForCausalLM"], model_type="foo")
    native = ("(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)")
    with pytest.raises(ValueError) as e:
        build_model(dict(type="hf", path=str(tmp_path)))
    assert str(e.value) == (f"{tmp_path}/config.json: architectures=['FooForCausalLM'] (model_type 'foo') is neither "
                            f"one of the four native architectures {native} nor a causal LM the installed "
                            f"transformers knows, which transformers' generic path, model = dict(type='hf', path=DIR)"
                            f" (AutoModelForCausalLM; the whole model on every rank while loading) needs")
    with pytest.raises(ValueError) as e:
        from_pretrained(str(tmp_path))
    assert str(e.value) == (f"{tmp_path}/config.json: architectures=['FooForCausalLM'] (model_type 'foo') is not one "
                            f"of the four native architectures {native}; other causal LMs train through "
                            f"transformers' generic path, model = dict(type='hf', path=DIR) (AutoModelForCausalLM; "
                            f"the whole model on every rank while loading)")


def test_the_vocabulary_error_names_config_json_vocab_size_not_the_padded_rows(tmp_path):
    """A native model pads its embedding (1000 -> 1024 rows); the tokenizer is compared with config.json's
    vocab_size, and the message names that number (issue 48.6)."""
    make_hf_model("llama", tmp_path, vocab_size=1000)
    model = from_pretrained(str(tmp_path))
    rows, real = model.get_input_embeddings().num_embeddings, model.config.vocab_size
    assert rows > real == 1000
    with pytest.raises(ValueError) as e:
        build_model(dict(type="hf", path=str(tmp_path)), vocab_size=rows + 1)
    assert str(e.value) == (f"the tokenizer has {rows + 1} tokens but {tmp_path}/config.json's vocab_size is {real}; "
                            f"use the model's own tokenizer (data.tokenizer) or resize the model "
                            f"(python -m zerogpt_tools.extend_vocab)")
    with pytest.raises(ValueError, match=f"tokenizer has {real + 1} tokens"):  # a padding row is no token
        build_model(dict(type="hf", path=str(tmp_path)), vocab_size=real + 1)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("qwen2", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor 'model.layers.1.self_attn.k_proj.bias'"):
        from_pretrained(str(tmp_path))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\] but config.json makes it \[64\]"):
        from_pretrained(str(tmp_path))


def test_corrupt_file_and_missing_weights_are_named(tmp_path):
    make_hf_model("mistral", tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors is corrupt, truncated or missing"):
        from_pretrained(str(tmp_path))
    path.unlink()
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        from_pretrained(str(tmp_path))


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf = make_hf_model("llama", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = from_pretrained(str(tmp_path / "sharded"), device="cpu").eval()
    with torch.no_grad():
        assert (ours(IDS) - hf(IDS).logits).abs().max().item() <= 1e-5


def test_factory_pretrained_checks_the_shape(tmp_path):
    from model_zoo import llama3_8b, llama_tiny

    make_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="which is not llama3_8b"):
        llama3_8b(pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="which is not llama_tiny"):  # tiny's widths are not the fixture's
        llama_tiny(pretrained=str(tmp_path))
    model = from_pretrained(str(tmp_path), checkpoint=True)
    assert model.config.checkpoint and model.config.vocab_size == VOCAB


# ----------------------------------------------------------------------------------------------
# a meta model called directly says what it is (issue 48.8)


def test_a_meta_model_called_directly_says_what_to_do(tmp_path):
    """from_pretrained(DIR) is on the meta device by default, for zerogpt.initialize; called as transformers' model
    is, it raises one line naming both ways out, not torch's "not on the expected device meta"."""
    from model_zoo import gpt2_tiny

    make_hf_model("llama", tmp_path)
    fix = ('load them with model_zoo.from_pretrained(DIR, device="cpu") (or "cuda"), or give the model to '
           'zerogpt.initialize, which fills each rank\'s shards')
    with pytest.raises(RuntimeError) as e:
        from_pretrained(str(tmp_path))(IDS)
    assert str(e.value) == ("Llama's weights are on the meta device (model.embed_tokens.weight has no values: "
                            "model_zoo.from_pretrained(DIR) and a meta build leave them there for "
                            "zerogpt.initialize); " + fix)
    with torch.device("meta"):
        gpt = gpt2_tiny(vocab_size=VOCAB)
    assert gpt(IDS.to("meta")).shape == (*IDS.shape, VOCAB)  # shape propagation on meta inputs stays allowed
    with pytest.raises(RuntimeError, match="^GPT's weights are on the meta device .*" + re.escape(fix) + "$"):
        gpt(IDS)
    assert from_pretrained(str(tmp_path), device="cpu")(IDS).shape == (*IDS.shape, VOCAB)


def test_the_docs_describe_the_paths_the_code_takes():
    """docs/models.md shows the load lines LoadPath prints, and docs/configs.md's `model` row says what models.md
    says: the four native architectures stream, and only the generic path loads the whole model on every rank."""
    from model_zoo.llama_adapter import ARCHITECTURES
    from model_zoo.pretrained import LoadPath

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    models = open(os.path.join(root, "docs", "models.md")).read()
    assert LoadPath("ckpt/Llama-3.2-1B", True, "LlamaForCausalLM").describe() in models
    assert LoadPath("ckpt/falcon-7b", False, "FalconForCausalLM").describe() in models
    row = next(line for line in open(os.path.join(root, "docs", "configs.md")) if line.startswith("| `model` |"))
    native, _, generic = row.partition("generic path")
    assert all(arch in native for arch in ARCHITECTURES) and "stream" in native, row
    assert "every rank loads all of it" in generic and "every rank loads all of it" not in native, row


@pytest.mark.parametrize("keys, slides", [(dict(max_window_layers=1), True), (dict(max_window_layers=2), False),
                                          (dict(max_window_layers=1, sliding_window=None), False),
                                          (dict(), False), (dict(max_window_layers=1, use_sliding_window=False), False)])
def test_a_transformers_4_qwen_config_without_layer_types_slides_by_transformers_rule(keys, slides):
    """A config.json without layer_types (transformers 4 wrote none): windowed from max_window_layers (default 28)
    on, when use_sliding_window is set and the window is not null."""
    from model_zoo.llama_adapter import _qwen_slides

    assert _qwen_slides({"use_sliding_window": True, "sliding_window": 8, "num_hidden_layers": 2, **keys}) == slides
