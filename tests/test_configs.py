"""Every shipped config in configs/ loads, validates, resolves its typed sections and builds its model shape."""
import os
import re

import pytest
import torch

import train_gpt
from model_zoo import build_model
from tests.model_zoo.hf_families import make_hf_model
from zerogpt.config import Config, data_config, engine_config, lr_scheduler_config, parallel_config, train_config
from zerogpt.parallel import ParallelDims
from zerogpt.preflight import PreflightError, check_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))
SHIPPED = ["demo_cpu.py", "gpt2_medium_ddp.py", "gpt2_medium_pp2.py", "gpt2_medium_tp2.py", "gpt2_small_zero2.py",
           "gpt2_small_zero3_offload.py", "gpt2_xl_auto.py", "gpt2_xl_zero3_offload.py", "gpt2_zero3.py",
           "llama3_8b_auto.py", "llama3_8b_zero3_offload.py", "llama_continue_cpu.py", "llama_tiny_cpu.py",
           "qwen2_5_7b_zero3.py"]
# name -> (zero stage, gradient accumulation at the world size of the header's command, param offload, world);
# the accumulation divides GLOBAL_BATCH_SIZE by BATCH_SIZE x the data-parallel size, world / (T x P)
EXPECTED = {"demo_cpu.py": (2, 1, "none", 2), "gpt2_medium_ddp.py": (0, 8, "none", 8),
            "gpt2_medium_pp2.py": (1, 2, "none", 2), "gpt2_medium_tp2.py": (1, 2, "none", 2),
            "gpt2_small_zero2.py": (2, 4, "none", 8), "gpt2_small_zero3_offload.py": (3, 4, "cpu", 4),
            "gpt2_xl_zero3_offload.py": (3, 1, "none", 1),
            "gpt2_xl_auto.py": (0, 1, "none", 1), "llama3_8b_auto.py": (0, 1, "none", 1),  # unplanned: defaults
            "gpt2_zero3.py": (3, 1, "cpu", 4),
            "llama3_8b_zero3_offload.py": (3, 1, "cpu", 1), "qwen2_5_7b_zero3.py": (3, 2, "none", 8),
            "llama_tiny_cpu.py": (2, 1, "none", 2), "llama_continue_cpu.py": (3, 1, "none", 2)}


def test_every_shipped_config_is_tested():
    assert CONFIGS == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_config_loads_and_resolves(name, tmp_path):
    path = os.path.join(ROOT, "configs", name)
    cfg = Config.from_file(path)
    stage, accum, param_offload, world = EXPECTED[name]
    dp = ParallelDims.from_config(parallel_config(cfg), world).dp
    eng = engine_config(cfg, world_size=dp)
    assert (eng.zero.stage, eng.gradient_accumulation, eng.zero.offload_param.device) == (stage, accum, param_offload)
    train_config(cfg), lr_scheduler_config(cfg), data_config(cfg)
    Config.from_file(path).apply_overrides(["train.max_steps=3"])       # overrides validate too
    # plain data, 10-40 lines, the launch command in the header comment
    text = open(path).read()
    assert 10 <= len(text.splitlines()) <= 40
    assert re.search(rf"(zerogpt run|torchrun|python) .*train_gpt\.py --config configs/{name}", text)
    # the model section builds (on the meta device: shapes only, no memory even for XL; a checkpoint to continue
    # is the user's, as train_gpt.model_on_meta builds it for preflight: the factory's shape, nothing read)
    model_cfg = {k: v for k, v in dict(cfg.model).items() if k != "pretrained"}
    if model_cfg["type"] == "hf":  # the checkpoint the demo exports first: one of the same family stands in
        model_cfg["path"] = str(tmp_path)
        make_hf_model("llama", tmp_path)
    with torch.device("meta"):
        model = build_model(model_cfg, vocab_size=None if model_cfg["type"] == "hf" else 50257)
    assert model.num_params() > 0


def test_seed_tutorial_config_is_kept_as_written():
    ours = Config.from_file(os.path.join(ROOT, "configs", "gpt2_zero3.py"))
    seed = Config.from_file(os.path.join(ROOT, "tests", "assets", "configs", "colossalai_gpt2_zero3.py"))
    assert ours.to_dict() == seed.to_dict()


def test_resolved_config_round_trips(tmp_path):
    cfg = Config.from_file(os.path.join(ROOT, "configs", "demo_cpu.py")).apply_overrides(["zero.stage=3"])
    (tmp_path / "config.py").write_text(cfg.to_python())
    again = Config.from_file(str(tmp_path / "config.py"))
    assert engine_config(again, 2).zero.stage == 3 and again.train.output_dir == "runs/demo_cpu"


@pytest.mark.parametrize("name", ["gpt2_medium_tp2.py", "gpt2_medium_pp2.py"])
def test_seed_megatron_configs_pass_preflight_on_2_ranks_and_not_on_3(name):
    cfg = Config.from_file(os.path.join(ROOT, "configs", name))
    data = data_config(cfg)
    built = []

    def model():
        built.append(train_gpt.model_on_meta(cfg, data))
        return built[-1]

    dims = check_parallel(cfg, 2, model)
    assert (dims.tp * dims.pp, dims.dp) == (2, 1) and dims.world_size == 2
    assert built[0].config.n_layer == 24 and built[0].config.n_head == 16       # GPT-2 medium, shapes only
    assert built[0].lm_head.weight.device.type == "meta"
    with pytest.raises(PreflightError) as e:
        check_parallel(cfg, 3, model)
    assert "world size 3" in str(e.value) and "parallel.tensor.size" in str(e.value) \
        and "parallel.pipeline" in str(e.value)
