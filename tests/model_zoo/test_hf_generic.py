"""`model = dict(type="hf", path=DIR)` for a transformers causal LM that zerogpt has no adapter for (GPT-NeoX):
train_gpt.py trains it at ZeRO-3 on 2 ranks, saves, resumes with --resume auto and exports it to a directory that
AutoModelForCausalLM loads with the checkpoint's weights; the launch prints nothing before zerogpt's first line;
the checkpoint records the model's config as plain JSON (model_zoo/hf.py::load_hf_causal_lm,
zerogpt/checkpoint.py::_model_description)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from model_zoo.hf import load_hf_causal_lm  # noqa: E402
from tests.test_run_faults import data_dir  # noqa: E402,F401 (fixture: the sample corpus, tokenized once)
from tests.test_train_gpt import read_jsonl, torchrun  # noqa: E402
from train_gpt import SAMPLE_VOCAB  # noqa: E402
from zerogpt.checkpoint import CheckpointReader, _model_description  # noqa: E402
from zerogpt_tools.export import ModelPlugin  # noqa: E402

# What importing transformers' model classes printed on every rank before load_hf_causal_lm dropped it: torchao's
# kernels built for other Python/CUDA versions, torch's pytree deprecation, transformers' per-rank load bar.
NOISE = ("Failed to load", "is an Enum subclass", "_pytree", "Loading weights")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random 2-layer, width-64 GPT-NeoX whose vocabulary is the bundled sample tokenizer's (2,048)."""
    path = tmp_path_factory.mktemp("neox") / "hf"
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=SAMPLE_VOCAB, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=128, max_position_embeddings=128,
                                        bos_token_id=0, eos_token_id=0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------- unit


@pytest.mark.parametrize("dtype, name", [(None, "float32"), (torch.bfloat16, "bfloat16")])
def test_checkpoint_records_a_transformers_config_as_plain_json(hf_dir, dtype, name):
    """transformers >= 5 configs are dataclasses whose `dtype` is a torch.dtype once loaded: the description
    records config.json's form ("float32"), from which the exporter rebuilds the same config."""
    model = load_hf_causal_lm(str(hf_dir), **({"dtype": dtype} if dtype else {}))
    assert isinstance(model.config.dtype, torch.dtype)
    description = json.loads(json.dumps(_model_description(model)))   # raised TypeError before the fix
    assert description["class"] == "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM"
    assert description["config"]["dtype"] == name
    assert ModelPlugin(description).hf_config().to_dict() == model.config.to_dict()


@dataclasses.dataclass
class _OddConfig:
    width: int = 8
    kinds: tuple = (torch.float16, "x")
    extra: object = dataclasses.field(default_factory=lambda: {1, 2})


class _OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _OddConfig()


def test_a_config_value_json_cannot_hold_is_named():
    with pytest.raises(TypeError, match=r"_OddModel\.config\.extra is a set \(\{1, 2\}\), which a checkpoint's "
                                        r"meta\.json cannot record; make it a number, string"):
        _model_description(_OddModel())
    model = _OddModel()   # a tuple of dtypes is fine: a list of their names
    model.config = _OddConfig(extra=None)
    assert _model_description(model)["config"] == {"width": 8, "kinds": ["float16", "x"], "extra": None}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_load_drops_exactly_the_import_noise_and_only_while_loading(hf_dir, monkeypatch):
    """The torchao "Failed to load <.so>" and torch pytree Enum records go; any other record of those loggers
    (a real torchao error) still prints, and once loaded the loggers and the load bar are as they were."""
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    records = _Records()
    for logger in loggers:
        logger.addHandler(records)
    lines = ["Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
             "Skipping import of cpp extensions due to incompatible torch version",   # kept: about this torch
             "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile",
             "register_constant failed for <class 'Foo'>"]                             # kept: not the deprecation

    def noisy_from_pretrained(path, **kwargs):   # what a model class's first import logs
        for i, line in enumerate(lines):
            loggers[i // 2].warning(line)
        info = dict(missing_keys=[], unexpected_keys=[], mismatched_keys=[], error_msgs=[])
        return (nn.Linear(1, 1), info) if kwargs.get("output_loading_info") else nn.Linear(1, 1)

    filters_before = [list(logger.filters) for logger in loggers]
    bar_before = transformers.utils.logging.is_progress_bar_enabled()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", noisy_from_pretrained)
    try:
        load_hf_causal_lm(str(hf_dir))
        kept = list(records.messages)
        loggers[0].warning(lines[0])                 # after the load, nothing is filtered any more
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert sorted(kept) == sorted([lines[1], lines[3]])
    assert records.messages[-1] == lines[0]
    assert [list(logger.filters) for logger in loggers] == filters_before
    assert transformers.utils.logging.is_progress_bar_enabled() == bar_before


# ---------------------------------------------------------------------------------------------------- end to end


def write_config(path, hf_dir, data, out_dir):
    path.write_text(f"""# tests/model_zoo/test_hf_generic.py: a local GPT-NeoX through the generic Hugging Face path
BATCH_SIZE = 4
SEQ_LEN = 64
precision = "fp32"
zero = dict(stage=3)
model = dict(type="hf", path={str(hf_dir)!r})
optimizer = dict(type="AdamW", lr=3e-3)
data = dict(path={f"{data}/stdlib_docs"!r}, tokenizer={f"{data}/tokenizer"!r}, split="949,50,1")
train = dict(max_steps=4, log_interval=2, eval_interval=2, eval_iters=2, save_interval=2,
             output_dir={str(out_dir)!r}, seed=1)
""")
    return str(path)


@pytest.mark.timeout(200)
def test_generic_hf_model_trains_resumes_and_exports_at_stage_3(hf_dir, data_dir, tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "neox_zero3.py", hf_dir, data_dir, out)

    # 2 ranks, ZeRO-3: the first checkpoint used to crash (a torch.dtype in meta.json); the console is the demo's
    proc = torchrun(["--config", config], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = proc.stdout + proc.stderr
    assert not [line for line in log.splitlines() if any(n in line for n in NOISE)], log[:3000]
    assert proc.stdout.startswith("launch: world_size=2") and proc.stderr == "", log[:3000]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_2", "step_4"]
    meta = json.loads((out / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["stage"] == 3 and meta["world_size"] == 2
    assert meta["model"]["class"].endswith("GPTNeoXForCausalLM") and meta["model"]["config"]["dtype"] == "float32"
    first = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(out / "metrics.jsonl")}

    # --resume auto with more steps, from step_2 (as a run killed after step_4's rename, before `latest` moved,
    # leaves it): steps 3-4 come out bit for bit as the first run's, then it goes on to step 6
    (out / "checkpoints" / "latest").write_text("step_2\n")
    proc = torchrun(["--config", config, "--resume", "auto", "--set", "train.max_steps=6"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"resumed from {out}/checkpoints/step_2 at step 2" in proc.stdout
    resumed = {(r["split"], r["step"]): r["loss"] for r in read_jsonl(out / "metrics.jsonl")}
    assert set(resumed) == set(first) | {("train", 6), ("valid", 6)}
    for key, loss in first.items():
        assert resumed[key] == loss, key
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"

    # export the run (its latest checkpoint) and load it as transformers would
    from zerogpt_tools.export import main as export

    assert export([str(out), "--out", str(tmp_path / "hf_out")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", local_files_only=True).eval()
    assert type(exported).__name__ == "GPTNeoXForCausalLM" and exported.config.vocab_size == SAMPLE_VOCAB
    assert len(transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out")) == SAMPLE_VOCAB
    reader = CheckpointReader(str(out / "checkpoints" / "step_6"))
    state = exported.state_dict()
    saved = {name: reader.tensor(name) for name in reader.names()}
    assert set(saved) == set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    initial = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    wte = "gpt_neox.embed_in.weight"
    assert not torch.equal(initial.state_dict()[wte], saved[wte])   # it trained

    # the checkpoint's own model (its recorded class and config, its tensors) gives the export's logits
    ours = ModelPlugin(reader.meta["model"]).build().eval()
    ours.load_state_dict(saved)
    x = torch.randint(0, SAMPLE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, ours(x).logits, rtol=0, atol=0)
        assert not torch.allclose(exported(x).logits, initial(x).logits)
