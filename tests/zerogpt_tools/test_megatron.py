"""Megatron-LM checkpoints in and out (issue 40): zerogpt_tools.import_megatron and export --format megatron.

The fixtures are tiny checkpoints that megatron_reference.py writes from Megatron's documented layout (not with
the exporter), and their logits come from a forward written from the same documentation (not zerogpt's model):
- Megatron -> zerogpt -> Megatron is bit-exact at TP 1/2 x PP 1/2: legacy GPT-2, Megatron-Core Llama with GQA and
  SwiGLU (TE names), legacy Llama, a tied Llama with qkv bias, and torch_dist through DCP;
- every legacy checkpoint_version's qkv order imports to the same model;
- the imported checkpoint continues in the engine at ZeRO-3 on 2 ranks with the trainer at Megatron's iteration;
- transformers' Megatron GPT-2 converter turns the legacy export into the model our own HF export is;
- bad input is one line each.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.zerogpt_tools import megatron_reference as ref
from zerogpt.checkpoint import CheckpointReader
from zerogpt_tools.export import ModelPlugin, main as export_main
from zerogpt_tools.export_megatron import export_megatron
from zerogpt_tools.import_megatron import import_megatron, main as import_main
from zerogpt_tools.megatron_files import load_pt

pytestmark = [pytest.mark.timeout(120),  # the fixtures' own DCP calls run without a process group, as meant
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

ITERATION = 100


def ids() -> torch.Tensor:
    return torch.randint(0, ref.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def zerogpt_logits(checkpoint: str) -> torch.Tensor:
    """Logits of model_zoo's model rebuilt from a zerogpt checkpoint (real-vocabulary columns)."""
    reader = CheckpointReader(checkpoint)
    model = ModelPlugin(reader.meta["model"]).build().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.tensor(name))
        return model(ids())[..., :ref.VOCAB]


def flat_model(path: str) -> dict[str, torch.Tensor]:
    """A rank file's model tensors by dotted key (the legacy nesting flattened)."""
    out = {}

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                out[prefix + k] = v
    walk(torch.load(path, weights_only=False)["model"], "")
    return out


def rank_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
                  if f == "model_optim_rng.pt")


CASES = {  # name: (args maker, args overrides, layout, TE names)
    "gpt-legacy": (ref.gpt_args, {}, "legacy", True),
    "llama-core": (ref.llama_args, {}, "core", True),
    "llama-legacy": (ref.llama_args, dict(use_mcore_models=False), "legacy", True),
    "qwen2-tied-core-local": (ref.llama_args, dict(add_qkv_bias=True, untie_embeddings_and_output_weights=False),
                              "core", False),
    "llama3-rope-scaling": (ref.llama_args, dict(use_rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000),
                            "core", True),
    "qwen3-qk-layernorm": (ref.llama_args, dict(qk_layernorm=True), "core", True),
}


SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2)]
ROUND_TRIPS = [(case, tp, pp) for case in ("gpt-legacy", "llama-core") for tp, pp in SPLITS] + \
    [(case, tp, pp) for case in ("llama-legacy", "qwen2-tied-core-local") for tp, pp in ((1, 1), (2, 2))] + \
    [("llama3-rope-scaling", 1, 1), ("qwen3-qk-layernorm", 2, 1)]


@pytest.mark.parametrize("case,tp,pp", ROUND_TRIPS)
def test_megatron_zerogpt_megatron_is_bit_exact(tmp_path, case, tp, pp):
    make, over, layout, te = CASES[case]
    args = make(tp, pp, **over)
    weights = ref.random_weights(args)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, weights, ITERATION, layout, te=te)

    stats = import_megatron(src, str(tmp_path / "run"))
    assert stats["iteration"] == ITERATION and stats["checkpoint"].endswith(f"step_{ITERATION}")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == f"step_{ITERATION}"
    torch.testing.assert_close(zerogpt_logits(stats["checkpoint"]), ref.reference_logits(args, weights, ids()),
                               atol=2e-5, rtol=0)

    out = export_megatron(str(tmp_path / "run"), str(tmp_path / "back"), tp, pp, core=layout == "core")
    assert out["iteration"] == ITERATION
    assert rank_files(src) == rank_files(str(tmp_path / "back"))
    # the exporter writes Transformer Engine's names; a local-spec source's norms are the same tensors renamed
    local = {te_name: name for name, te_name in ref.TE_NORMS.items()} if not te else {}
    for rel in rank_files(src):
        theirs = flat_model(os.path.join(src, rel))
        ours = {_renamed(k, local): v for k, v in flat_model(str(tmp_path / "back" / rel)).items()}
        assert sorted(theirs) == sorted(ours), rel
        for key, tensor in theirs.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), f"{rel}: {key}"
    back = torch.load(str(tmp_path / "back" / rank_files(src)[0]), weights_only=False)
    assert back["checkpoint_version"] == 3.0 and back["iteration"] == ITERATION
    for key in ("padded_vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "swiglu", "normalization"):
        assert getattr(back["args"], key) == getattr(args, key), key


def _renamed(key: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


@pytest.mark.parametrize("version", [0.0, 1.0, 2.0, None])
def test_every_checkpoint_version_orders_qkv_as_megatron_reads_it(tmp_path, version):
    """Version 0 ([3, np, hn] per rank), 1 ([np, hn, 3]), 2/3 ([np, 3, hn]); no key means 0, as in Megatron."""
    args = ref.gpt_args(tp=2)
    weights = ref.random_weights(args)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, weights, layout="legacy",
                             version=0.0 if version is None else version)
    if version is None:  # the oldest files carry no checkpoint_version
        for rel in rank_files(src):
            state = torch.load(os.path.join(src, rel), weights_only=False)
            del state["checkpoint_version"]
            torch.save(state, os.path.join(src, rel))
    stats = import_megatron(src, str(tmp_path / "run"))
    assert stats["source"].version == (version or 0.0)
    torch.testing.assert_close(zerogpt_logits(stats["checkpoint"]), ref.reference_logits(args, weights, ids()),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("per_layer", [False, True])
def test_torch_dist_through_dcp(tmp_path, per_layer):
    """Megatron-Core's torch_dist (global tensors, layers stacked, fc1 as [gate; up]; or a key per layer with fc1's
    halves apart) in, and out (stacked) through DCP."""
    import torch.distributed.checkpoint as dcp

    args = ref.llama_args(ckpt_format="torch_dist")
    weights = ref.random_weights(args)
    src = ref.write_torch_dist(str(tmp_path / "megatron"), args, weights, ITERATION, per_layer)
    stats = import_megatron(src, str(tmp_path / "run"))
    assert any("optimizer state" in note and "not imported" in note for note in stats["notes"])
    assert stats["source"].format == "torch_dist"
    torch.testing.assert_close(zerogpt_logits(stats["checkpoint"]), ref.reference_logits(args, weights, ids()),
                               atol=2e-5, rtol=0)
    if per_layer:
        return

    export_megatron(str(tmp_path / "run"), str(tmp_path / "back"), core=True, dist=True)
    directory = str(tmp_path / "back" / f"iter_{ITERATION:07d}")
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    theirs = dcp.FileSystemReader(os.path.join(src, f"iter_{ITERATION:07d}")).read_metadata().state_dict_metadata
    keys = sorted(k for k in theirs if not k.startswith("optimizer."))
    assert sorted(metadata) == keys
    got = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    want = {k: torch.empty_like(v) for k, v in got.items()}
    dcp.load(got, checkpoint_id=directory)
    dcp.load(want, checkpoint_id=os.path.join(src, f"iter_{ITERATION:07d}"))
    for key in keys:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert got["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 2 * args.ffn_hidden_size, args.hidden_size)


LEGACY_SPELLINGS = {  # what Megatron-LM v1.x and the last legacy versions named what the reference writes
    "v1": [("language_model.encoder", "language_model.transformer"), (".self_attention.", ".attention.")],
    "late": [("input_layernorm.", "input_norm."), ("post_attention_layernorm.", "post_attention_norm."),
             ("final_layernorm.", "final_norm.")],
    "transformer-engine": [("input_layernorm.", "self_attention.layernorm_qkv.layer_norm_"),
                           ("self_attention.query_key_value.", "self_attention.layernorm_qkv."),
                           ("self_attention.dense.", "self_attention.proj."),
                           ("post_attention_layernorm.", "layernorm_mlp.layer_norm_"),
                           ("mlp.dense_h_to_4h.", "layernorm_mlp.fc1_"), ("mlp.dense_4h_to_h.", "layernorm_mlp.fc2_")],
}


@pytest.mark.parametrize("spelling", sorted(LEGACY_SPELLINGS))
def test_legacy_spellings_of_other_megatron_versions(tmp_path, spelling):
    args = ref.gpt_args()
    weights = ref.random_weights(args)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, weights, layout="legacy")
    path = os.path.join(src, f"iter_{ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    lm = state["model"]["language_model"]

    def respell(key: str) -> str:
        for old, new in LEGACY_SPELLINGS[spelling]:
            key = key.replace(old, new)
        return key
    encoder = {respell("language_model.encoder." + k).split(".", 2)[2]: v for k, v in lm.pop("encoder").items()}
    lm[respell("language_model.encoder").split(".")[1]] = encoder
    torch.save(state, path)
    stats = import_megatron(src, str(tmp_path / "run"))
    torch.testing.assert_close(zerogpt_logits(stats["checkpoint"]), ref.reference_logits(args, weights, ids()),
                               atol=2e-5, rtol=0)


def _continue(rank: int, world: int, checkpoint: str, batch: torch.Tensor):
    """Load the imported checkpoint into a ZeRO-3 engine on `world` ranks and take one step."""
    import zerogpt
    from model_zoo import GPTLMLoss
    from zerogpt.config import LRSchedulerConfig
    from zerogpt.context import DistContext
    from zerogpt.optim.lr_scheduler import build_lr_scheduler
    from zerogpt.trainer import Trainer

    torch.manual_seed(0)
    model = ModelPlugin(CheckpointReader(checkpoint).meta["model"]).build()
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                config=zerogpt.Config(dict(zero=dict(stage=3))), ctx=DistContext.current())
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    engine.ctx.logger.addHandler(handler)
    sched = build_lr_scheduler(engine.optimizer, LRSchedulerConfig(type="cosine", warmup_steps=10), 1000)
    trainer = Trainer(engine, lr_scheduler=sched)
    trainer.load_state_dict(engine.load_checkpoint(checkpoint))
    lr = engine.optimizer.param_groups[0]["lr"]  # the first continued step's rate: the schedule's at the iteration
    expected_lr = 1e-3 * sched.lr_lambdas[0](ITERATION)
    engine.eval()
    with torch.no_grad():
        logits = engine(ids())[..., :ref.VOCAB]
    engine.train()
    engine.backward(GPTLMLoss(shift=False)(engine(batch[rank][:, :-1]), batch[rank][:, 1:]))
    engine.step()
    engine.close()
    return logits, trainer.state.step, sched.last_epoch, said, (lr, expected_lr)


@pytest.mark.slow
def test_imported_checkpoint_continues_at_zero3_on_two_ranks(tmp_path, capsys):
    """The seed's case in miniature: a GPT-2 trained at TP=2 in Megatron, with its optimizer state, continues in
    zerogpt at ZeRO-3 on 2 data-parallel ranks with the trainer at Megatron's iteration and a fresh optimizer."""
    args = ref.gpt_args(tp=2)
    weights = ref.random_weights(args)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, weights, ITERATION, optimizer=True)
    from tokenizers import Tokenizer, models  # the run's tokenizer: its size is the real vocabulary

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(ref.VOCAB)}, unk_token="w0")).save(str(tmp_path / "tok.json"))
    assert import_main([src, "--out", str(tmp_path / "run"), "--tokenizer", str(tmp_path / "tok.json")]) == 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    printed = capsys.readouterr().out
    assert "optimizer state, which is not imported" in printed and "the optimizer starts fresh" in printed
    assert "model = dict(type=gpt2_tiny" in printed
    checkpoint = str(tmp_path / "run" / "checkpoints" / f"step_{ITERATION}")
    assert CheckpointReader(checkpoint).meta["model"]["config"]["vocab_size"] == ref.VOCAB
    batch = torch.randint(0, ref.VOCAB, (2, 2, 17), generator=torch.Generator().manual_seed(5))
    results = run_distributed(_continue, 2, checkpoint, batch, timeout=100)
    expected = ref.reference_logits(args, weights, ids())
    for logits, step, last_epoch, said, (lr, expected_lr) in results:
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
        assert step == last_epoch == ITERATION
        assert lr == pytest.approx(expected_lr) and expected_lr != pytest.approx(1e-3 * 1 / 10), lr
    assert any("holds no optimizer state" in line and "starts fresh" in line for line in results[0][3])


CONVERTER_FILE = "convert_megatron_gpt2_checkpoint.py"


def _converter():
    """transformers' convert_megatron_gpt2_checkpoint: the file MEGATRON_GPT2_CONVERTER names, else the copy `make
    install` takes from transformers 4.46.3's sdist into the virtual environment (its wheels leave the converters
    out, and transformers 5 has none), else the installed transformers' own."""
    path = os.environ.get("MEGATRON_GPT2_CONVERTER") or os.path.join(sys.prefix, CONVERTER_FILE)
    if os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("convert_megatron_gpt2_checkpoint", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    name = "transformers.models.megatron_gpt2.convert_megatron_gpt2_checkpoint"
    try:
        return importlib.import_module(name)
    except ImportError:
        import transformers
        pytest.skip(f"transformers {transformers.__version__} does not ship {name}, and {path} is missing: run "
                    f"`make install`, or set MEGATRON_GPT2_CONVERTER to a copy of that file")


def test_transformers_megatron_gpt2_converter_reads_the_legacy_export(tmp_path):
    """The seed's workflow: Megatron GPT-2 at TP=2 -> zerogpt -> legacy export at TP=1 -> transformers' converter
    -> the same logits as zerogpt's own Hugging Face export."""
    transformers = pytest.importorskip("transformers")
    converter = _converter()
    from zerogpt_tools.export import export_checkpoint

    args = ref.gpt_args(tp=2)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args), ITERATION)
    import_megatron(src, str(tmp_path / "run"), vocab_size=ref.VOCAB)
    assert export_main([str(tmp_path / "run"), "--format", "megatron", "--out", str(tmp_path / "mg")]) == 0
    state = torch.load(str(tmp_path / "mg" / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"),
                       weights_only=False)
    config = transformers.GPT2Config()
    hf_state = converter.convert_megatron_checkpoint(None, state, config)
    megatron_args = state["args"]  # the activation its main() picks from them
    config.activation_function = "gelu_fast" if megatron_args.bias_gelu_fusion else \
        "gelu_new" if megatron_args.openai_gelu else "gelu"
    converted = transformers.GPT2LMHeadModel(config).eval()
    converted.load_state_dict(hf_state, strict=False)
    export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"), with_tokenizer=False)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(ids()).logits[..., :ref.VOCAB], ours(ids()).logits, atol=1e-5, rtol=0)


def _one_line_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        import_main(argv)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_bad_input_is_one_line(tmp_path):
    args = ref.gpt_args(tp=2)
    weights = ref.random_weights(args)

    def fresh(name: str, **kwargs) -> str:
        return ref.write_megatron(str(tmp_path / name), kwargs.pop("args", args), weights, ITERATION, **kwargs)

    out = ["--out", str(tmp_path / "run")]
    assert "checkpoint_version 4.0 is unknown" in _one_line_error([fresh("v4", version=4.0), *out])

    odd = fresh("layout")
    path = os.path.join(odd, f"iter_{ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["model"] = {"transformer_blocks": {"w": torch.zeros(1)}}
    torch.save(state, path)
    assert "neither the legacy layout" in _one_line_error([odd, *out])

    missing = fresh("missing")
    shutil.rmtree(os.path.join(missing, f"iter_{ITERATION:07d}", "mp_rank_01"))
    assert "mp_rank_01/model_optim_rng.pt is missing" in _one_line_error([missing, *out])

    wrong = fresh("shape", args=ref.gpt_args(tp=2, ffn_hidden_size=128))
    message = _one_line_error([wrong, *out])
    assert "mlp.linear_fc1.weight is [256, 64], but the args" in message and "ffn_hidden_size=128" in message

    assert "not a Megatron checkpoint" in _one_line_error([str(tmp_path), *out])
    os.makedirs(tmp_path / "used" / "checkpoints")
    (tmp_path / "used" / "checkpoints" / "latest").write_text("step_5\n")
    assert "already holds a run's checkpoints" in _one_line_error([fresh("good0"), "--out", str(tmp_path / "used")])
    mixed = fresh("mixed", args=ref.gpt_args(tp=2, swiglu=True))
    assert "mix GPT-2 and Llama traits" in _one_line_error([mixed, *out])

    # The export refuses splits Megatron cannot load, in one line too
    import_megatron(fresh("good"), str(tmp_path / "run"))
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path / "run"), "--format", "megatron", "--tp", "3", "--out", str(tmp_path / "x")])
    assert "--tp 3 must divide num_attention_heads=4" in str(e.value) and "\n" not in str(e.value)


def test_import_reads_files_without_running_their_code(tmp_path):
    """Megatron pickles hold classes of Megatron itself (enums in args, optimizer objects): the reader builds
    placeholders for them instead of importing anything, so a file cannot run code and Megatron need not exist."""
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    args = ref.gpt_args(attention_backend=Payload())
    path = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args))
    state = load_pt(os.path.join(path, f"iter_{ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt"))
    assert "not imported" in repr(state["args"].attention_backend)
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------------------
# issue 48: the token count survives a round trip; --tokenizer saves the tokenizer alone, and the tools find it


def _trainer_counters(run: str) -> dict:
    return CheckpointReader(os.path.join(run, "checkpoints", f"step_{ITERATION}")).meta["extra_state"]["trainer"]


def test_round_trip_keeps_the_tokens_seen(tmp_path):
    """Megatron's consumed_train_samples x seq_length is the tokens seen: the export writes the length the run
    trained at (tokens_seen / consumed_samples), not the model's context, so a run exported and imported again
    closes with the tokens it really saw (issue 48: 76,800 where 46,080 were seen, the context being twice the
    training length)."""
    args = ref.gpt_args(seq_length=ref.gpt_args().max_position_embeddings // 2)
    src = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args), ITERATION)
    import_megatron(src, str(tmp_path / "run"))
    first = _trainer_counters(str(tmp_path / "run"))
    assert first["tokens_seen"] == args.consumed_train_samples * args.seq_length
    assert first["consumed_samples"] == 0  # where zerogpt's sampler starts: Megatron's data order is its own
    assert export_main([str(tmp_path / "run"), "--format", "megatron", "--out", str(tmp_path / "mg")]) == 0
    written = load_pt(str(tmp_path / "mg" / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"))["args"]
    assert (written.seq_length, written.consumed_train_samples) == (args.seq_length, args.consumed_train_samples)
    import_megatron(str(tmp_path / "mg"), str(tmp_path / "again"))
    assert _trainer_counters(str(tmp_path / "again"))["tokens_seen"] == first["tokens_seen"]


def test_trained_seq_length_is_the_runs_not_the_context():
    """The issue's run (30 steps of 4 x 256 tokens, a context of 512), from scratch and after an import: the run
    config's SEQ_LEN wins; an import not trained since keeps Megatron's; else the trainer's own ratio."""
    from zerogpt_tools.export_megatron import trained_seq_length

    steps, batch, seq, context = 30, 4, 256, 512
    scratch = {"consumed_samples": steps * batch, "tokens_seen": steps * batch * seq}
    assert trained_seq_length(scratch, None, None, context) == seq
    assert trained_seq_length(scratch, None, seq, context) == seq
    megatron_samples = 640  # imported, then trained on: consumed_samples counts zerogpt's samples only
    continued = {"consumed_samples": steps * batch, "tokens_seen": (megatron_samples + steps * batch) * seq}
    assert trained_seq_length(continued, None, seq, context) == seq
    assert trained_seq_length({"consumed_samples": 0, "tokens_seen": megatron_samples * seq},
                              {"consumed_train_samples": megatron_samples, "seq_length": seq}, None, context) == seq
    assert trained_seq_length({"consumed_samples": 0, "tokens_seen": 0}, None, None, context) == context


def test_the_run_configs_seq_len_is_read_or_left_to_the_counters(tmp_path):
    from zerogpt_tools.export_megatron import _config_seq_len

    (tmp_path / "config.py").write_text("SEQ_LEN = 96\n")
    (tmp_path / "gone.py").write_text("import a_package_not_installed_here\n")
    assert _config_seq_len(str(tmp_path / "config.py")) == 96
    assert _config_seq_len(str(tmp_path / "gone.py")) is None and _config_seq_len(None) is None


def test_import_saves_the_tokenizer_alone_and_generate_and_export_find_it(tmp_path):
    """--tokenizer given a model directory (weights, config.json and tokenizer files) saves the tokenizer's files
    only, through transformers' save_pretrained; generate's load_model and export read RUN/tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from zerogpt_tools.export import export_checkpoint
    from zerogpt_tools.generate import load_model

    model_dir = tmp_path / "hf_model"
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(ref.VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1").save_pretrained(str(model_dir))
    (model_dir / "model.safetensors").write_bytes(b"\0" * 4096)  # what a real model directory also holds
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    args = ref.gpt_args()
    src = ref.write_megatron(str(tmp_path / "megatron"), args, ref.random_weights(args), ITERATION)
    assert import_main([src, "--out", str(tmp_path / "run"), "--tokenizer", str(model_dir)]) == 0
    saved = set(os.listdir(tmp_path / "run" / "tokenizer"))
    assert "tokenizer.json" in saved and not saved & {"model.safetensors", "config.json"}, saved
    assert not [p for p in os.listdir(tmp_path / "run") if p.startswith(".")]  # the temporary one was renamed
    model, tok = load_model(str(tmp_path / "run"))
    assert len(tok) == ref.VOCAB == model.config.vocab_size
    stats = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert "tokenizer.json" in stats["files"] and stats["vocab_size"] == ref.VOCAB
