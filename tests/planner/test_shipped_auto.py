"""The shipped plan="auto" configs set no memory key, and plan for the hand-tuned configs' machine (one 80 GB GPU,
128 GB of host RAM) a plan that fits it, at the hand-tuned configs' tokens per step."""
import os

import pytest

import train_gpt
from zerogpt.config import Config, data_config
from zerogpt.memory_model import ModelShape
from zerogpt.planner.config_plan import workload_from_config
from zerogpt.planner.plan import GIB, Machine
from zerogpt.planner.search import search
from zerogpt.planner.speed import default_constants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIRS = [("gpt2_xl_auto.py", "gpt2_xl_zero3_offload.py"), ("llama3_8b_auto.py", "llama3_8b_zero3_offload.py")]
MEMORY_KEYS = ("zero", "BATCH_SIZE", "GRADIENT_ACCUMULATION", "GLOBAL_BATCH_SIZE")


@pytest.mark.parametrize("auto,hand", PAIRS)
def test_auto_config_plans_for_the_hand_tuned_machine(auto, hand):
    cfg = Config.from_file(os.path.join(ROOT, "configs", auto))
    tuned = Config.from_file(os.path.join(ROOT, "configs", hand))
    assert cfg.plan == "auto" and not any(k in cfg for k in MEMORY_KEYS)
    assert not {"checkpoint", "chunked_loss"} & set(cfg.model)
    assert cfg.TOKENS_PER_STEP == tuned.BATCH_SIZE * tuned.GRADIENT_ACCUMULATION * tuned.SEQ_LEN
    model = train_gpt.model_on_meta(cfg, data_config(cfg))
    work = workload_from_config(cfg, ModelShape.from_config(model.config), 1, model.config)
    assert work.fixed == {}
    machine = Machine(device_bytes=80 * GIB, host_bytes=128 * GIB, name="NVIDIA H100 80GB HBM3")
    best = search(work, machine, default_constants(machine)).best
    assert best.need["device"] <= 0.9 * 80 * GIB and best.need["host"] <= 0.9 * 128 * GIB
