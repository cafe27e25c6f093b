"""zerogpt/preflight_memory.py: a run whose model state cannot fit the host's RAM or the offload disk is refused
before anything is built, in one line with both numbers and the fix (issue 30 point 5)."""
import os
import time

import pytest
import torch

import train_gpt
from model_zoo.gpt import GPT, GPTConfig, gpt2_xl
from zerogpt import preflight_memory
from zerogpt.config import Config
from zerogpt.preflight import PreflightError

GIB = 2**30
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def largest_model_config(layers: int) -> Config:
    """The gpu-results "Largest model" run: hidden 2560, stage 3, parameters and Adam state on the host, bf16."""
    return Config(dict(BATCH_SIZE=4, SEQ_LEN=1024, precision="bf16",
                       zero=dict(stage=3, offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu")),
                       model=dict(type=gpt2_xl, n_layer=layers, n_embd=2560, n_head=20)))


def on_meta(layers: int):
    def build():
        with torch.device("meta"):
            return GPT(GPTConfig(n_layer=layers, n_embd=2560, n_head=20))
    return build


def test_host_too_small_is_refused_with_both_numbers_and_the_fix(monkeypatch):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (60 * GIB, "MemAvailable"))
    with pytest.raises(PreflightError) as e:
        preflight_memory.check_memory(largest_model_config(69), 1, on_meta(69), on_gpu=True)
    msg = str(e.value)
    assert "\n" not in msg
    # 5.56B params x (2 bf16 param + 2 bf16 grad as it crossed + 4 master + 8 Adam) bytes on the host = 82.9 GiB
    assert "needs at least 82.9 GiB" in msg and "60.0 GiB is available (MemAvailable)" in msg, msg
    assert "zero.offload_optimizer.device=disk" in msg and "--set model.n_layer=" in msg, msg
    fit = int(msg.split("model.n_layer=")[1].split()[0])
    assert 40 <= fit < 69
    result = preflight_memory.check_memory(largest_model_config(fit), 1, on_meta(fit), on_gpu=True)
    assert result["host"][0] <= 60 * GIB                      # the layer count it names does fit


def test_bf16_moments_take_4_bytes_per_param_off_the_host(monkeypatch):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (80 * GIB, "MemAvailable"))
    cfg = largest_model_config(69)
    with pytest.raises(PreflightError, match="zero.offload_optimizer.state_dtype=bf16"):
        preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)
    cfg.zero["offload_optimizer"] = dict(device="cpu", state_dtype="bf16")
    need, _ = preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)["host"]
    assert 62 * GIB < need < 70 * GIB  # 5.56B x 12 bytes (2 bf16 param + 2 grad + 4 master + 4 moments) + buffers


def test_what_fits_passes_and_disk_offload_moves_the_state_off_the_host(monkeypatch, tmp_path):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (126 * GIB, "MemAvailable"))
    need, available = preflight_memory.check_memory(largest_model_config(48), 1, on_meta(48), on_gpu=True)["host"]
    assert need < available
    cfg = largest_model_config(69)
    cfg.zero["offload_optimizer"] = dict(device="disk", path=str(tmp_path))
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (60 * GIB, "MemAvailable"))
    monkeypatch.setattr(preflight_memory, "free_disk_bytes", lambda path: 10 * GIB)
    with pytest.raises(PreflightError, match=r"^disk: this run writes 62.\d GiB of optimizer state .* but it has "
                                             r"10.0 GiB free; point zero.offload_optimizer.path"):
        preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)   # host: 6 B/param, fits in 60 GiB


def test_available_memory_is_the_kernels():
    available, source = preflight_memory.available_host_bytes()
    assert 0 < available < 2**50 and (source == "MemAvailable" or source.startswith("cgroup"))


def test_train_gpt_ends_in_seconds_with_the_line(tmp_path, monkeypatch, capsys):
    """An artificially low limit: GPT-2 XL on 4 GiB of host RAM is refused before any process group or file."""
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (4 * GIB, "MemAvailable"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = ["--config", os.path.join(CONFIGS, "gpt2_xl_zero3_offload.py"), "--set", "data.mock=True",
            "--set", f"train.output_dir={tmp_path / 'run'}"]
    start = time.perf_counter()
    assert train_gpt.main(argv) == 1
    assert time.perf_counter() - start < 20
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: host memory: this run needs at least "), err
    assert "GiB is available (MemAvailable); keep Adam's moments in bf16" in err[0], err
    assert "or put the optimizer state on disk" in err[0], err
    assert not (tmp_path / "run").exists()


def test_compile_counts_a_block_gathered_whole(monkeypatch):
    """compile = True at stage 3: the chunk buffers are a whole block's plus the next `prefetch` modules'
    (memory_model.buffer_bytes(gather_per_block=True)), with the config's chunk size; on a CPU run (every home
    but disk is host RAM) the need grows by exactly that difference, under tensor parallelism too."""
    from zerogpt.memory_model import ModelShape, buffer_bytes
    from zerogpt.zero import TensorShardStrategy

    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (2**50, "MemAvailable"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def need(compile_: bool, tensor: int = 1) -> int:
        cfg = Config(dict(BATCH_SIZE=1, SEQ_LEN=16, precision="fp32", compile=compile_,
                          parallel=dict(tensor=dict(size=tensor)),
                          zero=dict(stage=3, shard_strategy=TensorShardStrategy(), prefetch=2)))

        def build():
            with torch.device("meta"):
                return GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, vocab_size=128, max_position_embeddings=16))
        return preflight_memory.check_memory(cfg, tensor, build, on_gpu=False)["host"][0]

    shape = ModelShape(layers=4, hidden=64, heads=2, vocab=128, positions=16, pad_vocab_multiple=1)
    eager, whole = (buffer_bytes(shape, 3, 1, "fp32", "none", 2, 0, gather_per_block=g)["device"] for g in (0, 1))
    assert whole > eager
    assert need(True) - need(False) == whole - eager
    assert need(True, tensor=2) - need(False, tensor=2) == 2 * (whole - eager)  # two ranks on this host
